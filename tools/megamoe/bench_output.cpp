#include "bench_output.h"

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench_model.h"
#include "presets.h"

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "unknown"
#endif

namespace megamoe::tool {
namespace {

std::string backend_label(const BenchRow& r) {
  return r.backend == r.resolved || r.resolved.empty() ? r.backend : r.backend + "->" + r.resolved;
}

const char* kColumns[] = {"backend", "resolved", "tokens", "iters", "warmup", "median_us", "min_us", "max_us",
                          "tflops_per_rank", "hbm_gbps_per_rank", "nvlink_gbps_per_rank", "floor_us",
                          "floor_bound", "time_over_floor", "time_kind", "command", "error", "stages_us"};

std::string time_kind(const BenchRow& r) {
  if (!r.error.empty()) return "";
  return r.on_gpu ? "gpu wall time" : "cpu wall time (this host)";
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

}  // namespace

void print_bench_header(const BenchHeader& h) {
  const MoeGeometry& g = h.geometry;
  const MoeConfig& c = h.config;
  std::printf("megamoe bench: preset %s: hidden=%lld intermediate=%lld experts=%lld top_k=%lld, EP%lld; weight %s, "
              "dispatch %s, intermediate %s, combine %s%s%s%s; routing %s; %lld input set(s) rotated\n",
              h.preset.c_str(), static_cast<long long>(g.hidden), static_cast<long long>(g.intermediate),
              static_cast<long long>(g.num_experts), static_cast<long long>(g.top_k), static_cast<long long>(g.ep_size),
              to_string(c.weight_format), to_string(c.dispatch_format), to_string(c.intermediate_format()),
              to_string(c.combine_dtype), c.in_kernel_fc2_reduce ? ", in-kernel fc2 reduce" : "",
              c.uses_owner_reduce() ? ", owner reduce" : "",
              c.pow2_scales ? ", pow2 scales" : "", h.routing.c_str(), static_cast<long long>(h.sets));
  std::printf("time: us per forward (ranks in lockstep) = the slowest rank's CUDA-event time on GPU backends, the "
              "wall time of the slowest rank on the cpu backend; median/min/max of the timed forwards after warm-up\n");
  std::printf("per rank: TFLOP/s = 2*3*H*I * routed (token, expert) pairs of all ranks / R / median; HBM GB/s = "
              "weight bytes of the experts hit on all ranks / R / median; NVL GB/s = bytes sent between ranks / R "
              "/ median\n");
  std::printf("floor (H200, DESIGN.md 6) = max over ranks of max(hit weight bytes / %.1f TB/s, FLOPs / %.0f "
              "TFLOP/s (%s), NVLink bytes / %.0f GB/s); bound = the term that sets it\n",
              kH200HbmBytesPerS / 1e12, gemm_peak(c) / 1e12, c.weight_format == WeightFormat::kBf16 ? "bf16" : "fp8",
              kH200NvlinkBytesPerS / 1e9);
  if (h.any_cpu)
    std::printf("NOTE: rows on the cpu backend are CPU wall time on this host, not GPU time; their floor is still "
                "the H200's, so time/floor only says how far this CPU is from an H200\n");
  std::printf("%-14s %7s %11s %11s %11s %9s %9s %9s %10s %6s %11s  %s\n", "backend", "tokens", "median_us", "min_us",
              "max_us", "TFLOP/s", "HBM_GB/s", "NVL_GB/s", "floor_us", "bound", "time/floor", "command");
}

// "dispatch=31.2 expert_pool=40.1 ..." (empty without a breakdown).
static std::string stages_text(const BenchRow& r) {
  std::string out;
  char buf[96];
  for (const auto& st : r.stages_us) {
    std::snprintf(buf, sizeof(buf), "%s%s=%.1f", out.empty() ? "" : " ", st.first.c_str(), st.second);
    out += buf;
  }
  return out;
}

void print_bench_row(const BenchRow& r) {
  if (!r.error.empty()) {
    std::printf("%-14s %7lld  not run: %s  [%s]\n", backend_label(r).c_str(), static_cast<long long>(r.tokens),
                r.error.c_str(), r.command.c_str());
    return;
  }
  std::printf("%-14s %7lld %11.1f %11.1f %11.1f %9.4g %9.4g %9.4g %10.3f %6s %11.4g  %s\n", backend_label(r).c_str(),
              static_cast<long long>(r.tokens), r.median_us, r.min_us, r.max_us, r.tflops_per_rank,
              r.hbm_gbps_per_rank, r.nvlink_gbps_per_rank, r.floor_us, r.floor_bound.c_str(), r.time_over_floor,
              r.command.c_str());
  if (!r.stages_us.empty()) std::printf("%-14s %7s   stages, us (median of the slowest rank): %s\n", "", "",
                                        stages_text(r).c_str());
}

void write_bench_json(const std::string& path, const BenchHeader& h, const std::vector<BenchRow>& rows) {
  const MoeGeometry& g = h.geometry;
  const MoeConfig& c = h.config;
  nlohmann::json j;
  j["tool"] = "megamoe bench";
  j["version"] = MEGAMOE_VERSION;
  j["preset"] = h.preset;
  j["geometry"] = {{"hidden", g.hidden}, {"intermediate", g.intermediate}, {"num_experts", g.num_experts},
                   {"top_k", g.top_k}, {"ep_size", g.ep_size}};
  j["config"] = {{"weight_format", to_string(c.weight_format)},
                 {"dispatch_format", to_string(c.dispatch_format)},
                 {"intermediate_format", to_string(c.intermediate_format())},
                 {"combine_dtype", to_string(c.combine_dtype)},
                 {"in_kernel_fc2_reduce", c.in_kernel_fc2_reduce},
                 {"owner_reduce", to_string(c.owner_reduce)},
                 {"owner_reduce_in_use", c.uses_owner_reduce()},
                 {"pow2_scales", c.pow2_scales}};
  j["routing"] = h.routing;
  j["input_sets"] = h.sets;
  j["model"] = {{"hbm_bytes_per_s", kH200HbmBytesPerS},
                {"gemm_flops_per_s", gemm_peak(c)},
                {"nvlink_bytes_per_s", kH200NvlinkBytesPerS},
                {"flops", "2*3*H*I per routed (token, expert) pair"},
                {"rates", "per rank: sum over ranks / R / median time"},
                {"floor", "max over ranks of max(hit weight bytes / HBM, FLOPs / GEMM peak, NVLink bytes / NVLink)"}};
  nlohmann::json out_rows = nlohmann::json::array();
  for (const BenchRow& r : rows) {
    nlohmann::json row = {{"backend", r.backend},   {"resolved", r.resolved}, {"tokens", r.tokens},
                          {"iters", r.iters},       {"warmup", r.warmup},     {"command", r.command},
                          {"time_kind", time_kind(r)}};
    if (r.error.empty()) {
      row["median_us"] = r.median_us;
      row["min_us"] = r.min_us;
      row["max_us"] = r.max_us;
      row["tflops_per_rank"] = r.tflops_per_rank;
      row["hbm_gbps_per_rank"] = r.hbm_gbps_per_rank;
      row["nvlink_gbps_per_rank"] = r.nvlink_gbps_per_rank;
      row["floor_us"] = r.floor_us;
      row["floor_bound"] = r.floor_bound;
      row["time_over_floor"] = r.time_over_floor;
      if (!r.stages_us.empty()) {
        nlohmann::json stages = nlohmann::json::array();
        for (const auto& st : r.stages_us) stages.push_back({{"stage", st.first}, {"us", st.second}});
        row["stages_us"] = stages;
      }
    } else {
      row["error"] = r.error;
    }
    out_rows.push_back(row);
  }
  j["rows"] = out_rows;
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  f.close();
  if (!f) throw ToolError(kExitIo, "cannot write --json file " + path);
}

void write_bench_csv(const std::string& path, const std::vector<BenchRow>& rows) {
  std::ofstream f(path);
  for (size_t i = 0; i < sizeof(kColumns) / sizeof(kColumns[0]); ++i) f << (i ? "," : "") << kColumns[i];
  f << "\n";
  for (const BenchRow& r : rows) {
    const bool ok = r.error.empty();
    auto num = [&](double v) { return ok ? std::to_string(v) : std::string(); };
    f << r.backend << "," << r.resolved << "," << r.tokens << "," << r.iters << "," << r.warmup << ","
      << num(r.median_us) << "," << num(r.min_us) << "," << num(r.max_us) << "," << num(r.tflops_per_rank) << ","
      << num(r.hbm_gbps_per_rank) << "," << num(r.nvlink_gbps_per_rank) << "," << num(r.floor_us) << ","
      << (ok ? r.floor_bound : "") << "," << num(r.time_over_floor) << "," << csv_field(time_kind(r)) << ","
      << csv_field(r.command) << "," << csv_field(r.error) << "," << csv_field(stages_text(r)) << "\n";
  }
  f.close();
  if (!f) throw ToolError(kExitIo, "cannot write --csv file " + path);
}

}  // namespace megamoe::tool
