// Shared pieces of the `megamoe` tool: exit codes, the error type subcommands throw, model presets,
// the flags every subcommand shares (geometry and formats) and the host-memory estimate.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/types.h"
#include "reference/problem.h"

namespace CLI {
class App;
}

namespace megamoe::tool {

// Exit codes of every subcommand (docs/TOOL.md lists them).
enum ExitCode : int {
  kExitOk = 0,
  kExitCheckFailed = 1,   // check: an error above its bound
  kExitUsage = 2,         // bad flag or value, refused geometry, memory or dump-size refusal
  kExitUnavailable = 3,   // the backend could not be built or run (capability gate, layer error)
  kExitIo = 4,            // a file could not be written
};

// What a subcommand throws; main() prints "megamoe <cmd>: error: <message>" and exits with `code`.
class ToolError : public std::runtime_error {
 public:
  ToolError(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

struct Preset {
  const char* name;
  int64_t hidden, intermediate, num_experts, top_k;
  const char* model;
};

const std::vector<Preset>& all_presets();
const Preset* find_preset(const std::string& name);
std::string preset_names();  // "deepseek-v3, deepseek-v4-flash, ..."

// Flags shared by info, check and bench (all but --preset, --tokens and --backend).
struct LayerOptions {
  std::string preset;
  std::string ep = "1";
  std::string experts;     // empty: the preset's expert count
  std::string max_tokens;  // empty: the --tokens value (bench: the case's tokens)
  std::string weight_format = to_string(WeightFormat::kFp8Block);
  std::string dispatch_format = to_string(DispatchFormat::kFp8Block);
  std::string combine_dtype = to_string(CombineDtype::kBf16);
  bool in_kernel_fc2_reduce = false;
  bool owner_reduce = false;     // --owner-reduce: on
  bool no_owner_reduce = false;  // --no-owner-reduce: off (neither: auto)
  bool pow2_scales = false;
  bool pad = false;
  bool shared_gpu = false;  // --shared-gpu: the --ep ranks as logical ranks of GPU 0 (GPU backends)
  // Explicit dims instead of --preset (add_shape_options: tune): all four, --experts among them.
  std::string hidden, intermediate, top_k;
};

void add_layer_options(CLI::App* app, LayerOptions* o, bool with_pow2_scales);
// --hidden, --intermediate, --top-k (with --experts from add_layer_options: a geometry without a preset).
void add_shape_options(CLI::App* app, LayerOptions* o);

// --routing: uniform | single-expert | dropped.
reference::Routing parse_routing_flag(const std::string& text);

// Integer flag values: "invalid value for --ep: 'x', must be an integer in [1, 4096]".
int64_t parse_int_flag(const std::string& flag, const std::string& text, int64_t min, int64_t max);
// Comma-separated integers ("1,16,128"), each in [min, max]; at least one.
std::vector<int64_t> parse_int_list_flag(const std::string& flag, const std::string& text, int64_t min,
                                         int64_t max);
std::vector<std::string> split_list(const std::string& text);

// The geometry of rank 0: the preset (or, without one, the explicit dims), overridden by --experts
// and --ep, padded with --pad, with the given per-rank token bound. Throws ToolError (kExitUsage)
// naming the flag, value and rule.
MoeGeometry make_geometry(const LayerOptions& o, int64_t max_tokens_per_rank);
// The config for `backend` with the format flags. Throws ToolError naming the flag and rule.
MoeConfig make_config(const LayerOptions& o, Backend backend);
Backend parse_backend_flag(const std::string& flag, const std::string& text);

// ---- memory ----
// The machine's memory: MemTotal from /proc/meminfo (sysconf where that cannot be read). On a machine
// whose memory grows on use it reads low at start.
int64_t physical_memory_bytes();
// Bytes of one expert's prepared weights (w13 + w2 data and scales) in `format`.
int64_t prepared_bytes_per_expert(WeightFormat format, int64_t hidden, int64_t intermediate);
// fp32 bytes of all experts' w13 and w2.
int64_t fp32_weight_bytes(const MoeGeometry& g);
// Whether a layer's prepared weights in `format` can be handed back to MoeLayer::create as source
// weights that it keeps bit for bit (every format but mxfp8, PreparedWeights::as_source): bench reuses the
// first case's prepared copy for the later cases instead of generating the weights again.
bool reusable_source_format(WeightFormat format);

struct HostMemoryEstimate {
  int64_t bytes = 0;
  std::string detail;  // what the bytes are made of
};
// Host memory a run needs at its peak, while the layers are created: every rank's fp32 source slice
// (all ranks create at once, each frees its slice as soon as its layer is built), the layers' prepared
// copies, the GPU upload's staging copy (GPU backends) or the cpu backend's fp32 working copy, and the
// inputs/outputs. After creation the slices give way to the check's fp32 dequantised copy of all
// experts (`dequantised_copy`) or to bench's reused prepared copy (reusable_source_format), never more.
HostMemoryEstimate estimate_host_memory(const MoeGeometry& g, const MoeConfig& c, Backend resolved,
                                        int64_t tokens_per_rank, bool dequantised_copy);

// --max-host-gb G as given (validated by host_memory_limit).
struct MaxHostGbOption {
  bool given = false;
  std::string value;
};
void add_max_host_gb_option(CLI::App* app, MaxHostGbOption* o);

// The host-memory limit: 60% of physical_memory_bytes(), or what --max-host-gb says.
struct HostMemoryLimit {
  int64_t bytes = 0;     // the limit
  int64_t physical = 0;  // what the machine reports (0: unknown)
  MaxHostGbOption flag;  // given: the limit is flag.value GB
};
// Throws ToolError (kExitUsage) unless a given --max-host-gb is a positive number of GB (10^9 bytes).
HostMemoryLimit host_memory_limit(const MaxHostGbOption& max_host_gb = {});
// Whether the estimate fits in the allowed fraction of physical memory (~60%).
bool fits_host_memory(const HostMemoryEstimate& e, int64_t* limit_bytes = nullptr);
bool fits_host_memory(const HostMemoryEstimate& e, const HostMemoryLimit& limit);
// "--experts 32 needs about 9.10 GB": the largest expert count below g's (a multiple of ep_size, at
// least top_k) whose estimate fits the limit; empty when none does.
std::string experts_hint(const MoeGeometry& g, const HostMemoryLimit& limit,
                         const std::function<HostMemoryEstimate(const MoeGeometry&)>& estimate);
// Throws ToolError (kExitUsage) when the estimate is above the limit: the bytes needed and seen, what
// they are made of, --max-host-gb for a machine that has more than it reports, `hint` (experts_hint)
// or --experts N, and the smaller presets.
void require_host_memory(const HostMemoryEstimate& e, const HostMemoryLimit& limit, const std::string& preset,
                         const std::string& hint);

// "45.10 GB (45097156608 bytes)"
std::string format_bytes(int64_t bytes);
std::string format_mib(int64_t bytes);

// Shell-quoted argument (for the reproducing command lines).
std::string shell_quote(const std::string& s);

}  // namespace megamoe::tool
