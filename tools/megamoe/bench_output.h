// Rows of `megamoe bench`: the table on stdout and the --json / --csv files.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/config.h"

namespace megamoe::tool {

struct BenchRow {
  std::string backend;   // as requested (auto, mega, routed, cpu)
  std::string resolved;  // what it ran on
  int64_t tokens = 0;    // per rank
  int64_t iters = 0, warmup = 0;
  int64_t layers = 1;    // --layers: times are per layer of a forward of `layers` layers
  bool on_gpu = false;
  double median_us = 0, min_us = 0, max_us = 0;
  double tflops_per_rank = 0, hbm_gbps_per_rank = 0, nvlink_gbps_per_rank = 0;
  double floor_us = 0, time_over_floor = 0;
  std::string floor_bound;  // hbm | gemm | nvlink
  std::string command;      // reproduces the row
  std::string error;        // non-empty: the case did not run, and why
  // Per-stage breakdown (GPU backends with stage timing): per stage, the median over a few extra
  // forwards of the slowest rank, in forward order.
  std::vector<std::pair<std::string, double>> stages_us;
};

struct BenchHeader {
  std::string preset;
  MoeGeometry geometry;  // max_tokens_per_rank of the largest case
  MoeConfig config;
  std::string routing;
  int64_t sets = 0;
  bool any_cpu = false;  // some case runs on the cpu backend
};

// A row as the JSON record of --json (the text row and CSV print its fields).
nlohmann::json bench_record(const BenchRow& row);
// The whole --json document: the header's geometry, config and model, and the rows.
nlohmann::json bench_document(const BenchHeader& h, const std::vector<BenchRow>& rows);

void print_bench_header(const BenchHeader& h);
void print_bench_row(const BenchRow& row);
// Throw ToolError (kExitIo) naming the path when the file cannot be written.
void write_bench_json(const std::string& path, const BenchHeader& h, const std::vector<BenchRow>& rows);
void write_bench_csv(const std::string& path, const std::vector<BenchRow>& rows);

}  // namespace megamoe::tool
