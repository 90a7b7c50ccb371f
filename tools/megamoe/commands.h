// The subcommands of the `megamoe` tool. Each add_*_command() registers its flags on `app` and returns
// the function main() runs when that subcommand was chosen (it returns the exit code, or throws
// ToolError).
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace megamoe::tool {

using CommandRun = std::function<int()>;

CommandRun add_info_command(CLI::App* app);
CommandRun add_check_command(CLI::App* app);
CommandRun add_bench_command(CLI::App* app);
CommandRun add_link_bench_command(CLI::App* app);  // link_cmd.cpp: bench-link

}  // namespace megamoe::tool
