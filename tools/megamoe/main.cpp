// megamoe — the command-line tool (tool.cpp; docs/TOOL.md describes the commands).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "commands.h"

int main(int argc, char** argv) {
  // Line-buffered stdout keeps result lines and stderr progress lines in order when both are piped.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // Logical ranks sharing a GPU need eagerly loaded kernels and a hardware work queue per rank's
  // stream (create_shared_gpu_group); set before the first CUDA call. Explicit settings win.
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--shared-gpu") == 0) {
      setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
      setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
    }
  return megamoe::tool::run_tool(argc, argv);
}
