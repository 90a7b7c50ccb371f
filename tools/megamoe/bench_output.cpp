#include "bench_output.h"

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench_harness.h"
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

std::string time_kind(const BenchRow& r) {
  if (!r.error.empty()) return "";
  return r.on_gpu ? "gpu wall time" : "cpu wall time (this host)";
}

// The text row: the record's fields and the label (backend->resolved).
const RowPrinter& row_printer() {
  static const RowPrinter printer({{"label", "backend", -14},
                                   {"tokens", "tokens", 7, "%lld"},
                                   {"median_us", "median_us", 11, "%.1f"},
                                   {"min_us", "min_us", 11, "%.1f"},
                                   {"max_us", "max_us", 11, "%.1f"},
                                   {"tflops_per_rank", "TFLOP/s", 9, "%.4g"},
                                   {"hbm_gbps_per_rank", "HBM_GB/s", 9, "%.4g"},
                                   {"nvlink_gbps_per_rank", "NVL_GB/s", 9, "%.4g"},
                                   {"floor_us", "floor_us", 10, "%.3f"},
                                   {"floor_bound", "bound", 6},
                                   {"time_over_floor", "time/floor", 11, "%.4g"},
                                   {"command", "command", 0, "%s", "  "}});
  return printer;
}

// The CSV columns (docs/TOOL.md); stages_us as its text ("dispatch=31.2 ...").
const std::vector<std::string> kCsvKeys = {"backend", "resolved", "tokens", "iters", "warmup", "median_us", "min_us",
                                           "max_us", "tflops_per_rank", "hbm_gbps_per_rank", "nvlink_gbps_per_rank",
                                           "floor_us", "floor_bound", "time_over_floor", "time_kind", "command",
                                           "error", "stages_us"};

// "dispatch=31.2 expert_pool=40.1 ..." (empty without a breakdown).
std::string stages_text(const BenchRow& r) {
  std::string out;
  char buf[96];
  for (const auto& st : r.stages_us) {
    std::snprintf(buf, sizeof(buf), "%s%s=%.1f", out.empty() ? "" : " ", st.first.c_str(), st.second);
    out += buf;
  }
  return out;
}

}  // namespace

nlohmann::json bench_record(const BenchRow& r) {
  nlohmann::json row = {{"backend", r.backend}, {"resolved", r.resolved}, {"tokens", r.tokens},
                        {"iters", r.iters},     {"warmup", r.warmup},     {"command", r.command},
                        {"time_kind", time_kind(r)}, {"layers", r.layers}};
  if (!r.error.empty()) {
    row["error"] = r.error;
    return row;
  }
  set_summary(&row, Summary{r.iters, r.median_us, r.min_us, r.max_us});
  row["tflops_per_rank"] = r.tflops_per_rank;
  row["hbm_gbps_per_rank"] = r.hbm_gbps_per_rank;
  row["nvlink_gbps_per_rank"] = r.nvlink_gbps_per_rank;
  set_floor(&row, r.median_us, r.floor_us, r.floor_bound);
  if (!row.contains("time_over_floor")) row["time_over_floor"] = 0.0;
  if (!r.stages_us.empty()) {
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& st : r.stages_us) stages.push_back({{"stage", st.first}, {"us", st.second}});
    row["stages_us"] = stages;
  }
  return row;
}

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
  std::printf("floor (H200, docs/ARCHITECTURE.md) = max over ranks of max(hit weight bytes / %.1f TB/s, FLOPs / %.0f "
              "TFLOP/s (%s), NVLink bytes / %.0f GB/s); bound = the term that sets it\n",
              kH200HbmBytesPerS / 1e12, gemm_peak(c) / 1e12, c.intermediate_format() == DispatchFormat::kBf16 ? "bf16" : "fp8",
              kH200NvlinkBytesPerS / 1e9);
  if (h.any_cpu)
    std::printf("NOTE: rows on the cpu backend are CPU wall time on this host, not GPU time; their floor is still "
                "the H200's, so time/floor only says how far this CPU is from an H200\n");
  std::printf("%s\n", row_printer().header().c_str());
}

void print_bench_row(const BenchRow& r) {
  if (!r.error.empty()) {
    std::printf("%-14s %7lld  not run: %s  [%s]\n", backend_label(r).c_str(), static_cast<long long>(r.tokens),
                r.error.c_str(), r.command.c_str());
    return;
  }
  nlohmann::json rec = bench_record(r);
  rec["label"] = backend_label(r);
  std::printf("%s\n", row_printer().row(rec).c_str());
  if (!r.stages_us.empty()) std::printf("%-14s %7s   stages, us (median of the slowest rank): %s\n", "", "",
                                        stages_text(r).c_str());
}

nlohmann::json bench_document(const BenchHeader& h, const std::vector<BenchRow>& rows) {
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
  for (const BenchRow& r : rows) out_rows.push_back(bench_record(r));
  j["rows"] = out_rows;
  return j;
}

void write_bench_json(const std::string& path, const BenchHeader& h, const std::vector<BenchRow>& rows) {
  write_json_file(path, bench_document(h, rows));
}

void write_bench_csv(const std::string& path, const std::vector<BenchRow>& rows) {
  std::vector<nlohmann::json> records;
  for (const BenchRow& r : rows) {
    nlohmann::json rec = bench_record(r);
    rec["stages_us"] = stages_text(r);  // as text in CSV
    records.push_back(std::move(rec));
  }
  write_csv_file(path, kCsvKeys, records);
}

}  // namespace megamoe::tool
