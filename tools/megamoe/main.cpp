// megamoe — command-line tool: `info` (build, devices, geometry, workspace), `check` (one forward
// against the float64 reference) and `bench` (timed forwards with the H200 floor). docs/TOOL.md
// describes the commands, flags, exit codes and the dump format.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "commands.h"
#include "gemm_cmd.h"
#include "transport_cmd.h"
#include "presets.h"

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "unknown"
#endif

namespace {

using megamoe::tool::CommandRun;
using megamoe::tool::kExitUsage;

int run_tool(int argc, char** argv) {
  CLI::App app{"megamoe " MEGAMOE_VERSION
               " — the expert-parallel MoE layer: inspect a geometry, check a backend against the float64 "
               "reference, benchmark it",
               "megamoe"};
  app.set_version_flag("--version", "megamoe " MEGAMOE_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);

  CommandRun run_info = megamoe::tool::add_info_command(&app);
  CommandRun run_check = megamoe::tool::add_check_command(&app);
  CommandRun run_bench = megamoe::tool::add_bench_command(&app);
  CommandRun run_bench_gemm = megamoe::tool::add_gemm_bench_command(&app);  // gemm_cmd.cpp
  CommandRun run_bench_link = megamoe::tool::add_link_bench_command(&app);  // link_cmd.cpp
  megamoe::tool::register_transport_commands(app);  // launch, bench-transport: run inside parse()

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string cmd = "megamoe";
    for (const CLI::App* sub : app.get_subcommands()) cmd += " " + sub->get_name();
    std::fprintf(stderr, "%s: error: %s\nrun '%s --help' for the flags and their values\n", cmd.c_str(), e.what(),
                 cmd.c_str());
    return kExitUsage;
  }

  int transport_code = 0;
  if (megamoe::tool::transport_command_result(&transport_code)) return transport_code;

  const std::string name = app.get_subcommands().front()->get_name();
  try {
    if (name == "info") return run_info();
    if (name == "check") return run_check();
    if (name == "bench") return run_bench();
    if (name == "bench-gemm") return run_bench_gemm();
    if (name == "bench-link") return run_bench_link();
  } catch (const megamoe::tool::ToolError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe %s: error: %s\n", name.c_str(), e.what());
    return e.code();
  }
  std::fprintf(stderr, "megamoe: error: unknown subcommand '%s'\n", name.c_str());
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered stdout keeps result lines and stderr progress lines in order when both are piped.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // invariant: no exception leaves main; every failure becomes a message and a non-zero exit code.
  try {
    return run_tool(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe: error: out of host memory (try --experts N or a smaller preset)\n");
    return megamoe::tool::kExitUnavailable;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe: error: %s\n", e.what());
    return megamoe::tool::kExitUnavailable;
  } catch (...) {
    std::fflush(stdout);
    std::fprintf(stderr, "megamoe: error: unexpected exception\n");
    return megamoe::tool::kExitUnavailable;
  }
}
