// `megamoe info`: build and device facts; with --preset, the geometry, the backend `auto` picks and
// why, and the workspace bytes per region with each region's formula.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "core/device.h"
#include "core/env.h"
#include "kernels/routed/routed_gemm_args.h"
#include "megamoe/knobs.h"
#include "megamoe/layer.h"
#include "megamoe/workspace.h"
#include "presets.h"

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "unknown"
#endif

namespace megamoe::tool {
namespace {

struct InfoOptions {
  LayerOptions layer;
  std::string tokens = "128";
};

std::string compiler_string() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("g++ ") + __VERSION__;
#else
  return "unknown compiler";
#endif
}

std::string built_cuda_version() {
#ifdef CUDART_VERSION
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
#else
  return "unknown";
#endif
}

void print_build_and_devices() {
  std::printf("megamoe %s\n", MEGAMOE_VERSION);
#ifdef NDEBUG
  const char* build_type = "optimised (NDEBUG)";
#else
  const char* build_type = "debug (asserts on)";
#endif
  std::printf("build: %s, C++%ld, %s; CUDA toolkit %s; device code for sm_90a (H100/H200)\n",
              compiler_string().c_str(), static_cast<long>(__cplusplus / 100 % 100), build_type,
              built_cuda_version().c_str());
  const std::string runtime = cuda_runtime_version(), driver = cuda_driver_version();
  std::printf("CUDA runtime %s, driver %s\n", runtime.empty() ? "unavailable" : runtime.c_str(),
              driver.empty() ? "unavailable (no driver)" : driver.c_str());
  std::string reason;
  const int count = cuda_device_count(&reason);
  if (count == 0) {
    std::printf("CUDA devices: %s\n", reason.c_str());
  } else {
    std::printf("CUDA devices: %d\n", count);
    for (const CudaDeviceInfo& d : cuda_devices()) {
      std::printf("  %d: %s, sm_%d%d, %d SMs, %.1f GiB%s\n", d.ordinal, d.name.c_str(), d.major, d.minor,
                  d.num_sms, static_cast<double>(d.total_memory) / (1024.0 * 1024.0 * 1024.0),
                  d.major == 9 ? "" : " (not sm_90: the GPU backends need Hopper)");
    }
  }
  const std::string nccl = nccl_version();
  std::printf("NCCL %s\n", nccl.empty() ? "unavailable" : nccl.c_str());
  std::printf("host: %s physical memory\n", format_bytes(physical_memory_bytes()).c_str());
}

// The routed mxfp4 decode GEMMs' CTAs per SM by tokens per rank (routed_fp4_auto_ctas_per_sm on this
// machine's first GPU, an H200's 132 SMs without one), or what MEGAMOE_GEMM_FP4_CTAS_PER_SM forces.
void print_mxfp4_decode_ctas(const MoeGeometry& g, const EnvKnobs& env) {
  int32_t forced = 0;
  if (Status st = routed_fp4_ctas_per_sm(env.gemm_fp4_ctas_per_sm, &forced); !st.is_ok()) {
    std::printf("routed mxfp4 decode tiles: %s\n", st.message().c_str());
    return;
  }
  if (forced != 0) {
    std::printf("routed mxfp4 decode tiles: %d CTA(s) per SM (MEGAMOE_GEMM_FP4_CTAS_PER_SM=%d)\n", forced, forced);
    return;
  }
  const std::vector<CudaDeviceInfo> devices = cuda_devices();
  const int sms = devices.empty() ? 132 : devices.front().num_sms;
  // 16-row tiles while the bucket holds at most 16 rows per expert; the first T of two CTAs per SM
  int64_t last16 = 0, from[2] = {0, 0};
  const int64_t n[2] = {2 * g.intermediate, g.hidden};
  for (int64_t t = 1; t <= g.max_tokens_per_rank && routed_rows_per_expert(g, t * g.top_k) <= 16; ++t) {
    last16 = t;
    for (int f = 0; f < 2; ++f)
      if (from[f] == 0 && routed_fp4_auto_ctas_per_sm(g, t * g.top_k, n[f], sms) == 2) from[f] = t;
  }
  const auto when = [](int64_t t) { return t > 0 ? "from T = " + std::to_string(t) : std::string("never"); };
  std::printf("routed mxfp4 decode tiles (16 rows up to T = %lld): two CTAs per SM for FC1 %s, FC2 %s (%lld expected "
              "tiles per SM on %d SMs%s; a GPU shared by logical ranks runs one)\n",
              static_cast<long long>(last16), when(from[0]).c_str(), when(from[1]).c_str(),
              static_cast<long long>(kFp4TwoCtasMinTilesPerSm), sms, devices.empty() ? ", an H200's: no CUDA device" : "");
}

void print_presets() {
  std::printf("presets (--preset):\n");
  for (const Preset& p : all_presets()) {
    std::printf("  %-18s hidden=%-5lld intermediate=%-5lld experts=%-3lld top_k=%lld  %s\n", p.name,
                static_cast<long long>(p.hidden), static_cast<long long>(p.intermediate),
                static_cast<long long>(p.num_experts), static_cast<long long>(p.top_k), p.model);
  }
}

int run_info(const InfoOptions& o) {
  print_build_and_devices();
  if (o.layer.preset.empty()) {
    print_presets();
    return kExitOk;
  }
  const int64_t tokens = parse_int_flag("--tokens", o.tokens, 0, 1 << 20);
  const int64_t max_tokens =
      o.layer.max_tokens.empty() ? tokens : parse_int_flag("--max-tokens", o.layer.max_tokens, 0, 1 << 20);
  const MoeGeometry g = make_geometry(o.layer, max_tokens);
  const MoeConfig c = make_config(o.layer, Backend::kAuto);
  const Status st = c.validate(g);
  if (!st) throw ToolError(kExitUsage, st.message());

  std::printf("\npreset %s%s\n", o.layer.preset.c_str(), o.layer.pad ? " (padded with --pad)" : "");
  std::printf("  %s\n", g.to_string().c_str());
  std::printf("  experts per rank %lld; max_tokens_per_rank %lld is the per-rank bound of one forward\n",
              static_cast<long long>(g.experts_per_rank()), static_cast<long long>(g.max_tokens_per_rank));
  std::printf("  %s\n", c.to_string().c_str());
  std::printf("  intermediate format (FC2 input): %s\n", to_string(c.intermediate_format()));

  std::printf("\nbackend selection (auto):\n");
  const BackendSelection sel = select_backend(g, c);
  std::printf("  auto -> %s\n", to_string(sel.backend));
  std::string reason = sel.reason;
  size_t start = 0;
  while (start < reason.size()) {
    const size_t nl = reason.find('\n', start);
    std::printf("  reason: %s\n", reason.substr(start, nl == std::string::npos ? std::string::npos : nl - start).c_str());
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  const std::vector<CudaDeviceInfo> devices = cuda_devices();
  const MegaThreshold threshold =
      mega_threshold_in_force(g, c, devices.empty() ? std::string() : devices.front().name, process_knob_cache());
  std::printf("  mega_max_tokens_per_rank in force: %lld, from %s\n", static_cast<long long>(threshold.value),
              threshold.source.c_str());
  if (const EnvKnobs& env = env_knobs(); !env.knob_cache_off)
    std::printf("  knob cache: %s (MEGAMOE_KNOB_CACHE; `megamoe tune` writes it)\n", env.knob_cache_path.c_str());
  else
    std::printf("  knob cache: off (MEGAMOE_KNOB_CACHE=off)\n");
  for (Backend b : {Backend::kMega, Backend::kRouted, Backend::kCpu}) {
    const Status gate = b == Backend::kMega     ? mega_capability(g, c)
                        : b == Backend::kRouted ? routed_capability(g, c)
                                                : cpu_capability(g, c);
    std::printf("  %-6s gate: %s\n", to_string(b), gate ? "ok" : gate.message().c_str());
  }

  const WorkspaceLayout layout = WorkspaceLayout::make(workspace_params(g, c));
  std::printf("\nsymmetric workspace per rank (R=%lld, E_l=%lld, k=%lld, H=%lld, I=%lld, T_max=%lld, SA=%lld, "
              "P=pool_rows=%lld):\n",
              static_cast<long long>(g.ep_size), static_cast<long long>(g.experts_per_rank()),
              static_cast<long long>(g.top_k), static_cast<long long>(g.hidden),
              static_cast<long long>(g.intermediate), static_cast<long long>(g.max_tokens_per_rank),
              static_cast<long long>(layout.params.segment_align), static_cast<long long>(layout.pool_rows));
  std::printf("  %-20s %14s %14s  %s\n", "region", "offset", "bytes", "formula");
  for (int i = 0; i < WorkspaceLayout::kNumRegions; ++i) {
    const WorkspaceRegion& r = layout.region(i);
    std::printf("  %-20s %14lld %14lld  %s\n", WorkspaceLayout::region_name(i), static_cast<long long>(r.offset),
                static_cast<long long>(r.bytes), WorkspaceLayout::region_formula(i));
  }
  std::printf("  %-20s %14s %14lld  (%s, regions 256-byte aligned)\n", "total", "",
              static_cast<long long>(layout.total_bytes), format_mib(layout.total_bytes).c_str());

  const int64_t per_expert = prepared_bytes_per_expert(c.weight_format, g.hidden, g.intermediate);
  std::printf("\nexpert weights per rank (%s): %s (%lld experts x %lld bytes)\n", to_string(c.weight_format),
              format_mib(per_expert * g.experts_per_rank()).c_str(), static_cast<long long>(g.experts_per_rank()),
              static_cast<long long>(per_expert));
  if (c.weight_format == WeightFormat::kMxfp4) {
    RoutedMxfp4Expansion x;
    const EnvKnobs& env = env_knobs();
    if (Status st = routed_mxfp4_expansion(g, env.mxfp4_expand_rows, env.mxfp4_expand_mib, &x); !st.is_ok())
      std::printf("routed mxfp4 prefill expansion: %s\n", st.message().c_str());
    else if (x.threshold_rows == 0)
      std::printf("routed mxfp4 prefill expansion: off (MEGAMOE_MXFP4_EXPAND_ROWS=off)\n");
    else if (!x.expands())
      std::printf("routed mxfp4 prefill expansion: from %lld rows per expert; none here (T_max's bucket: %lld rows), "
                  "no scratch\n",
                  static_cast<long long>(x.threshold_rows), static_cast<long long>(x.t_max_rows));
    else
      std::printf("routed mxfp4 prefill expansion: from %lld rows per expert (T_max's bucket: %lld); scratch per "
                  "workspace key %s (%lld of %lld experts per chunk)\n",
                  static_cast<long long>(x.threshold_rows), static_cast<long long>(x.t_max_rows),
                  format_mib(x.scratch_bytes).c_str(), static_cast<long long>(x.chunk_experts),
                  static_cast<long long>(g.experts_per_rank()));
    print_mxfp4_decode_ctas(g, env);
  }
  const HostMemoryEstimate check_mem = estimate_host_memory(g, c, Backend::kCpu, tokens, true);
  int64_t limit = 0;
  const bool fits = fits_host_memory(check_mem, &limit);
  std::printf("host memory for `megamoe check --backend cpu` here: %s (%s)\n",
              format_bytes(check_mem.bytes).c_str(),
              fits ? "fits" : ("refused: above the limit " + format_bytes(limit) + "; use --experts N").c_str());
  return kExitOk;
}

}  // namespace

CommandRun add_info_command(CLI::App* app) {
  auto o = std::make_shared<InfoOptions>();
  CLI::App* sub = app->add_subcommand("info", "version, build, CUDA devices, NCCL; with --preset the geometry, "
                                               "the backend auto picks and the workspace bytes per region");
  sub->add_option("--preset", o->layer.preset, "model preset: " + preset_names())->type_name("P");
  sub->add_option("--tokens", o->tokens, "tokens per rank (sets max_tokens_per_rank)")
      ->type_name("T")
      ->default_str(o->tokens);
  add_layer_options(sub, &o->layer, /*with_pow2_scales=*/true);
  return [o] { return run_info(*o); };
}

}  // namespace megamoe::tool
