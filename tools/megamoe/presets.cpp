#include "presets.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <cstdio>
#include <limits>

namespace megamoe::tool {

const std::vector<Preset>& all_presets() {
  static const std::vector<Preset> presets = {
      {"deepseek-v3", 7168, 2048, 256, 8, "DeepSeek-V3 / R1"},
      {"deepseek-v4-flash", 4096, 2048, 256, 6, "DeepSeek-V4-Flash"},
      {"qwen3-235b-a22b", 4096, 1536, 128, 8, "Qwen3-235B-A22B"},
      {"qwen3-30b-a3b", 2048, 768, 128, 8, "Qwen3-30B-A3B"},
      {"gpt-oss-120b", 2880, 2880, 128, 4, "gpt-oss-120b (needs --pad: 2880 is not a multiple of 128)"},
      {"mixtral-8x7b", 4096, 14336, 8, 2, "Mixtral-8x7B"},
      {"tiny", 512, 256, 16, 4, "small shape for CPU runs and tests"},
  };
  return presets;
}

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : all_presets())
    if (name == p.name) return &p;
  return nullptr;
}

std::string preset_names() {
  std::string s;
  for (const Preset& p : all_presets()) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

void add_layer_options(CLI::App* app, LayerOptions* o, bool with_pow2_scales) {
  app->add_option("--ep", o->ep, "expert-parallel ranks R (host threads for the cpu backend)")
      ->type_name("R")
      ->default_str(o->ep);
  app->add_flag("--shared-gpu", o->shared_gpu,
                "GPU backends: the --ep ranks as logical ranks sharing GPU 0 (create_shared_gpu_group), each with "
                "SMs / R of it, instead of one GPU per rank");
  app->add_option("--experts", o->experts,
                  "override the preset's expert count (for CPU-sized runs); must be divisible by --ep")
      ->type_name("N");
  app->add_option("--max-tokens", o->max_tokens,
                  "max_tokens_per_rank of the layer (default: the --tokens value, per rank)")
      ->type_name("T");
  app->add_option("--weight-format", o->weight_format, "bf16 | fp8-block | mxfp8 | nvfp4 | mxfp4")
      ->type_name("F")
      ->default_str(o->weight_format);
  app->add_option("--dispatch-format", o->dispatch_format, "bf16 | fp8-block")
      ->type_name("F")
      ->default_str(o->dispatch_format);
  app->add_option("--combine-dtype", o->combine_dtype, "bf16 | mxfp8 | nvfp4")
      ->type_name("D")
      ->default_str(o->combine_dtype);
  app->add_flag("--in-kernel-fc2-reduce", o->in_kernel_fc2_reduce,
                "FC2 adds bf16 partials straight into the source rank's output (bf16 combine only)");
  CLI::Option* owner = app->add_flag("--owner-reduce", o->owner_reduce,
                                     "each owner rank sums its experts' partials of a token and sends one combine "
                                     "row per (token, owner rank) (default: with a quantised combine wire)");
  app->add_flag("--no-owner-reduce", o->no_owner_reduce,
                "one combine row per (token, slot), summed in slot order: bits independent of --ep")
      ->excludes(owner);
  if (with_pow2_scales)
    app->add_flag("--pow2-scales", o->pow2_scales, "power-of-two (ue8m0) fp32 scales for the fp8-block formats");
  app->add_flag("--pad", o->pad, "round hidden and intermediate up to a multiple of 128 (MoeGeometry::padded())");
}

int64_t parse_int_flag(const std::string& flag, const std::string& text, int64_t min, int64_t max) {
  const std::string rule = "must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used, 10);
  } catch (const std::exception&) {
    throw ToolError(kExitUsage, "invalid value for " + flag + ": '" + text + "', " + rule);
  }
  if (used != text.size() || v < min || v > max)
    throw ToolError(kExitUsage, "invalid value for " + flag + ": '" + text + "', " + rule);
  return v;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<int64_t> parse_int_list_flag(const std::string& flag, const std::string& text, int64_t min,
                                         int64_t max) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text)) {
    if (item.empty())
      throw ToolError(kExitUsage, "invalid value for " + flag + ": '" + text +
                                      "', must be a comma-separated list of integers (empty item)");
    out.push_back(parse_int_flag(flag, item, min, max));
  }
  return out;
}

Backend parse_backend_flag(const std::string& flag, const std::string& text) {
  Backend b = Backend::kAuto;
  const Status st = parse_backend(text, &b);
  if (!st) throw ToolError(kExitUsage, "invalid value for " + flag + ": '" + text + "', must be auto, mega, routed or cpu");
  return b;
}

namespace {

// The dims of --preset, or of --hidden/--intermediate/--experts/--top-k without one.
Preset preset_or_dims(const LayerOptions& o) {
  const bool dims = !o.hidden.empty() || !o.intermediate.empty() || !o.top_k.empty();
  if (!o.preset.empty() && dims)
    throw ToolError(kExitUsage, "--preset " + o.preset + " and --hidden/--intermediate/--top-k: give one of them");
  if (o.preset.empty() && dims) {
    for (const auto& [flag, v] : {std::pair<const char*, const std::string*>{"--hidden", &o.hidden},
                                  {"--intermediate", &o.intermediate},
                                  {"--experts", &o.experts},
                                  {"--top-k", &o.top_k}})
      if (v->empty())
        throw ToolError(kExitUsage, std::string("explicit dims need --hidden, --intermediate, --experts and --top-k: ") +
                                        flag + " is missing");
    return Preset{"", parse_int_flag("--hidden", o.hidden, 1, 1 << 16),
                  parse_int_flag("--intermediate", o.intermediate, 1, 1 << 16),
                  parse_int_flag("--experts", o.experts, 1, 4096), parse_int_flag("--top-k", o.top_k, 1, 64), ""};
  }
  const Preset* p = find_preset(o.preset);
  if (!p)
    throw ToolError(kExitUsage, "unknown preset: --preset '" + o.preset + "', must be one of: " + preset_names());
  return *p;
}

}  // namespace

void add_shape_options(CLI::App* app, LayerOptions* o) {
  app->add_option("--hidden", o->hidden, "hidden size H (explicit dims, with --intermediate, --experts, --top-k)")
      ->type_name("H");
  app->add_option("--intermediate", o->intermediate, "expert intermediate size I (explicit dims)")->type_name("I");
  app->add_option("--top-k", o->top_k, "experts per token (explicit dims)")->type_name("K");
}

reference::Routing parse_routing_flag(const std::string& s) {
  if (s == "uniform") return reference::Routing::kUniform;
  if (s == "single-expert") return reference::Routing::kSingleExpert;
  if (s == "dropped") return reference::Routing::kWithDropped;
  throw ToolError(kExitUsage, "invalid value for --routing: '" + s + "', must be uniform, single-expert or dropped");
}

MoeGeometry make_geometry(const LayerOptions& o, int64_t max_tokens_per_rank) {
  const Preset preset = preset_or_dims(o);
  const Preset* p = &preset;
  MoeGeometry g;
  g.hidden = p->hidden;
  g.intermediate = p->intermediate;
  g.num_experts = p->num_experts;
  g.top_k = p->top_k;
  g.ep_size = parse_int_flag("--ep", o.ep, 1, 4096);
  g.ep_rank = 0;
  g.max_tokens_per_rank = max_tokens_per_rank;
  if (!o.experts.empty()) {
    g.num_experts = parse_int_flag("--experts", o.experts, 1, 4096);
    if (g.num_experts < g.top_k)
      throw ToolError(kExitUsage, "invalid value for --experts: " + o.experts + ", must be at least top_k=" +
                                      std::to_string(g.top_k) + " of preset " + o.preset);
  }
  if (g.num_experts % g.ep_size != 0)
    throw ToolError(kExitUsage, "invalid value for --ep: " + o.ep + ", num_experts=" + std::to_string(g.num_experts) +
                                    " must be divisible by it (choose --ep dividing it, or --experts)");
  const bool aligned = g.hidden % kDimAlignment == 0 && g.intermediate % kDimAlignment == 0;
  if (!aligned) {
    const MoeGeometry padded = g.padded();
    if (!o.pad) {
      std::string what;
      if (g.hidden % kDimAlignment) what += "hidden=" + std::to_string(g.hidden);
      if (g.intermediate % kDimAlignment)
        what += (what.empty() ? "" : " and ") + std::string("intermediate=") + std::to_string(g.intermediate);
      throw ToolError(kExitUsage, "preset " + o.preset + ": " + what + " not a multiple of " +
                                      std::to_string(kDimAlignment) + " (one fp8 1x128 scale block); rerun with --pad "
                                      "to pad to hidden=" + std::to_string(padded.hidden) + ", intermediate=" +
                                      std::to_string(padded.intermediate) +
                                      " (a zero-padded layer computes the same function)");
    }
    g = padded;
  }
  const Status st = g.validate();
  if (!st) throw ToolError(kExitUsage, st.message());
  return g;
}

MoeConfig make_config(const LayerOptions& o, Backend backend) {
  MoeConfig c;
  c.backend = backend;
  if (!parse_weight_format(o.weight_format, &c.weight_format))
    throw ToolError(kExitUsage, "invalid value for --weight-format: '" + o.weight_format +
                                    "', must be bf16, fp8-block, mxfp8, nvfp4 or mxfp4");
  if (!parse_dispatch_format(o.dispatch_format, &c.dispatch_format))
    throw ToolError(kExitUsage,
                    "invalid value for --dispatch-format: '" + o.dispatch_format + "', must be bf16 or fp8-block");
  if (!parse_combine_dtype(o.combine_dtype, &c.combine_dtype))
    throw ToolError(kExitUsage,
                    "invalid value for --combine-dtype: '" + o.combine_dtype + "', must be bf16, mxfp8 or nvfp4");
  c.in_kernel_fc2_reduce = o.in_kernel_fc2_reduce;
  c.owner_reduce = o.owner_reduce ? OwnerReduce::kOn : o.no_owner_reduce ? OwnerReduce::kOff : OwnerReduce::kAuto;
  c.pow2_scales = o.pow2_scales;
  const Status st = c.validate();
  if (!st) {
    std::string flag;
    if (c.in_kernel_fc2_reduce && c.combine_dtype != CombineDtype::kBf16)
      flag = " (--in-kernel-fc2-reduce needs --combine-dtype bf16)";
    else if (c.owner_reduce == OwnerReduce::kOn && c.in_kernel_fc2_reduce)
      flag = " (drop --owner-reduce or --in-kernel-fc2-reduce)";
    else if (c.pow2_scales)
      flag = " (--pow2-scales needs --weight-format or --dispatch-format fp8-block)";
    throw ToolError(kExitUsage, st.message() + flag);
  }
  return c;
}

int64_t physical_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  long long kib = 0;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemTotal:" && kib > 0) return static_cast<int64_t>(kib) * 1024;
  }
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<int64_t>(pages) * page_size;
}

int64_t prepared_bytes_per_expert(WeightFormat format, int64_t hidden, int64_t intermediate) {
  // w13 is [2I, H] and w2 [H, I]: 3*H*I elements, reduced along H and I respectively.
  const int64_t elems = 3 * hidden * intermediate;
  switch (format) {
    case WeightFormat::kBf16: return 2 * elems;
    case WeightFormat::kFp8Block:  // fp32 per 128x128 block
      return elems + 4 * ((2 * intermediate / 128) * (hidden / 128) + (hidden / 128) * (intermediate / 128));
    case WeightFormat::kMxfp8: return elems + elems / 32;                 // e8m0 per 1x32
    case WeightFormat::kNvfp4: return elems / 2 + elems / 16 + 2 * 4;     // e4m3 per 1x16 + 2 global
    case WeightFormat::kMxfp4: return elems / 2 + elems / 32;             // e8m0 per 1x32
  }
  return 2 * elems;
}

int64_t fp32_weight_bytes(const MoeGeometry& g) { return g.num_experts * 3 * g.hidden * g.intermediate * 4; }

bool reusable_source_format(WeightFormat format) { return format != WeightFormat::kMxfp8; }

HostMemoryEstimate estimate_host_memory(const MoeGeometry& g, const MoeConfig& c, Backend resolved,
                                        int64_t tokens_per_rank, bool dequantised_copy) {
  HostMemoryEstimate e;
  const int64_t fp32 = fp32_weight_bytes(g);
  const int64_t prepared = g.num_experts * prepared_bytes_per_expert(c.weight_format, g.hidden, g.intermediate);
  const bool gpu = resolved == Backend::kRouted || resolved == Backend::kMega;
  // GPU upload: w13 (2 of the 3 H x I blocks) reordered for the SwiGLU epilogue in a host copy.
  const int64_t staging = gpu ? prepared / 3 * 2 : 0;
  // The cpu backend keeps an fp32 dequantised copy of its experts to compute with.
  const int64_t working = resolved == Backend::kCpu ? fp32 : 0;
  // After creation: the check's fp32 dequantised copy of all experts, or bench's reused prepared copy.
  const int64_t after = dequantised_copy ? fp32 : reusable_source_format(c.weight_format) ? prepared : 0;
  // Per rank and token: check: x (bf16 + fp32 copy), y (bf16 + fp32), fp64 reference output, ids and
  // weights; bench: the generated x, ids and weights, on the cpu backend also the staged copies of x, y,
  // ids and weights (GPU backends stage them on the device).
  const int64_t per_token = dequantised_copy         ? g.hidden * (2 + 4 + 2 + 4 + 8) + g.top_k * 8
                            : resolved == Backend::kCpu ? g.hidden * (2 + 2 + 2) + g.top_k * 16
                                                       : g.hidden * 2 + g.top_k * 8;
  const int64_t io = g.ep_size * tokens_per_rank * per_token;
  e.bytes = prepared + working + io + std::max(fp32 + staging, after);
  e.detail = "while the layers are created: the fp32 source slices of all " + std::to_string(g.ep_size) +
             " rank(s) " + format_bytes(fp32) + " + prepared (" + to_string(c.weight_format) + ") " +
             format_bytes(prepared);
  if (staging) e.detail += " + GPU upload staging " + format_bytes(staging);
  if (working) e.detail += " + the cpu backend's fp32 working copy " + format_bytes(working);
  e.detail += " + inputs/outputs " + format_bytes(io) + "; then the slices give way to " +
              (dequantised_copy ? "the fp32 dequantised copy for the reference " + format_bytes(after)
               : after           ? "the prepared copy reused by later cases " + format_bytes(after)
                                 : std::string("nothing"));
  return e;
}

HostMemoryLimit host_memory_limit(const MaxHostGbOption& max_host_gb) {
  HostMemoryLimit l;
  l.physical = physical_memory_bytes();
  l.flag = max_host_gb;
  if (!max_host_gb.given) {
    l.bytes = l.physical > 0 ? l.physical / 10 * 6 : std::numeric_limits<int64_t>::max();
    return l;
  }
  const std::string& text = max_host_gb.value;
  constexpr double kMaxGb = 1e6;
  double gb = 0;
  size_t used = 0;
  try {
    gb = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !(gb > 0) || !(gb <= kMaxGb))
    throw ToolError(kExitUsage, "invalid value for --max-host-gb: '" + text +
                                    "', must be a positive number of GB (10^9 bytes), at most 1000000");
  l.bytes = static_cast<int64_t>(gb * 1e9);
  return l;
}

void add_max_host_gb_option(CLI::App* app, MaxHostGbOption* o) {
  app->add_option_function<std::string>(
         "--max-host-gb",
         [o](const std::string& v) {
           o->given = true;
           o->value = v;
         },
         "host-memory limit in GB (10^9 bytes) instead of 60% of the memory the machine reports (for a machine "
         "whose memory grows on use)")
      ->type_name("G");
}

bool fits_host_memory(const HostMemoryEstimate& e, const HostMemoryLimit& limit) { return e.bytes <= limit.bytes; }

bool fits_host_memory(const HostMemoryEstimate& e, int64_t* limit_bytes) {
  const HostMemoryLimit limit = host_memory_limit();
  if (limit_bytes) *limit_bytes = limit.bytes;
  return fits_host_memory(e, limit);
}

std::string experts_hint(const MoeGeometry& g, const HostMemoryLimit& limit,
                         const std::function<HostMemoryEstimate(const MoeGeometry&)>& estimate) {
  const int64_t R = std::max<int64_t>(1, g.ep_size);
  const int64_t fewest = (std::max<int64_t>(g.top_k, 1) + R - 1) / R * R;
  for (int64_t n = (g.num_experts - 1) / R * R; n >= fewest; n -= R) {
    MoeGeometry smaller = g;
    smaller.num_experts = n;
    const HostMemoryEstimate e = estimate(smaller);
    if (fits_host_memory(e, limit)) return "--experts " + std::to_string(n) + " needs about " + format_bytes(e.bytes);
  }
  if (fewest >= g.num_experts) return "";
  MoeGeometry smallest = g;
  smallest.num_experts = fewest;
  return "even --experts " + std::to_string(fewest) + " needs about " + format_bytes(estimate(smallest).bytes);
}

void require_host_memory(const HostMemoryEstimate& e, const HostMemoryLimit& limit, const std::string& preset,
                         const std::string& hint) {
  if (fits_host_memory(e, limit)) return;
  const std::string seen =
      "MemTotal in /proc/meminfo: " + (limit.physical > 0 ? format_bytes(limit.physical) : std::string("unknown"));
  const std::string need_gb = std::to_string(static_cast<long long>(std::ceil(static_cast<double>(e.bytes) / 1e9)));
  std::string why;
  if (!limit.flag.given)
    why = ", 60% of the memory this machine reports (" + seen +
          "); a machine whose memory grows on use reports less than it has at start: if this one has more, raise "
          "the limit with --max-host-gb G (G >= " + need_gb + ")";
  else
    why = " set by --max-host-gb " + limit.flag.value + " (" + seen + "); raise it to at least " + need_gb +
          " if the machine has that much";
  throw ToolError(kExitUsage, "preset " + preset + " needs about " + format_bytes(e.bytes) +
                                  " of host memory at its peak (" + e.detail + "), above the limit of " +
                                  format_bytes(limit.bytes) + why + "; otherwise --experts N shrinks it" +
                                  (hint.empty() ? std::string() : " (" + hint + ")") +
                                  ", or use a smaller preset (tiny, qwen3-30b-a3b)");
}

std::string format_bytes(int64_t bytes) {
  char buf[96];
  const double b = static_cast<double>(bytes);
  if (b >= 1e9)
    std::snprintf(buf, sizeof(buf), "%.2f GB (%lld bytes)", b / 1e9, static_cast<long long>(bytes));
  else if (b >= 1e6)
    std::snprintf(buf, sizeof(buf), "%.2f MB (%lld bytes)", b / 1e6, static_cast<long long>(bytes));
  else
    std::snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(bytes));
  return buf;
}

std::string format_mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string shell_quote(const std::string& s) {
  bool plain = !s.empty();
  for (char ch : s)
    if (!(isalnum(static_cast<unsigned char>(ch)) || std::string("-_.,/=:+@%").find(ch) != std::string::npos))
      plain = false;
  if (plain) return s;
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

}  // namespace megamoe::tool
