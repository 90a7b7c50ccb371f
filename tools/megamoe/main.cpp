// megamoe — the command-line tool (tool.cpp; docs/TOOL.md describes the commands).
#include <cstdio>

#include "commands.h"

int main(int argc, char** argv) {
  // Line-buffered stdout keeps result lines and stderr progress lines in order when both are piped.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  return megamoe::tool::run_tool(argc, argv);
}
