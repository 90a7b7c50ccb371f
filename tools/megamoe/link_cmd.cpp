// `megamoe bench-link`: the ways of moving bytes between two GPUs' NCCL symmetric windows, timed
// with both directions loaded at once (src/kernels/transport/sm90_link_probe.h): plain 16-byte
// stores (what the transport kernels do), TMA bulk stores from shared memory (register-staged and
// pure), pulls (loads from the peer), and the copy engine as the ceiling. Every path's result is
// checked (the receiving half of each window is poisoned first, then compared with the sender's
// pattern).
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_comm.h"
#include "comm/nccl_window.h"
#include "bench_harness.h"
#include "bench_model.h"
#include "commands.h"
#include "sm90_link_probe.h"
#include "presets.h"
#include "ranks.h"

namespace megamoe::tool {
namespace {

struct LinkOptions {
  int64_t mib = 256;  // per direction
  int iters = 10;
  std::vector<std::string> paths = {"store", "staged", "tma", "pull", "ce", "ce-lsa"};
  int ce_chunks = 1;  // ce / ce-lsa: copies per direction, back to back
  int chunk = 8192;
  int stages = 4;
  int store_ctas_per_sm = 2;  // store / pull: CTAs of 512 threads per SM
  int staged_warps = 8;       // staged: warps per CTA, one CTA per SM
  int tma_warps = 4;          // tma: warps (one issuing lane each) per CTA, one CTA per SM
  int handshakes = 64;        // handshake paths: round trips per timed CUDA graph
  bool pdl = true;            // handshake paths: programmatic dependent launch, as the transport's small launches
  std::string json, csv;
};

bool is_handshake(const std::string& path) { return path == "handshake" || path == "handshake-grid"; }

// A rank's stream and its two timing events on `device`, released on every return (the rank
// functions return early on a CUDA error).
struct TimedStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  TimedStream() = default;
  TimedStream(const TimedStream&) = delete;
  TimedStream& operator=(const TimedStream&) = delete;
  ~TimedStream() {
    if (e0 != nullptr) cudaEventDestroy(e0);
    if (e1 != nullptr) cudaEventDestroy(e1);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  cudaError_t init(int device) {
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreate(&e0);
    if (e == cudaSuccess) e = cudaEventCreate(&e1);
    return e;
  }
};

struct RankResult {
  std::vector<double> us;
  unsigned long long bad = 0;
  std::string error;
};


// One rank's part of a handshake path: `handshakes` launches of the round-trip kernel captured in one
// graph, timed `iters` times after one warm-up, each graph launched after a barrier; us = per round
// trip. res->bad counts round trips that timed out (2 s).
void run_handshake(const LinkOptions& o, const std::string& path, int device, int num_sms, char* own_end,
                   char* peer_end, ThreadBarrier& barrier, RankResult* res) {
  TimedStream ts;
  MEGAMOE_RANK_CUDA(ts.init(device));
  cudaStream_t stream = ts.stream;
  cudaEvent_t e0 = ts.e0, e1 = ts.e1;
  uint64_t* own_flag = reinterpret_cast<uint64_t*>(own_end - 64);
  uint64_t* peer_flag = reinterpret_cast<uint64_t*>(peer_end - 64);
  uint64_t* state = nullptr;
  MEGAMOE_RANK_CUDA(cudaMalloc(&state, 3 * sizeof(uint64_t)));
  MEGAMOE_RANK_CUDA(cudaMemsetAsync(state, 0, 3 * sizeof(uint64_t), stream));
  MEGAMOE_RANK_CUDA(cudaMemsetAsync(own_flag, 0, sizeof(uint64_t), stream));
  const bool grid = path == "handshake-grid";
  const int ctas = grid ? 2 * num_sms : 1, threads = grid ? 512 : 32;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MEGAMOE_RANK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < o.handshakes; ++i)
    MEGAMOE_RANK_CUDA(kernels::launch_link_handshake(ctas, threads, o.pdl, own_flag, peer_flag, state, 2000000000ull, stream));
  MEGAMOE_RANK_CUDA(cudaStreamEndCapture(stream, &graph));
  MEGAMOE_RANK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
  barrier.wait();  // both flags are zero before either rank signals
  for (int it = 0; it <= o.iters; ++it) {
    barrier.wait();
    MEGAMOE_RANK_CUDA(cudaEventRecord(e0, stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(exec, stream));
    MEGAMOE_RANK_CUDA(cudaEventRecord(e1, stream));
    MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
    float ms = 0;
    MEGAMOE_RANK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (it > 0) res->us.push_back(ms * 1e3 / o.handshakes);
  }
  uint64_t h[3] = {};
  MEGAMOE_RANK_CUDA(cudaMemcpy(h, state, sizeof(h), cudaMemcpyDeviceToHost));
  res->bad = h[2];
  barrier.wait();  // the peer's last store into this rank's flag has landed before anyone moves on
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(state);
}

// One rank's part of one path: it sends its window's first half into its peer's second half (pull:
// reads the peer's first half into its own second half), `iters` times after one warm-up, each
// launch after a barrier so both directions are loaded together.
void run_path(const LinkOptions& o, const std::string& path, int rank, int device, int num_sms, char* own,
              char* peer_lsa, char* peer_raw, int peer_device, ThreadBarrier& barrier, RankResult* res) {
  const int64_t B = o.mib << 20;
  TimedStream ts;
  MEGAMOE_RANK_CUDA(ts.init(device));
  cudaStream_t stream = ts.stream;
  cudaEvent_t e0 = ts.e0, e1 = ts.e1;
  kernels::LinkProbeShape shape{};
  kernels::LinkPath kind = kernels::LinkPath::kStore;
  if (path == "store" || path == "pull") {
    kind = path == "store" ? kernels::LinkPath::kStore : kernels::LinkPath::kPull;
    shape = {num_sms * o.store_ctas_per_sm, 16, 0, 0};
  } else if (path == "staged") {
    kind = kernels::LinkPath::kStaged;
    shape = {num_sms, o.staged_warps, o.chunk, 2};
  } else if (path == "tma") {
    kind = kernels::LinkPath::kTma;
    shape = {num_sms, o.tma_warps, o.chunk, o.stages};
  }
  MEGAMOE_RANK_CUDA(cudaMemsetAsync(own + B, 0xA5, B, stream));  // poison what the peer will write
  MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
  barrier.wait();
  for (int it = 0; it <= o.iters; ++it) {
    barrier.wait();
    MEGAMOE_RANK_CUDA(cudaEventRecord(e0, stream));
    if (path == "ce" || path == "ce-lsa") {
      const int64_t piece = B / o.ce_chunks;
      for (int c = 0; c < o.ce_chunks; ++c) {
        const int64_t off = c * piece, len = c + 1 == o.ce_chunks ? B - off : piece;
        if (path == "ce") {
          MEGAMOE_RANK_CUDA(cudaMemcpyPeerAsync(peer_raw + B + off, peer_device, own + off, device, len, stream));
        } else {  // through the LSA mapping of the peer's window, as a process of its own would see it
          MEGAMOE_RANK_CUDA(cudaMemcpyAsync(peer_lsa + B + off, own + off, len, cudaMemcpyDeviceToDevice, stream));
        }
      }
    } else if (kind == kernels::LinkPath::kPull) {
      MEGAMOE_RANK_CUDA(kernels::launch_link_probe(kind, shape, peer_lsa, own + B, B, stream));
    } else {
      MEGAMOE_RANK_CUDA(kernels::launch_link_probe(kind, shape, own, peer_lsa + B, B, stream));
    }
    MEGAMOE_RANK_CUDA(cudaEventRecord(e1, stream));
    MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
    float ms = 0;
    MEGAMOE_RANK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (it > 0) res->us.push_back(ms * 1e3);
  }
  barrier.wait();  // every write to this rank has landed (the peer's stream is synchronised)
  unsigned long long* bad = nullptr;
  MEGAMOE_RANK_CUDA(cudaMalloc(&bad, sizeof(*bad)));
  MEGAMOE_RANK_CUDA(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
  MEGAMOE_RANK_CUDA(kernels::link_probe_check(own + B, B, 1 - rank, bad, stream));
  MEGAMOE_RANK_CUDA(cudaMemcpyAsync(&res->bad, bad, sizeof(*bad), cudaMemcpyDeviceToHost, stream));
  MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
  cudaFree(bad);
}

// The flags' rules that CLI11's checks do not cover; throws ToolError (kExitUsage).
void check_link_flags(const LinkOptions& o) {
  for (const std::string& p : o.paths)
    if (p != "store" && p != "staged" && p != "tma" && p != "pull" && p != "ce" && p != "ce-lsa" && !is_handshake(p))
      throw ToolError(kExitUsage, "--paths: '" + p +
                                      "' is not one of store, staged, tma, pull, ce, ce-lsa, handshake, handshake-grid");
  if (o.chunk % 16 != 0 || ((o.mib << 20) % o.chunk) != 0)
    throw ToolError(kExitUsage, "--chunk " + std::to_string(o.chunk) + " must be a multiple of 16 that divides --mib MiB");
  // Shared memory of the bulk paths: an H200 CTA gets at most 227 KiB.
  constexpr int kMaxSmem = 227 * 1024;
  const int staged_smem = kernels::link_probe_smem_bytes(kernels::LinkPath::kStaged, {1, o.staged_warps, o.chunk, 2});
  const int tma_smem = kernels::link_probe_smem_bytes(kernels::LinkPath::kTma, {1, o.tma_warps, o.chunk, o.stages});
  for (const std::string& p : o.paths) {
    if (p == "staged" && staged_smem > kMaxSmem)
      throw ToolError(kExitUsage, "--staged-warps " + std::to_string(o.staged_warps) + " x 2 x --chunk " +
                                      std::to_string(o.chunk) + " = " + std::to_string(staged_smem) +
                                      " bytes of shared memory; must be <= " + std::to_string(kMaxSmem) +
                                      " (fewer warps or a smaller chunk)");
    if (p == "tma" && tma_smem > kMaxSmem)
      throw ToolError(kExitUsage, "--tma-warps " + std::to_string(o.tma_warps) + " x --stages " +
                                      std::to_string(o.stages) + " x --chunk " + std::to_string(o.chunk) + " = " +
                                      std::to_string(tma_smem) + " bytes of shared memory; must be <= " +
                                      std::to_string(kMaxSmem) + " (fewer warps or stages, or a smaller chunk)");
  }
}

// Both GPUs' symmetric windows (2 x --mib MiB each: the sent half, then the received half), the LSA
// address of the peer's, and each GPU's SM count; released on destruction (collective).
struct LinkWindows {
  std::vector<std::shared_ptr<Communicator>> comms;
  std::vector<void*> base = {nullptr, nullptr}, lsa_peer = {nullptr, nullptr};
  std::vector<std::function<void(void*)>> release = std::vector<std::function<void(void*)>>(2);
  std::vector<int> sms = {132, 132};
  int64_t bytes = 0;
  // After a failure the windows are left to the process's exit: their release is collective, and a
  // rank whose setup or path failed may not take part.
  bool abandoned = false;
  int device(int r) const { return nccl_rank_of(comms[r].get())->device(); }
  ~LinkWindows() {
    if (abandoned) return;
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([this, r] {
        if (!base[r] || !release[r]) return;
        cudaSetDevice(device(r));
        release[r](base[r]);
      });
    for (auto& t : threads) t.join();
  }
};

void open_link_windows(const LinkOptions& o, LinkWindows* w) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2)
    throw ToolError(kExitUnavailable, "needs 2 GPUs, found " + std::to_string(count));
  Status st = create_nccl_group({0, 1}, &w->comms);
  if (!st.is_ok()) throw ToolError(kExitUnavailable, st.to_string());
  w->bytes = 2 * (o.mib << 20);
  std::vector<Status> status(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      NcclRankComm* nccl = nccl_rank_of(w->comms[r].get());
      if (cudaSetDevice(nccl->device()) != cudaSuccess) {
        status[r] = Status(StatusCode::kInternal, "cudaSetDevice failed");
        return;
      }
      cudaDeviceGetAttribute(&w->sms[r], cudaDevAttrMultiProcessorCount, nccl->device());
      status[r] = symmetric_alloc(std::dynamic_pointer_cast<NcclRankComm>(w->comms[r]), w->bytes, &w->base[r],
                                  &w->release[r]);
      if (!status[r].is_ok()) return;
      cudaError_t e = kernels::link_probe_peer_base(symmetric_window_of(w->base[r]), 1 - r, &w->lsa_peer[r]);
      if (e == cudaSuccess) e = kernels::link_probe_fill(w->base[r], w->bytes / 2, r, nullptr);
      if (e == cudaSuccess) e = cudaDeviceSynchronize();
      if (e != cudaSuccess) status[r] = Status(StatusCode::kInternal, std::string("setup: ") + cudaGetErrorString(e));
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    if (!status[r].is_ok()) {
      w->abandoned = true;
      throw ToolError(kExitUnavailable, "rank " + std::to_string(r) + ": " + status[r].to_string());
    }
}

std::string path_shape(const LinkOptions& o, const std::string& path) {
  if (path == "store" || path == "pull") return std::to_string(o.store_ctas_per_sm) + " x 512 threads per SM";
  if (path == "staged") return std::to_string(o.staged_warps) + " warps per SM, " + std::to_string(o.chunk) + " B x 2";
  if (path == "tma")
    return std::to_string(o.tma_warps) + " warps per SM, " + std::to_string(o.chunk) + " B x " + std::to_string(o.stages);
  if (path == "ce") return "cudaMemcpyPeerAsync x " + std::to_string(o.ce_chunks);
  if (path == "handshake") return std::string("1 CTA, round trip, ") + (o.pdl ? "PDL" : "no PDL");
  if (path == "handshake-grid") return std::string("2 x 512 thr/SM, tickets, ") + (o.pdl ? "PDL" : "no PDL");
  return "cudaMemcpyAsync to the LSA VA x " + std::to_string(o.ce_chunks);
}

// Runs one path on both GPUs at once and returns its record (per rank: median µs, GB/s; check).
nlohmann::json run_link_path(const LinkOptions& o, const std::string& path, LinkWindows& w) {
  ThreadBarrier barrier(2);
  std::vector<RankResult> res(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      if (is_handshake(path))
        run_handshake(o, path, w.device(r), w.sms[r], static_cast<char*>(w.base[r]) + w.bytes,
                      static_cast<char*>(w.lsa_peer[r]) + w.bytes, barrier, &res[r]);
      else
        run_path(o, path, r, w.device(r), w.sms[r], static_cast<char*>(w.base[r]), static_cast<char*>(w.lsa_peer[r]),
                 static_cast<char*>(w.base[1 - r]), w.device(1 - r), barrier, &res[r]);
    });
  for (auto& t : threads) t.join();
  nlohmann::json rec = {{"path", path}, {"shape", path_shape(o, path)}, {"mib", o.mib}, {"iters", o.iters}};
  bool ok = true;
  for (int r = 0; r < 2; ++r) {
    if (!res[r].error.empty()) {
      w.abandoned = true;
      throw ToolError(kExitUnavailable, path + ", rank " + std::to_string(r) + ": " + res[r].error);
    }
    const std::string p = "r" + std::to_string(r) + "_";
    const Summary s = summarize(res[r].us);
    set_summary(&rec, s, p);
    if (!is_handshake(path)) {
      rec[p + "gbps"] = static_cast<double>(o.mib << 20) / (s.median * 1e3);
      // Both directions at once: the copy engine's ceiling per direction (kH200NvlinkBytesPerS) is the floor.
      set_floor(&rec, s.median, static_cast<double>(o.mib << 20) / kH200NvlinkBytesPerS * 1e6);
    }
    ok = ok && res[r].bad == 0;
  }
  if (ok) rec["check"] = "ok";
  else if (is_handshake(path))
    rec["check"] = "TIMEOUT (" + std::to_string(res[0].bad + res[1].bad) + " / " +
                   std::to_string(2ull * o.handshakes * (o.iters + 1)) + " round trips)";
  else
    rec["check"] = "MISMATCH";
  return rec;
}

const RowPrinter& link_printer() {
  static const RowPrinter printer({{"path", "path", -7},
                                   {"shape", "shape", -34},
                                   {"r0_median_us", "us r0", 10, "%.2f"},
                                   {"r0_gbps", "GB/s r0", 10, "%.1f"},
                                   {"r1_median_us", "us r1", 10, "%.2f"},
                                   {"r1_gbps", "GB/s r1", 10, "%.1f"},
                                   {"time_over_floor", "time/floor", 10, "%.2f"},
                                   {"check", "check", 0, "%s", "  "}},
                                  "  ", "# ");
  return printer;
}

int run_bench_link(const LinkOptions& o) {
  check_link_flags(o);  // the flags first, then the machine
  LinkWindows w;
  open_link_windows(o, &w);
  std::printf("# bench-link: 2 GPUs, %lld MiB per direction, both directions at once, %d launches after 1 warm-up; "
              "time/floor: rank 1's time against --mib MiB at %.0f GB/s\n",
              static_cast<long long>(o.mib), o.iters, kH200NvlinkBytesPerS / 1e9);
  std::printf("%s\n", link_printer().header().c_str());
  int rc = 0;
  std::vector<nlohmann::json> records;
  for (const std::string& path : o.paths) {
    records.push_back(run_link_path(o, path, w));
    std::printf("%s\n", link_printer().row(records.back()).c_str());
    std::fflush(stdout);
    if (records.back()["check"] != "ok") rc = 1;
  }
  if (!o.json.empty()) write_json_file(o.json, {{"tool", "megamoe bench-link"}, {"rows", records}});
  if (!o.csv.empty()) {
    std::vector<std::string> keys = {"path", "shape", "mib", "iters"};
    for (const char* r : {"r0_", "r1_"})
      for (const char* k : {"median_us", "min_us", "max_us", "gbps"}) keys.push_back(std::string(r) + k);
    for (const char* k : {"floor_us", "time_over_floor", "check"}) keys.push_back(k);
    write_csv_file(o.csv, keys, records);
  }
  return rc;
}

}  // namespace

CommandRun add_link_bench_command(CLI::App* app) {
  auto o = std::make_shared<LinkOptions>();
  CLI::App* sub = app->add_subcommand(
      "bench-link", "NVLink between two GPUs' NCCL symmetric windows: kernel stores, TMA bulk stores, pulls, copy engine");
  sub->add_option("--mib", o->mib, "MiB per direction")->capture_default_str()->check(CLI::Range(1, 16384));
  sub->add_option("--iters", o->iters, "timed launches per path")->capture_default_str()->check(CLI::Range(1, 10000));
  sub->add_option("--ce-chunks", o->ce_chunks, "ce / ce-lsa: copies per direction, back to back")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  sub->add_option("--paths", o->paths,
                  "store, staged, tma, pull, ce, ce-lsa, handshake, handshake-grid (comma-separated; default: the six "
                  "data paths)")->delimiter(',')->capture_default_str();
  sub->add_option("--handshakes", o->handshakes, "handshake paths: round trips per timed CUDA graph")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  sub->add_flag("!--no-pdl", o->pdl, "handshake paths: ordinary launches instead of programmatic dependent ones");
  sub->add_option("--chunk", o->chunk, "bytes per TMA bulk copy")->capture_default_str()->check(CLI::Range(16, 65536));
  sub->add_option("--stages", o->stages, "tma: chunks in flight per warp")->capture_default_str()->check(CLI::Range(1, 16));
  sub->add_option("--store-ctas-per-sm", o->store_ctas_per_sm, "store / pull: CTAs of 512 threads per SM")
      ->capture_default_str()
      ->check(CLI::Range(1, 4));
  sub->add_option("--staged-warps", o->staged_warps, "staged: warps per CTA (one CTA per SM)")
      ->capture_default_str()
      ->check(CLI::Range(1, 32));
  sub->add_option("--tma-warps", o->tma_warps, "tma: warps per CTA (one CTA per SM)")->capture_default_str()->check(CLI::Range(1, 32));
  sub->add_option("--json", o->json, "write the rows as JSON to F")->type_name("F");
  sub->add_option("--csv", o->csv, "write the rows as CSV to F")->type_name("F");
  return [o] { return run_bench_link(*o); };
}

}  // namespace megamoe::tool
