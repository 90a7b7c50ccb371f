// See bench_harness.h.
#include "bench_harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cinttypes>
#include <fstream>
#include <mutex>

#include "core/cuda_check.h"
#include "gemm_fill.h"
#include "presets.h"

namespace megamoe::tool {

Summary summarize(std::vector<double> v) {
  Summary s;
  s.n = static_cast<int64_t>(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.min = v.front();
  s.max = v.back();
  return s;
}

// ---- the L2 flush ----

namespace {

constexpr int kMaxDevices = 64;

// One scratch buffer per device ordinal (kL2FlushBytes, and 16 bytes of sink for the read kernel).
Status flush_scratch(int device, void** out) {
  static std::mutex mutex;
  static std::array<void*, kMaxDevices> scratch{};
  std::lock_guard<std::mutex> lock(mutex);
  if (!scratch[device]) {
    MEGAMOE_CUDA_CHECK(cudaSetDevice(device));
    void* buf = nullptr;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&buf, kL2FlushBytes + 16));
    MEGAMOE_CUDA_CHECK(cudaMemset(buf, 0x5A, kL2FlushBytes + 16));  // finite bytes for the read
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    scratch[device] = buf;
  }
  *out = scratch[device];
  return Status::ok();
}

}  // namespace

const char* to_string(FlushMode mode) {
  return mode == FlushMode::kRead ? "256 MiB read (clean)" : "256 MiB memset (dirty)";
}

Status flush_l2(Device device, void* stream, FlushMode mode) {
  if (device.kind != DeviceKind::kCuda) return Status::ok();
  if (device.index < 0 || device.index >= kMaxDevices)
    return invalid_argument("L2 flush", "device", std::to_string(device.index),
                            "must be in [0, " + std::to_string(kMaxDevices) + ")");
  void* buf = nullptr;
  MEGAMOE_RETURN_IF_ERROR(flush_scratch(device.index, &buf));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (mode == FlushMode::kRead) {
    uint32_t* sink = reinterpret_cast<uint32_t*>(static_cast<char*>(buf) + kL2FlushBytes);
    MEGAMOE_CUDA_CHECK(gemm::read_through(buf, kL2FlushBytes, sink, s));
    return Status::ok();
  }
  static std::atomic<uint32_t> flushes{0};
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(buf, static_cast<int>(flushes.fetch_add(1) & 0xFF), kL2FlushBytes, s));
  return Status::ok();
}

bool is_flush_span(const DeviceSpan& span) {
  // A library's own memsets are small: only the flush writes kL2FlushBytes.
  return span.memset ? span.bytes >= static_cast<uint64_t>(kL2FlushBytes)
                     : span.name.find("read_kernel") != std::string::npos;
}

// ---- device timing ----

EventTimer::~EventTimer() {
  if (start_) cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  if (stop_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
}

Status EventTimer::init(Device device) {
  if (device.kind != DeviceKind::kCuda) return Status::ok();
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device.index));
  cudaEvent_t a = nullptr, b = nullptr;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&a));
  start_ = a;
  MEGAMOE_CUDA_CHECK(cudaEventCreate(&b));
  stop_ = b;
  return Status::ok();
}

Status EventTimer::start(void* stream) {
  if (!start_) return Status::ok();
  MEGAMOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_), static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status EventTimer::stop(void* stream) {
  if (!stop_) return Status::ok();
  MEGAMOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(stop_), static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status EventTimer::elapsed_us(double* us) const {
  *us = 0;
  if (!start_) return Status::ok();
  float ms = 0;
  MEGAMOE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(stop_)));
  MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_), static_cast<cudaEvent_t>(stop_)));
  *us = 1000.0 * ms;
  return Status::ok();
}

Status time_launches(const std::function<Status()>& launch, int device, void* stream, FlushMode mode, int iters,
                     int warmup, LaunchTiming* out) {
  *out = LaunchTiming();
  const Device dev = Device::cuda(device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < warmup; ++i) MEGAMOE_RETURN_IF_ERROR(launch());
  EventTimer timer;
  MEGAMOE_RETURN_IF_ERROR(timer.init(dev));
  // One flush before recording: its scratch is allocated (and filled by a memset as large as a
  // flush's) outside the records, where it would open a launch of its own.
  MEGAMOE_RETURN_IF_ERROR(flush_l2(dev, stream, mode));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  KernelTimer* kernels = KernelTimer::get();
  const bool recording = kernels != nullptr && kernels->start();
  std::vector<double> us;
  Status st;
  for (int i = 0; i < iters && st; ++i) {
    st = flush_l2(dev, stream, mode);
    if (st) st = timer.start(stream);
    if (st) st = launch();
    if (st) st = timer.stop(stream);
    double t = 0;
    if (st) st = timer.elapsed_us(&t);
    us.push_back(t);
  }
  // Each timed launch follows its flush: the flush's records split the launches.
  const std::vector<DeviceSpan> spans = recording ? kernels->stop() : std::vector<DeviceSpan>();
  MEGAMOE_RETURN_IF_ERROR(st);
  out->events = summarize(us);
  if (recording) {
    const std::vector<double> k = launch_spans_us(spans, is_flush_span);
    if (static_cast<int>(k.size()) == iters) out->kernels = summarize(k);
  }
  return Status::ok();
}

// ---- rows ----

namespace {

// One field as text: a number by its printf format (an integer conversion must be %lld-like), a
// string as it is, anything else as its JSON.
std::string field_text(const nlohmann::json& v, const std::string& format) {
  char buf[512];
  const bool int_format = !format.empty() && (format.back() == 'd' || format.back() == 'i');
  if (v.is_number() && int_format)
    std::snprintf(buf, sizeof(buf), format.c_str(), static_cast<long long>(v.get<double>()));
  else if (v.is_number() && format != "%s")
    std::snprintf(buf, sizeof(buf), format.c_str(), v.get<double>());
  else if (v.is_string())
    return v.get<std::string>();
  else if (v.is_number_integer())
    return std::to_string(v.get<int64_t>());
  else
    return v.dump();
  return buf;
}

// The field `key` of a record; a dotted key ("dispatch_us.median") looks into nested objects.
const nlohmann::json* find_field(const nlohmann::json& record, const std::string& key) {
  const nlohmann::json* at = &record;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!at->is_object()) return nullptr;
    auto it = at->find(part);
    if (it == at->end() || it->is_null()) return nullptr;
    at = &*it;
    if (dot == std::string::npos) return at;
    start = dot + 1;
  }
}

std::string padded(const std::string& text, int width) {
  const size_t w = static_cast<size_t>(width < 0 ? -width : width);
  if (text.size() >= w) return text;
  return width < 0 ? text + std::string(w - text.size(), ' ') : std::string(w - text.size(), ' ') + text;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

}  // namespace

std::string RowPrinter::header() const {
  std::string out = header_prefix_;
  bool first = true;
  for (const Column& c : columns_) {
    if (c.header.empty()) continue;
    if (!first) out += c.sep;
    first = false;
    out += c.key.empty() ? c.header : padded(c.header, c.width);
  }
  return out;
}

std::string RowPrinter::row(const nlohmann::json& record) const {
  std::string out = row_prefix_;
  bool first = true;
  for (const Column& c : columns_) {
    if (c.header.empty()) continue;
    if (!first) out += c.sep;
    first = false;
    if (c.key.empty()) {
      out += c.header;
      continue;
    }
    const nlohmann::json* v = find_field(record, c.key);
    out += padded(v == nullptr ? "-" : field_text(*v, c.format), c.width);
  }
  return out;
}

void set_floor(nlohmann::json* record, double median_us, double floor_us, const std::string& bound) {
  (*record)["floor_us"] = floor_us;
  if (!bound.empty()) (*record)["floor_bound"] = bound;
  if (floor_us > 0) (*record)["time_over_floor"] = median_us / floor_us;
}

nlohmann::json summary_json(const Summary& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

void set_summary(nlohmann::json* record, const Summary& s, const std::string& prefix) {
  (*record)[prefix + "median_us"] = s.median;
  (*record)[prefix + "min_us"] = s.min;
  (*record)[prefix + "max_us"] = s.max;
}

std::string csv_text(const std::vector<std::string>& keys, const std::vector<nlohmann::json>& records) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? "," : "") + keys[i];
  out += "\n";
  for (const nlohmann::json& r : records) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i) out += ",";
      const nlohmann::json* it = find_field(r, keys[i]);
      if (it == nullptr) continue;
      if (it->is_number_integer()) out += std::to_string(it->get<int64_t>());
      else if (it->is_number()) out += std::to_string(it->get<double>());
      else if (it->is_string()) out += csv_field(it->get<std::string>());
      else if (it->is_boolean()) out += it->get<bool>() ? "true" : "false";
      else out += csv_field(it->dump());
    }
    out += "\n";
  }
  return out;
}

void write_text_file(const std::string& path, const std::string& text, const std::string& flag) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  f.close();
  if (!f) throw ToolError(kExitIo, "cannot write " + flag + " file " + path);
}

void write_json_file(const std::string& path, const nlohmann::json& doc, const std::string& flag) {
  write_text_file(path, doc.dump(2) + "\n", flag);
}

void write_csv_file(const std::string& path, const std::vector<std::string>& keys,
                    const std::vector<nlohmann::json>& records, const std::string& flag) {
  write_text_file(path, csv_text(keys, records), flag);
}

}  // namespace megamoe::tool
