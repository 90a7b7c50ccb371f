// The one bench harness of the `megamoe` tool, shared by bench, bench-gemm, bench-transport,
// bench-link and tune:
// - statistics: summarize() (n, median, min, max; one definition of the median);
// - the L2 flush before every timed launch (one 256 MiB scratch buffer per device, written by a
//   memset or read by a kernel), and the predicate that finds it among CUPTI's records;
// - device timing: EventTimer (CUDA events around work on a stream) and time_launches() (events
//   around each launch, and where libcupti opens, the launch's kernel time from the GPU's own
//   timestamps, kernel_timer.h);
// - rows: RowPrinter prints records (JSON objects) as fixed-width text rows and writes the same
//   records as JSON and CSV, so every command's three outputs come from one set of fields; the
//   floor columns (floor_us, time_over_floor) are set by set_floor().
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernel_timer.h"
#include "megamoe/status.h"
#include "megamoe/tensor.h"

namespace megamoe::tool {

// ---- statistics ----

struct Summary {
  int64_t n = 0;
  double median = 0, min = 0, max = 0;  // all 0 when n == 0
};
// The median is the middle sample, or the mean of the two middle ones for an even count.
Summary summarize(std::vector<double> samples);

// ---- the L2 flush ----

constexpr int64_t kL2FlushBytes = int64_t{256} << 20;  // larger than any Hopper L2 (50 MiB on H100/H200)

// memset: the scratch written (L2 left full of dirty lines whose write-back the next launch's loads
// pay for, as DeepGEMM's harness leaves it); read: the scratch read by a kernel (L2 left clean).
enum class FlushMode { kMemset, kRead };
const char* to_string(FlushMode mode);  // "256 MiB memset (dirty)" / "256 MiB read (clean)"

// Flushes the L2 of `device` on `stream` (enqueued, not waited for); a no-op on the cpu. The memset
// writes a byte that changes from one flush to the next. The scratch buffer of each device is
// allocated on first use and kept for the life of the process.
Status flush_l2(Device device, void* stream, FlushMode mode = FlushMode::kMemset);
// Whether a CUPTI record is a flush (its memset, or its read kernel): the marker that opens each
// timed launch in launch_spans_us().
bool is_flush_span(const DeviceSpan& span);

// ---- device timing ----

// Device time of the work between start() and stop() on a stream (CUDA events); on the cpu it
// measures nothing (elapsed_us gives 0) and callers use the host clock.
class EventTimer {
 public:
  EventTimer() = default;
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  ~EventTimer();
  Status init(Device device);
  Status start(void* stream);
  Status stop(void* stream);
  Status elapsed_us(double* us) const;  // waits for stop()

 private:
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

struct LaunchTiming {
  Summary events;   // CUDA events around each launch
  Summary kernels;  // each launch's first kernel start to last kernel end (CUPTI); n == 0: not measured
};

// Runs `launch` `warmup` times, then `iters` times each after an L2 flush (`mode`), on `stream` of
// CUDA device `device`; every launch is timed by events, and by CUPTI where it opens.
Status time_launches(const std::function<Status()>& launch, int device, void* stream, FlushMode mode, int iters,
                     int warmup, LaunchTiming* out);

// ---- rows: text, JSON, CSV ----

// One field of a row: its JSON key (a dotted key, "dispatch_us.median", names a field of a nested
// object; CSV columns use the same keys), and how the text row prints it: header (empty: JSON and CSV
// only), width (< 0 aligns left), format (printf format of a number, "%.1f", "%lld" for integers;
// strings print as they are) and the separator before it (none before the first column). A column
// with an empty key prints its header text in every row, as a fixed separator ("|").
struct Column {
  std::string key;
  std::string header;
  int width = 0;
  std::string format = "%s";
  std::string sep = " ";
};

class RowPrinter {
 public:
  explicit RowPrinter(std::vector<Column> columns, std::string row_prefix = "", std::string header_prefix = "")
      : columns_(std::move(columns)), row_prefix_(std::move(row_prefix)), header_prefix_(std::move(header_prefix)) {}
  // The header line and a record's text row, without a newline. A field the record lacks prints "-"
  // (in its width).
  std::string header() const;
  std::string row(const nlohmann::json& record) const;
  const std::vector<Column>& columns() const { return columns_; }

 private:
  std::vector<Column> columns_;
  std::string row_prefix_, header_prefix_;
};

// floor_us, time_over_floor (= median_us / floor_us; absent when the floor is 0) and, when given,
// floor_bound on `record`.
void set_floor(nlohmann::json* record, double median_us, double floor_us, const std::string& bound = "");
// {"median": ., "min": ., "max": .}
nlohmann::json summary_json(const Summary& s);
// median_us, min_us, max_us (prefix "": those names; "cublas_": cublas_median_us, ...).
void set_summary(nlohmann::json* record, const Summary& s, const std::string& prefix = "");

// Write the text to `path`; throw ToolError(kExitIo) naming `flag` and the path when it cannot be
// written.
void write_text_file(const std::string& path, const std::string& text, const std::string& flag);
// JSON (indented by 2) and CSV (the printer's header, then one line per record).
void write_json_file(const std::string& path, const nlohmann::json& doc, const std::string& flag = "--json");
// CSV of records: a header line of `keys`, then one line per record (integers as integers, other
// numbers as printf "%f", strings quoted where they hold a comma, quote or newline, arrays and
// objects as their JSON text, an absent field empty).
std::string csv_text(const std::vector<std::string>& keys, const std::vector<nlohmann::json>& records);
void write_csv_file(const std::string& path, const std::vector<std::string>& keys,
                    const std::vector<nlohmann::json>& records, const std::string& flag = "--csv");

}  // namespace megamoe::tool
