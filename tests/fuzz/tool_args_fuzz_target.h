// The `megamoe` tool's flag parse as a fuzz target (parse_tool_args, tools/megamoe/commands.h): every
// subcommand registered, argv parsed, no command run. Shared by the libFuzzer binary
// (tests/fuzz/fuzz_tool_args.cpp, scripts/fuzz.sh) and the CPU test that replays mutations of the seed
// corpus (tests/cpu/test_tool_args_fuzz.cpp). The input is argv after "megamoe", one argument a line.
// Any argv gives a valid parse or a usage error with a message naming the command; any other
// exception escapes to libFuzzer (or the test) as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.h"
#include "fuzz/fuzz_input.h"
#include "presets.h"

namespace megamoe::fuzz {

// The exit code of the parse (kExitOk or kExitUsage); aborts when a refusal has no message.
inline int tool_args_one_input(const uint8_t* data, size_t size) {
  std::vector<std::string> args = split_lines(data, size);
  if (size == 0) args.clear();
  args.insert(args.begin(), "megamoe");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string message;
  const int code = tool::parse_tool_args(static_cast<int>(args.size()), argv.data(), &message);
  if (code != tool::kExitOk && code != tool::kExitUsage) std::abort();
  if (code == tool::kExitUsage && message.rfind("megamoe", 0) != 0) std::abort();
  return code;
}

}  // namespace megamoe::fuzz
