// The subcommands of the `megamoe` tool. Each add_*_command() registers its flags on `app` and returns
// the function to run when that subcommand was chosen (it returns the exit code, or throws
// ToolError). Registering and parsing run nothing: a flag parser can be driven on its own (a fuzz
// target parses with add_all_commands() and never calls the returned functions).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace megamoe::tool {

using CommandRun = std::function<int()>;

CommandRun add_info_command(CLI::App* app);             // info.cpp
CommandRun add_check_command(CLI::App* app);            // check.cpp
CommandRun add_bench_command(CLI::App* app);            // bench.cpp
CommandRun add_gemm_bench_command(CLI::App* app);       // gemm_cmd.cpp: bench-gemm
CommandRun add_transport_bench_command(CLI::App* app);  // transport_cmd.cpp: bench-transport
CommandRun add_link_bench_command(CLI::App* app);       // link_cmd.cpp: bench-link
CommandRun add_launch_command(CLI::App* app);           // transport_cmd.cpp: launch
CommandRun add_tune_command(CLI::App* app);             // tune_cmd.cpp: tune
CommandRun add_plot_command(CLI::App* app);             // plot.cpp: plot

// Every subcommand on `app`, with the function that runs it, by name.
std::vector<std::pair<std::string, CommandRun>> add_all_commands(CLI::App* app);

// The tool's flag parse alone, as run_tool() parses: registers every subcommand and parses argv,
// running no command. kExitOk for a valid command line (or --help, --version: nothing printed), else
// kExitUsage with "megamoe <command>: error: <what>" in *message. Only CLI11's parse errors are
// caught: any other exception from a flag's check escapes (a fuzz target counts it as a crash).
int parse_tool_args(int argc, char** argv, std::string* message);

// The whole tool: registers every subcommand, parses argv, runs the chosen one and turns every
// failure into a message and an exit code (docs/TOOL.md). No exception leaves it.
int run_tool(int argc, char** argv);

}  // namespace megamoe::tool
