// `megamoe bench-gemm`: the grouped GEMM of the experts (src/kernels/gemm) timed on one GPU against
// cuBLASLt's dense fp8 GEMM of the same total size, measured in the same run (docs/GEMM.md).
#pragma once

#include "commands.h"

namespace CLI {
class App;
}

namespace megamoe::tool {

// Registers `bench-gemm` with a callback that runs it (CLI11 style; a failure exits through
// CLI::RuntimeError with the tool's exit code after printing "megamoe bench-gemm: error: ...").
void register_gemm_commands(CLI::App& app);
// The same subcommand in the add_*_command() style of commands.h: main() calls the returned
// function when `bench-gemm` was chosen.
CommandRun add_gemm_bench_command(CLI::App* app);

}  // namespace megamoe::tool
