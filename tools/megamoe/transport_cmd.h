// `megamoe launch` and `megamoe bench-transport`: the EP transport's subcommands.
//
//   megamoe launch -n N -- <command...>     start N processes of <command> on this host, one per GPU,
//                                           with MEGAMOE_RANK / MEGAMOE_WORLD_SIZE / MEGAMOE_LOCAL_RANK /
//                                           MEGAMOE_NCCL_ID_FILE set; forwards the first failing exit
//                                           code (128+signal for a signal) and stops the others.
//   megamoe bench-transport [flags]         dispatch / combine µs and GB/s per direction beside an NCCL
//                                           all-to-all of the same bytes (one process driving --ranks
//                                           GPUs, or one rank per process under `megamoe launch`).
#pragma once

namespace CLI {
class App;
}

namespace megamoe::tool {

// Adds both subcommands to `app`. Each runs from its CLI11 callback (during app.parse()) and records
// its exit code; main() then returns it:
//   int code; if (megamoe::tool::transport_command_result(&code)) return code;
void register_transport_commands(CLI::App& app);
// True (with the exit code) when one of these subcommands ran.
bool transport_command_result(int* exit_code);

}  // namespace megamoe::tool
