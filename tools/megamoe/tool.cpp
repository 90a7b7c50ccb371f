// The `megamoe` tool's entry: every subcommand registered on one CLI11 app, the chosen one run, its
// failures turned into "megamoe <command>: error: <what>" and an exit code (docs/TOOL.md).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "commands.h"
#include "presets.h"

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "unknown"
#endif

namespace megamoe::tool {

std::vector<std::pair<std::string, CommandRun>> add_all_commands(CLI::App* app) {
  return {{"info", add_info_command(app)},
          {"check", add_check_command(app)},
          {"bench", add_bench_command(app)},
          {"bench-gemm", add_gemm_bench_command(app)},
          {"bench-transport", add_transport_bench_command(app)},
          {"bench-link", add_link_bench_command(app)},
          {"tune", add_tune_command(app)},
          {"plot", add_plot_command(app)},
          {"launch", add_launch_command(app)}};
}

namespace {

// The tool's app: every subcommand registered, exactly one required.
std::vector<std::pair<std::string, CommandRun>> init_app(CLI::App* app) {
  app->set_version_flag("--version", "megamoe " MEGAMOE_VERSION);
  app->require_subcommand(1);
  app->fallthrough(false);
  return add_all_commands(app);
}

constexpr const char* kDescription =
    "megamoe " MEGAMOE_VERSION
    " — the expert-parallel MoE layer: inspect a geometry, check a backend against the float64 reference, benchmark it";

// "megamoe <subcommand...>" as far as the parse got.
std::string command_path(const CLI::App& app) {
  std::string cmd = "megamoe";
  for (const CLI::App* sub : app.get_subcommands()) cmd += " " + sub->get_name();
  return cmd;
}

int parse_and_run(int argc, char** argv) {
  CLI::App app{kDescription, "megamoe"};
  const auto commands = init_app(&app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string cmd = command_path(app);
    std::fprintf(stderr, "%s: error: %s\nrun '%s --help' for the flags and their values\n", cmd.c_str(), e.what(),
                 cmd.c_str());
    return kExitUsage;
  }
  const std::string name = app.get_subcommands().front()->get_name();
  for (const auto& [command, run] : commands) {
    if (command != name) continue;
    try {
      return run();
    } catch (const ToolError& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "megamoe %s: error: %s\n", name.c_str(), e.what());
      return e.code();
    }
  }
  std::fprintf(stderr, "megamoe: error: unknown subcommand '%s'\n", name.c_str());
  return kExitUsage;
}

}  // namespace

int parse_tool_args(int argc, char** argv, std::string* message) {
  CLI::App app{kDescription, "megamoe"};
  const auto commands = init_app(&app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    return kExitOk;
  } catch (const CLI::CallForVersion&) {
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    if (message) *message = command_path(app) + ": error: " + e.what();
    return kExitUsage;
  }
  return kExitOk;
}

int run_tool(int argc, char** argv) {
  // invariant: no exception leaves run_tool; every failure becomes a message and a non-zero exit code.
  try {
    return parse_and_run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe: error: out of host memory (try --experts N or a smaller preset)\n");
    return kExitUnavailable;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe: error: %s\n", e.what());
    return kExitUnavailable;
  } catch (...) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe: error: unexpected exception\n");
    return kExitUnavailable;
  }
}

}  // namespace megamoe::tool
