// `megamoe launch` and `megamoe bench-transport`, the EP transport's subcommands.
//
//   megamoe launch -n N -- <command...>     start N processes of <command> on this host, one per GPU,
//                                           with MEGAMOE_RANK / MEGAMOE_WORLD_SIZE / MEGAMOE_LOCAL_RANK /
//                                           MEGAMOE_NCCL_ID_FILE set; forwards the first failing exit
//                                           code (128+signal for a signal) and stops the others.
//   megamoe bench-transport [flags]         dispatch / combine µs and GB/s per direction beside an NCCL
//                                           all-to-all of the same bytes (one process driving --ranks
//                                           GPUs, or one rank per process under `megamoe launch`), with
//                                           the NVLink floor; rows also as --json / --csv.

#include <CLI/CLI.hpp>
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_harness.h"
#include "bench_model.h"
#include "comm/nccl_comm.h"
#include "commands.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "kernels/transport/ep_transport.h"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "presets.h"
#include "ranks.h"

namespace megamoe::tool {
namespace {

// ---------------------------------------------------------------------------------------------
// launch

int run_launch(int n, const std::vector<std::string>& command) {
  if (n < 1) {
    std::fprintf(stderr, "megamoe launch: error: -n=%d, must be >= 1\n", n);
    return 2;
  }
  if (command.empty()) {
    std::fprintf(stderr, "megamoe launch: error: no command; usage: megamoe launch -n N -- <command...>\n");
    return 2;
  }
  char dir_template[] = "/tmp/megamoe-launch-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (!dir) {
    std::perror("megamoe launch: mkdtemp");
    return 4;
  }
  const std::string id_file = std::string(dir) + "/nccl_id";  // fresh per launch: never stale
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("megamoe launch: fork");
      for (pid_t p : pids) kill(p, SIGTERM);
      return 3;
    }
    if (pid == 0) {
      setenv("MEGAMOE_RANK", std::to_string(r).c_str(), 1);
      setenv("MEGAMOE_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MEGAMOE_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("MEGAMOE_NCCL_ID_FILE", id_file.c_str(), 1);
      std::vector<char*> argv;
      for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      std::fprintf(stderr, "megamoe launch: rank %d: cannot run '%s': %s\n", r, argv[0], std::strerror(errno));
      _exit(127);
    }
    pids.push_back(pid);
  }
  int result = 0;
  size_t live = pids.size();
  bool stopping = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (live > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, stopping ? WNOHANG : 0);
    if (pid == 0) {  // stopping, nobody exited yet
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : pids)
          if (p > 0) kill(p, SIGKILL);
        deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (pid < 0) break;
    auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const int rank = static_cast<int>(it - pids.begin());
    *it = -1;
    --live;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && result == 0) {
      result = code;
      std::fprintf(stderr, "megamoe launch: rank %d exited with %d; stopping the other ranks\n", rank, code);
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGTERM);
      stopping = true;
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
  }
  unlink(id_file.c_str());
  rmdir(dir);
  return result;
}

// ---------------------------------------------------------------------------------------------
// bench-transport

struct BenchOptions {
  int ranks = 2;
  std::string tokens = "1,8,128,512,1024,4096,8192";
  int64_t hidden = 7168, experts = 256, top_k = 8;
  std::string dispatch = "fp8", combine = "bf16";
  std::string x_dtype = "bf16";  // dispatch input: bf16 (quantised in the kernel for an fp8 wire) or fp8 + scales
  int iters = 30, warmup = 5;
  int graph_iters = 32, graph_reps = 5;  // back-to-back forwards per graph, graph launches timed
  bool split_combine = false;            // combine_send + combine (two kernels) instead of send_and_combine
  int combine_groups = 0;                // EpTransportOptions::combine_groups
  bool owner_reduce = false;             // WorkspaceParams::owner_reduce: one combine row per (token, owner)
  uint32_t seed = 1;
  std::string json, csv;
};

struct RankRouting {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

RankRouting make_routing(const BenchOptions& o, int rank, int64_t T) {
  RankRouting r;
  std::mt19937 rng(o.seed * 1000003u + static_cast<uint32_t>(rank) * 7919u + static_cast<uint32_t>(T));
  std::uniform_int_distribution<int> pick(0, static_cast<int>(o.experts) - 1);
  std::uniform_real_distribution<float> w(0.05f, 1.f);
  r.ids.resize(T * o.top_k);
  r.weights.resize(T * o.top_k);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < o.top_k; ++j) {
      int32_t id;
      bool dup;
      do {
        id = pick(rng);
        dup = false;
        for (int64_t jj = 0; jj < j; ++jj) dup |= r.ids[t * o.top_k + jj] == id;
      } while (dup);
      r.ids[t * o.top_k + j] = id;
      r.weights[t * o.top_k + j] = w(rng);
    }
  return r;
}

// One point's results on one rank (µs).
struct PointResult {
  Summary dispatch, combine, total, nccl_dispatch, nccl_combine;
  // Back-to-back forwards in one graph per rank (launch skew amortised over graph_iters forwards):
  // per-forward phase medians from event nodes, and whole-graph µs per forward / per dispatch.
  Summary g_dispatch, g_pool, g_combine;
  double g_forward_us = 0, g_dispatch_only_us = 0;
  // The same without event nodes (each costs a few us at small T): whole forwards, and dispatch +
  // pool build; combine = their difference, d+c = dispatch-only + that.
  double g_clean_forward_us = 0, g_dispatch_pool_us = 0;
  double dispatch_bytes = 0, combine_bytes = 0;  // rank 0 -> peers, per direction (max over peers)
  std::string error;
};

#define BENCH_CHECK(expr)                                                      \
  do {                                                                         \
    const ::megamoe::Status _st = (expr);                                      \
    if (!_st.is_ok()) {                                                        \
      res->error = std::string(#expr) + ": " + _st.to_string();                \
      return;                                                                  \
    }                                                                          \
  } while (0)

// The combine phase: one kernel (send_and_combine), or with --split-combine the two-kernel path that
// backends whose FC2 epilogue writes the wire rows use (combine_send here standing in for it).
Status combine_phase(const BenchOptions& o, EpTransport* tr, const TensorView& out, const TensorView& ids,
                     const TensorView& y, cudaStream_t stream) {
  if (!o.split_combine) return tr->send_and_combine(out, ids, y, stream);
  MEGAMOE_RETURN_IF_ERROR(tr->combine_send(out, stream));
  return tr->combine(ids, y, stream);
}

// One rank's transport, stream, buffers and byte counts for one point; released on destruction.
struct TransportPoint {
  std::unique_ptr<EpTransport> tr;
  cudaStream_t stream = nullptr;
  NcclRankComm* nccl = nullptr;
  int rank = 0, ranks = 1;
  bool x_fp8 = false;
  void *dx = nullptr, *dxs = nullptr, *dids = nullptr, *dw = nullptr, *dy = nullptr, *dout = nullptr,
       *a2a_send = nullptr, *a2a_recv = nullptr;
  TensorView vx, vxs, vids, vw, vy, vout;
  // Bytes to / from each rank: dispatch rows, and the combine rows each owner sends back.
  std::vector<size_t> disp_send, disp_recv, comb_send, comb_recv;
  size_t max_a2a = 16;
  std::vector<cudaEvent_t> events;  // 4
  TransportPoint() = default;
  TransportPoint(const TransportPoint&) = delete;
  TransportPoint& operator=(const TransportPoint&) = delete;
  ~TransportPoint() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (void* q : {dx, dxs, dids, dw, dy, dout, a2a_send, a2a_recv}) cudaFree(q);
  }
  Status dispatch() { return tr->dispatch(vx, x_fp8 ? vxs : TensorView(), vids, vw, stream); }
  // The NCCL all-to-all of the same bytes (ncclSend / ncclRecv per peer in one group).
  ncclResult_t a2a(const std::vector<size_t>& send, const std::vector<size_t>& recv) {
    ncclGroupStart();
    for (int q = 0; q < ranks; ++q) {
      if (send[q]) ncclSend(static_cast<char*>(a2a_send) + q * max_a2a, send[q], ncclUint8, q, nccl->nccl(), stream);
      if (recv[q]) ncclRecv(static_cast<char*>(a2a_recv) + q * max_a2a, recv[q], ncclUint8, q, nccl->nccl(), stream);
    }
    return ncclGroupEnd();
  }
};

// x for rank `rank`: random bf16 values; with --x fp8 also quantised here in 1x128 blocks (the kernel
// copies codes and scales).
void make_x(const BenchOptions& o, int rank, int64_t T, std::vector<uint16_t>* x, std::vector<uint8_t>* xq,
            std::vector<float>* xs) {
  const int64_t H = o.hidden;
  x->resize(T * H);
  uint32_t lcg = 12345u + rank;
  for (auto& v : *x) {
    lcg = lcg * 1664525u + 1013904223u;
    v = fmt::float_to_bf16((static_cast<int32_t>(lcg >> 8) - (1 << 23)) * (1.f / (1 << 22)));
  }
  if (o.x_dtype != "fp8") return;
  xq->resize(T * H);
  xs->resize(T * H / 128);
  std::vector<float> row(H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) row[i] = fmt::bf16_to_float((*x)[t * H + i]);
    fmt::quantize_fp8_1x128(row.data(), H, &(*xq)[t * H], &(*xs)[t * H / 128], false);
  }
}

// The bytes this rank sends to and receives from each peer (every rank derives every rank's routing).
void count_bytes(const BenchOptions& o, const WorkspaceLayout& l, int64_t T, TransportPoint* pt) {
  const int R = pt->ranks, rank = pt->rank;
  const int64_t k = o.top_k, El = o.experts / R;
  std::vector<RankRouting> routing;
  for (int r = 0; r < R; ++r) routing.push_back(make_routing(o, r, T));
  const int64_t row_bytes = o.hidden * ws_elem_bytes(l.params.dispatch_format) +
                            (l.params.dispatch_format == kWsFp8Block ? o.hidden / 128 * 4 : 0) + l.meta_bytes;
  auto tokens_to = [&](int src, int dst) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool any = false;
      for (int64_t j = 0; j < k; ++j) any |= routing[src].ids[t * k + j] / El == dst;
      n += any;
    }
    return n;
  };
  auto pairs_to = [&](int src, int dst) {
    int64_t n = 0;
    for (int64_t t = 0; t < T * k; ++t) n += routing[src].ids[t] / El == dst;
    return n;
  };
  pt->disp_send.assign(R, 0);
  pt->disp_recv.assign(R, 0);
  pt->comb_send.assign(R, 0);
  pt->comb_recv.assign(R, 0);
  for (int q = 0; q < R; ++q) {
    if (q == rank) continue;
    pt->disp_send[q] = tokens_to(rank, q) * row_bytes;
    pt->disp_recv[q] = tokens_to(q, rank) * row_bytes;
    // I own, q is the source: a row per (token, slot), or with the owner reduce per token
    pt->comb_send[q] = (o.owner_reduce ? tokens_to(q, rank) : pairs_to(q, rank)) * l.wire_row_bytes;
    pt->comb_recv[q] = (o.owner_reduce ? tokens_to(rank, q) : pairs_to(rank, q)) * l.wire_row_bytes;
  }
  for (int q = 0; q < R; ++q)
    pt->max_a2a = std::max({pt->max_a2a, pt->disp_send[q], pt->disp_recv[q], pt->comb_send[q], pt->comb_recv[q]});
}

// The transport of one point (max_tokens_per_rank = T) on this rank, its inputs on the device.
Status setup_point(const BenchOptions& o, std::shared_ptr<Communicator> comm, int64_t T, TransportPoint* pt) {
  pt->nccl = nccl_rank_of(comm.get());
  pt->rank = comm->rank();
  pt->ranks = comm->size();
  MEGAMOE_CUDA_CHECK(cudaSetDevice(pt->nccl->device()));
  EpTransportOptions opt;
  WorkspaceParams& p = opt.params;
  p.ep_size = pt->ranks;
  p.experts_per_rank = o.experts / pt->ranks;
  p.top_k = o.top_k;
  p.hidden = o.hidden;
  p.intermediate = 128;
  p.max_tokens_per_rank = T;
  opt.combine_groups = o.combine_groups;
  p.dispatch_format = o.dispatch == "bf16" ? kWsBf16 : kWsFp8Block;
  p.intermediate_format = kWsBf16;
  p.combine_format = o.combine == "mxfp8" ? kWsMxfp8 : o.combine == "nvfp4" ? kWsNvfp4 : kWsBf16;
  p.owner_reduce = o.owner_reduce ? 1 : 0;
  MEGAMOE_RETURN_IF_ERROR(EpTransport::create(comm, opt, &pt->tr));
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&pt->stream, cudaStreamNonBlocking));
  MEGAMOE_RETURN_IF_ERROR(pt->tr->warmup(pt->stream));
  const WorkspaceLayout& l = pt->tr->layout();
  const int64_t H = o.hidden, k = o.top_k;
  count_bytes(o, l, T, pt);
  std::vector<uint16_t> x;
  std::vector<uint8_t> xq;
  std::vector<float> xs;
  make_x(o, pt->rank, T, &x, &xq, &xs);
  pt->x_fp8 = o.x_dtype == "fp8";
  const RankRouting routing = make_routing(o, pt->rank, T);
  const int R = pt->ranks;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->dx, std::max<int64_t>(T * H * 2, 16)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->dids, std::max<int64_t>(T * k * 4, 16)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->dw, std::max<int64_t>(T * k * 4, 16)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->dy, std::max<int64_t>(T * H * 2, 16)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->dout, std::max<int64_t>(l.pool_rows * H * 2, 16)));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->a2a_send, pt->max_a2a * R));
  MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->a2a_recv, pt->max_a2a * R));
  if (pt->x_fp8) {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&pt->dxs, std::max<int64_t>(T * H / 128 * 4, 16)));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(pt->dx, xq.data(), T * H, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(pt->dxs, xs.data(), T * H / 128 * 4, cudaMemcpyHostToDevice));
  } else {
    MEGAMOE_CUDA_CHECK(cudaMemcpy(pt->dx, x.data(), T * H * 2, cudaMemcpyHostToDevice));
  }
  MEGAMOE_CUDA_CHECK(cudaMemcpy(pt->dids, routing.ids.data(), T * k * 4, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(pt->dw, routing.weights.data(), T * k * 4, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(cudaMemset(pt->dout, 0x3C, l.pool_rows * H * 2));  // FC2 stand-in (values do not change bytes)
  const Device dev = Device::cuda(pt->nccl->device());
  pt->vx = TensorView(pt->dx, pt->x_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16, {T, H}, dev);
  pt->vxs = TensorView(pt->dxs, DType::kFloat32, {T, H / 128}, dev);
  pt->vids = TensorView(pt->dids, DType::kInt32, {T, k}, dev);
  pt->vw = TensorView(pt->dw, DType::kFloat32, {T, k}, dev);
  pt->vy = TensorView(pt->dy, DType::kBFloat16, {T, H}, dev);
  pt->vout = TensorView(pt->dout, DType::kBFloat16, {l.pool_rows, H}, dev);
  pt->events.resize(4);
  for (auto& e : pt->events) MEGAMOE_CUDA_CHECK(cudaEventCreate(&e));
  return Status::ok();
}

// Owns instantiated CUDA graphs (and the graphs they came from) and destroys them.
struct Graphs {
  std::vector<cudaGraph_t> graphs;
  std::vector<cudaGraphExec_t> execs;
  ~Graphs() {
    for (cudaGraphExec_t x : execs) cudaGraphExecDestroy(x);
    for (cudaGraph_t g : graphs) cudaGraphDestroy(g);
  }
  // Captures `body` on `stream` and instantiates it; returns its index.
  Status capture(cudaStream_t stream, const std::function<Status()>& body, size_t* index) {
    MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status cap = body();
    cudaGraph_t g = nullptr;
    MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    graphs.push_back(g);
    MEGAMOE_RETURN_IF_ERROR(cap);
    cudaGraphExec_t x = nullptr;
    MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&x, g, 0));
    execs.push_back(x);
    *index = execs.size() - 1;
    return Status::ok();
  }
};

// The phases of single forwards, each a CUDA graph (dispatch | expert pool | combine), and the NCCL
// all-to-all of the same bytes. The stream waits on a host gate while the timed work is enqueued;
// the gate opens after every rank has enqueued (barrier), so neither host launch latency nor rank
// skew lands inside the events.
void time_phases(const BenchOptions& o, TransportPoint& pt, const std::function<void()>& sync, PointResult* res) {
  Graphs graphs;
  size_t phase[3];
  BENCH_CHECK(graphs.capture(pt.stream, [&] { return pt.dispatch(); }, &phase[0]));
  BENCH_CHECK(graphs.capture(pt.stream, [&] { return pt.tr->build_expert_pool(pt.stream); }, &phase[1]));
  BENCH_CHECK(graphs.capture(pt.stream, [&] { return combine_phase(o, pt.tr.get(), pt.vout, pt.vids, pt.vy, pt.stream); },
                             &phase[2]));
  std::atomic<int> gate{0};
  // Bounded (2 s): a gate that never opens must not hang the benchmark.
  auto hold = [](void* g) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (static_cast<std::atomic<int>*>(g)->load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() < until) {
    }
  };
  const cudaStream_t stream = pt.stream;
  cudaEvent_t* ev = pt.events.data();
  std::vector<double> td, tc, tt, nd, nc;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    gate.store(0);
    MEGAMOE_RANK_CUDA(cudaLaunchHostFunc(stream, hold, &gate));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[0], stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(graphs.execs[phase[0]], stream));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[1], stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(graphs.execs[phase[1]], stream));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[2], stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(graphs.execs[phase[2]], stream));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[3], stream));
    sync();
    gate.store(1, std::memory_order_release);
    MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
    float d = 0, c = 0;
    MEGAMOE_RANK_CUDA(cudaEventElapsedTime(&d, ev[0], ev[1]));
    MEGAMOE_RANK_CUDA(cudaEventElapsedTime(&c, ev[2], ev[3]));
    // The NCCL all-to-all of the same bytes, each direction set on its own. Behind the gate only when
    // the barrier is a host one: an NCCL barrier on the same communicator would queue behind it.
    gate.store(0);
    sync();  // no gate: NCCL may queue its own host work behind it
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[0], stream));
    if (pt.a2a(pt.disp_send, pt.disp_recv) != ncclSuccess) {
      res->error = "ncclSend/ncclRecv failed";
      return;
    }
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[1], stream));
    if (pt.a2a(pt.comb_send, pt.comb_recv) != ncclSuccess) {
      res->error = "ncclSend/ncclRecv failed";
      return;
    }
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[2], stream));
    gate.store(1, std::memory_order_release);
    MEGAMOE_RANK_CUDA(cudaStreamSynchronize(stream));
    float n1 = 0, n2 = 0;
    MEGAMOE_RANK_CUDA(cudaEventElapsedTime(&n1, ev[0], ev[1]));
    MEGAMOE_RANK_CUDA(cudaEventElapsedTime(&n2, ev[1], ev[2]));
    if (it >= o.warmup) {
      td.push_back(d * 1e3);
      tc.push_back(c * 1e3);
      tt.push_back((d + c) * 1e3);
      nd.push_back(n1 * 1e3);
      nc.push_back(n2 * 1e3);
    }
  }
  BENCH_CHECK(pt.tr->check_error(stream));
  res->dispatch = summarize(td);
  res->combine = summarize(tc);
  res->total = summarize(tt);
  res->nccl_dispatch = summarize(nd);
  res->nccl_combine = summarize(nc);
}

// Amortised: N forwards back to back in one graph per rank, and N dispatches back to back; every
// rank launches its graph right after a host barrier, so the launch skew between ranks is paid once
// per N forwards. Event nodes around each phase give per-forward phase times.
void time_amortised(const BenchOptions& o, TransportPoint& pt, const std::function<void()>& sync, PointResult* res) {
  const int N = o.graph_iters;
  const cudaStream_t stream = pt.stream;
  std::vector<cudaEvent_t> pe(4 * N);
  struct EventsGuard {
    std::vector<cudaEvent_t>& v;
    ~EventsGuard() {
      for (cudaEvent_t e : v)
        if (e) cudaEventDestroy(e);
    }
  } guard{pe};
  for (auto& e : pe) MEGAMOE_RANK_CUDA(cudaEventCreate(&e));
  Graphs graphs;
  size_t forwards = 0, dispatches = 0, clean = 0, dispatch_pool = 0;
  // External event nodes: they record timestamps when the graph runs (plain captured events do not).
  BENCH_CHECK(graphs.capture(stream, [&]() -> Status {
    for (int i = 0; i < N; ++i) {
      cudaEventRecordWithFlags(pe[4 * i], stream, cudaEventRecordExternal);
      MEGAMOE_RETURN_IF_ERROR(pt.dispatch());
      cudaEventRecordWithFlags(pe[4 * i + 1], stream, cudaEventRecordExternal);
      MEGAMOE_RETURN_IF_ERROR(pt.tr->build_expert_pool(stream));
      cudaEventRecordWithFlags(pe[4 * i + 2], stream, cudaEventRecordExternal);
      MEGAMOE_RETURN_IF_ERROR(combine_phase(o, pt.tr.get(), pt.vout, pt.vids, pt.vy, stream));
      cudaEventRecordWithFlags(pe[4 * i + 3], stream, cudaEventRecordExternal);
    }
    return Status::ok();
  }, &forwards));
  BENCH_CHECK(graphs.capture(stream, [&]() -> Status {
    for (int i = 0; i < N; ++i) MEGAMOE_RETURN_IF_ERROR(pt.dispatch());
    return Status::ok();
  }, &dispatches));
  // Without event nodes: N forwards, and N x (dispatch + pool build).
  for (int which = 0; which < 2; ++which)
    BENCH_CHECK(graphs.capture(stream, [&]() -> Status {
      for (int i = 0; i < N; ++i) {
        MEGAMOE_RETURN_IF_ERROR(pt.dispatch());
        MEGAMOE_RETURN_IF_ERROR(pt.tr->build_expert_pool(stream));
        if (which == 0) MEGAMOE_RETURN_IF_ERROR(combine_phase(o, pt.tr.get(), pt.vout, pt.vids, pt.vy, stream));
      }
      return Status::ok();
    }, which == 0 ? &clean : &dispatch_pool));
  std::vector<double> fwd, disp_only, clean_fwd, disp_pool, gdisp, gpool, gcomb;
  cudaEvent_t* ev = pt.events.data();
  // One graph launched right after a host barrier; µs per forward (the barrier's skew paid once).
  auto time_graph = [&](size_t x, std::vector<double>* out) -> bool {
    sync();
    if (cudaEventRecord(ev[0], stream) != cudaSuccess || cudaGraphLaunch(graphs.execs[x], stream) != cudaSuccess ||
        cudaEventRecord(ev[1], stream) != cudaSuccess || cudaStreamSynchronize(stream) != cudaSuccess)
      return false;
    float ms = 0;
    if (cudaEventElapsedTime(&ms, ev[0], ev[1]) != cudaSuccess) return false;
    out->push_back(ms * 1e3 / N);
    return true;
  };
  for (int rep = 0; rep < o.graph_reps + 1; ++rep) {  // the first rep warms up
    if (!time_graph(forwards, &fwd) || !time_graph(dispatches, &disp_only) || !time_graph(clean, &clean_fwd) ||
        !time_graph(dispatch_pool, &disp_pool)) {
      res->error = std::string("amortised graphs: ") + cudaGetErrorString(cudaGetLastError());
      return;
    }
    if (rep == 0) {
      fwd.clear();
      disp_only.clear();
      clean_fwd.clear();
      disp_pool.clear();
      continue;
    }
    for (int i = 1; i < N; ++i) {  // forward 0 absorbs the launch skew
      float a = 0, b = 0, c = 0;
      if (cudaEventElapsedTime(&a, pe[4 * i], pe[4 * i + 1]) != cudaSuccess ||
          cudaEventElapsedTime(&b, pe[4 * i + 1], pe[4 * i + 2]) != cudaSuccess ||
          cudaEventElapsedTime(&c, pe[4 * i + 2], pe[4 * i + 3]) != cudaSuccess) {
        cudaGetLastError();  // no phase times (event nodes not timed here): the totals remain
        break;
      }
      gdisp.push_back(a * 1e3);
      gpool.push_back(b * 1e3);
      gcomb.push_back(c * 1e3);
    }
  }
  BENCH_CHECK(pt.tr->check_error(stream));
  res->g_forward_us = summarize(fwd).median;
  res->g_dispatch_only_us = summarize(disp_only).median;
  res->g_clean_forward_us = summarize(clean_fwd).median;
  res->g_dispatch_pool_us = summarize(disp_pool).median;
  res->g_dispatch = summarize(gdisp);
  res->g_pool = summarize(gpool);
  res->g_combine = summarize(gcomb);
}

// One rank's run of one point. `sync` is a host barrier across ranks (threads or processes).
void bench_point(const BenchOptions& o, std::shared_ptr<Communicator> comm, int64_t T,
                 const std::function<void()>& sync, PointResult* res) {
  TransportPoint pt;
  if (const Status st = setup_point(o, comm, T, &pt); !st) res->error = "setup: " + st.to_string();
  if (res->error.empty()) time_phases(o, pt, sync, res);
  if (res->error.empty() && o.graph_iters > 0) time_amortised(o, pt, sync, res);
  if (!pt.disp_send.empty()) {
    res->dispatch_bytes = static_cast<double>(*std::max_element(pt.disp_send.begin(), pt.disp_send.end()));
    res->combine_bytes = static_cast<double>(*std::max_element(pt.comb_send.begin(), pt.comb_send.end()));
  }
  if (!res->error.empty()) {
    // Releasing a transport is collective and its peers may be gone: it is left to the process's exit.
    (void)pt.tr.release();
    return;
  }
  sync();
  pt.tr.reset();  // collective release
  cudaStreamDestroy(pt.stream);
  pt.stream = nullptr;
}

double gbps(double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; }

// A point's record: every column of both text tables (the --json rows, and --csv by these keys).
nlohmann::json point_record(int64_t T, const PointResult& r) {
  nlohmann::json j;
  j["tokens"] = T;
  j["dispatch_bytes"] = r.dispatch_bytes;
  j["combine_bytes"] = r.combine_bytes;
  j["dispatch_us"] = summary_json(r.dispatch);
  j["dispatch_gbps"] = gbps(r.dispatch_bytes, r.dispatch.median);
  j["combine_us"] = summary_json(r.combine);
  j["combine_gbps"] = gbps(r.combine_bytes, r.combine.median);
  j["dispatch_combine_us"] = r.total.median;
  j["nccl_dispatch_us"] = r.nccl_dispatch.median;
  j["nccl_dispatch_gbps"] = gbps(r.dispatch_bytes, r.nccl_dispatch.median);
  j["nccl_combine_us"] = r.nccl_combine.median;
  j["nccl_combine_gbps"] = gbps(r.combine_bytes, r.nccl_combine.median);
  // NVLink floor of one dispatch and one combine, back to back (kH200NvlinkBytesPerS per direction)
  set_floor(&j, r.total.median, (r.dispatch_bytes + r.combine_bytes) / kH200NvlinkBytesPerS * 1e6);
  if (r.g_forward_us > 0) {
    j["graph_dispatch_us"] = summary_json(r.g_dispatch);
    j["graph_dispatch_gbps"] = gbps(r.dispatch_bytes, r.g_dispatch.median);
    j["graph_pool_us"] = r.g_pool.median;
    j["graph_combine_us"] = summary_json(r.g_combine);
    j["graph_combine_gbps"] = gbps(r.combine_bytes, r.g_combine.median);
    j["graph_dispatch_combine_us"] = r.g_dispatch.median + r.g_combine.median;
    j["graph_forward_events_us"] = r.g_forward_us;  // with event nodes
    j["graph_dispatch_only_us"] = r.g_dispatch_only_us;
    j["graph_forward_us"] = r.g_clean_forward_us;  // F: no event nodes
    j["graph_dispatch_pool_us"] = r.g_dispatch_pool_us;
    const double c = r.g_clean_forward_us - r.g_dispatch_pool_us;
    j["graph_clean_combine_us"] = c;
    j["graph_clean_combine_gbps"] = gbps(r.combine_bytes, c);
    j["graph_clean_dispatch_combine_us"] = r.g_dispatch_only_us + c;
  }
  return j;
}

// The text tables (their numbers, in this order, are what scripts/perf_refresh.py reads from a log).
const RowPrinter& phase_printer() {
  static const RowPrinter printer({{"tokens", "tokens", 8, "%lld"},
                                   {"", "|"},
                                   {"dispatch_us.median", "disp_med", 8, "%.1f"},
                                   {"dispatch_us.min", "disp_min", 8, "%.1f"},
                                   {"dispatch_us.max", "disp_max", 8, "%.1f"},
                                   {"dispatch_gbps", "GB/s", 8, "%.1f"},
                                   {"", "|"},
                                   {"combine_us.median", "comb_med", 8, "%.1f"},
                                   {"combine_us.min", "comb_min", 8, "%.1f"},
                                   {"combine_us.max", "comb_max", 8, "%.1f"},
                                   {"combine_gbps", "GB/s", 8, "%.1f"},
                                   {"", "|"},
                                   {"dispatch_combine_us", "d+c us", 9, "%.1f"},
                                   {"", "|"},
                                   {"nccl_dispatch_us", "nccl_d_us", 10, "%.1f"},
                                   {"nccl_dispatch_gbps", "GB/s", 9, "%.1f"},
                                   {"", "|"},
                                   {"nccl_combine_us", "nccl_c_us", 10, "%.1f"},
                                   {"nccl_combine_gbps", "GB/s", 9, "%.1f"}});
  return printer;
}

const RowPrinter& graph_printer() {
  static const RowPrinter printer({{"tokens", "tokens", 8, "%lld"},
                                   {"", "|"},
                                   {"graph_dispatch_us.median", "disp_med", 8, "%.1f"},
                                   {"graph_dispatch_us.min", "disp_min", 8, "%.1f"},
                                   {"graph_dispatch_us.max", "disp_max", 8, "%.1f"},
                                   {"graph_dispatch_gbps", "GB/s", 8, "%.1f"},
                                   {"", "|"},
                                   {"graph_pool_us", "pool us", 9, "%.1f"},
                                   {"", "|"},
                                   {"graph_combine_us.median", "comb_med", 8, "%.1f"},
                                   {"graph_combine_us.min", "comb_min", 8, "%.1f"},
                                   {"graph_combine_us.max", "comb_max", 8, "%.1f"},
                                   {"graph_combine_gbps", "GB/s", 8, "%.1f"},
                                   {"", "|"},
                                   {"graph_dispatch_combine_us", "d+c us", 9, "%.1f"},
                                   {"", "|"},
                                   {"graph_forward_events_us", "fwd us/N", 10, "%.1f"},
                                   {"", "|"},
                                   {"graph_dispatch_only_us", "disp-only/N", 12, "%.1f"},
                                   {"", "||"},
                                   {"graph_forward_us", "F us/N", 9, "%.1f"},
                                   {"graph_dispatch_pool_us", "DP us/N", 9, "%.1f"},
                                   {"graph_clean_combine_us", "c us", 9, "%.1f"},
                                   {"", "|"},
                                   {"graph_clean_combine_gbps", "c GB/s", 10, "%.1f"},
                                   {"graph_clean_dispatch_combine_us", "d+c us", 9, "%.1f"}});
  return printer;
}

void print_header(const BenchOptions& o, int R) {
  std::printf("# bench-transport: EP%d, hidden=%lld, experts=%lld, top-%lld, dispatch=%s, combine=%s%s (%s), %d iters (each phase a CUDA graph, launched behind a host gate opened after all ranks enqueued); GB/s = bytes rank 0 sends to its peer / time\n",
              R, static_cast<long long>(o.hidden), static_cast<long long>(o.experts), static_cast<long long>(o.top_k),
              o.dispatch.c_str(), o.combine.c_str(), o.owner_reduce ? " owner-reduced" : "",
              o.split_combine ? "combine_send + combine" : "send_and_combine",
              o.iters);
  std::printf("%s\n", phase_printer().header().c_str());
  std::fflush(stdout);
}

void print_graph_table(const std::vector<nlohmann::json>& records) {
  std::printf("# amortised: graph of N back-to-back forwards per rank (dispatch | pool | combine), per-forward phase medians from event nodes (forward 0 excluded), and whole graphs / N\n");
  std::printf("# no-event columns: graphs without event nodes, / N: F = forwards, D = dispatches, DP = dispatch + pool; combine = F - DP, d+c = D + F - DP\n");
  std::printf("%s\n", graph_printer().header().c_str());
  for (const nlohmann::json& r : records) std::printf("%s\n", graph_printer().row(r).c_str());
  std::fflush(stdout);
}

// The keys of the --csv file: every column of both tables, and the byte counts.
std::vector<std::string> transport_csv_keys() {
  std::vector<std::string> keys;
  for (const RowPrinter* p : {&phase_printer(), &graph_printer()})
    for (const Column& c : p->columns())
      if (!c.key.empty() && std::find(keys.begin(), keys.end(), c.key) == keys.end()) keys.push_back(c.key);
  for (const char* k : {"dispatch_bytes", "combine_bytes", "floor_us", "time_over_floor"}) keys.push_back(k);
  return keys;
}

// Runs every point on this process's ranks and prints rank 0's rows; fills `records` with them.
int run_points(const BenchOptions& o, const std::vector<int64_t>& tokens, int R, bool print,
               const std::function<bool(int64_t T, std::vector<PointResult>* res)>& run_point,
               std::vector<nlohmann::json>* records) {
  if (print) print_header(o, R);
  for (int64_t T : tokens) {
    std::vector<PointResult> res;
    if (!run_point(T, &res)) return kExitUnavailable;
    records->push_back(point_record(T, res[0]));
    if (print) {
      std::printf("%s\n", phase_printer().row(records->back()).c_str());
      std::fflush(stdout);
    }
  }
  if (print && o.graph_iters > 0) print_graph_table(*records);
  return kExitOk;
}

// One rank per process, under `megamoe launch`.
int run_launched_transport(const BenchOptions& o, const std::vector<int64_t>& tokens,
                           std::vector<nlohmann::json>* records, bool* printed) {
  NcclBootstrap b;
  Status st = NcclBootstrap::from_env(&b);
  std::shared_ptr<Communicator> comm;
  if (st.is_ok()) st = create_nccl_rank(b, &comm);
  if (!st.is_ok()) throw ToolError(kExitUnavailable, st.to_string());
  NcclRankComm* nccl = nccl_rank_of(comm.get());
  void* flag = nullptr;
  cudaMalloc(&flag, 4);
  cudaStream_t s;
  cudaStreamCreate(&s);
  auto sync = [&] {
    const Status bst = nccl_barrier(nccl->nccl(), flag, s, b.rank, "bench-transport barrier");
    if (!bst) std::fprintf(stderr, "megamoe bench-transport: rank %d: %s\n", b.rank, bst.to_string().c_str());
  };
  *printed = b.rank == 0;
  const int rc = run_points(o, tokens, b.world_size, *printed, [&](int64_t T, std::vector<PointResult>* res) {
    res->resize(1);
    bench_point(o, comm, T, sync, &(*res)[0]);
    if ((*res)[0].error.empty()) return true;
    std::fprintf(stderr, "megamoe bench-transport: rank %d, tokens %lld: %s\n", b.rank, static_cast<long long>(T),
                 (*res)[0].error.c_str());
    return false;
  }, records);
  cudaFree(flag);
  return rc;
}

// One process driving --ranks GPUs, a thread each.
int run_threaded_transport(const BenchOptions& o, const std::vector<int64_t>& tokens,
                           std::vector<nlohmann::json>* records) {
  std::vector<int> devices(o.ranks);
  for (int r = 0; r < o.ranks; ++r) devices[r] = r;
  std::vector<std::shared_ptr<Communicator>> comms;
  const Status st = create_nccl_group(devices, &comms);
  if (!st.is_ok()) throw ToolError(kExitUnavailable, st.to_string());
  ThreadBarrier barrier(o.ranks);
  return run_points(o, tokens, o.ranks, true, [&](int64_t T, std::vector<PointResult>* res) {
    res->assign(o.ranks, PointResult());
    std::vector<std::thread> threads;
    for (int r = 0; r < o.ranks; ++r)
      threads.emplace_back([&, r] { bench_point(o, comms[r], T, [&] { barrier.wait(); }, &(*res)[r]); });
    for (auto& t : threads) t.join();
    for (int r = 0; r < o.ranks; ++r)
      if (!(*res)[r].error.empty()) {
        std::fprintf(stderr, "megamoe bench-transport: rank %d, tokens %lld: %s\n", r, static_cast<long long>(T),
                     (*res)[r].error.c_str());
        return false;
      }
    return true;
  }, records);
}

int run_bench_transport(const BenchOptions& o) {
  const std::vector<int64_t> tokens = parse_int_list_flag("--tokens", o.tokens, 1, 65535);
  std::vector<nlohmann::json> records;
  bool writer = true;
  const bool launched = !env_knobs().rank.empty();
  const int ranks = launched ? std::atoi(env_knobs().world_size.c_str()) : o.ranks;
  const int rc = launched ? run_launched_transport(o, tokens, &records, &writer)
                          : run_threaded_transport(o, tokens, &records);
  if (rc == kExitOk && writer) {
    if (!o.json.empty()) {
      nlohmann::json doc;
      doc["tool"] = "megamoe bench-transport";
      doc["config"] = {{"ranks", ranks},          {"hidden", o.hidden},       {"experts", o.experts},
                       {"top_k", o.top_k},        {"dispatch", o.dispatch},   {"x", o.x_dtype},
                       {"combine", o.combine},    {"owner_reduce", o.owner_reduce},
                       {"split_combine", o.split_combine}, {"combine_groups", o.combine_groups},
                       {"iters", o.iters},        {"warmup", o.warmup},       {"graph_iters", o.graph_iters}};
      doc["rows"] = records;
      write_json_file(o.json, doc);
    }
    if (!o.csv.empty()) write_csv_file(o.csv, transport_csv_keys(), records);
  }
  return rc;
}

}  // namespace

CommandRun add_launch_command(CLI::App* app) {
  auto* launch = app->add_subcommand("launch", "start N processes of a command, one per GPU, as NCCL ranks");
  auto n = std::make_shared<int>(2);
  auto command = std::make_shared<std::vector<std::string>>();
  launch->add_option("-n,--nproc", *n, "number of ranks (processes)")->capture_default_str();
  launch->add_option("command", *command, "the command and its arguments (after --)")->required();
  return [n, command] { return run_launch(*n, *command); };
}

CommandRun add_transport_bench_command(CLI::App* app) {
  auto* bench = app->add_subcommand("bench-transport",
                                   "EP transport dispatch/combine µs and GB/s beside an NCCL all-to-all of the same bytes");
  auto o = std::make_shared<BenchOptions>();
  bench->add_option("--ranks", o->ranks, "GPUs driven by this process (ignored under megamoe launch)")->capture_default_str();
  bench->add_option("--tokens", o->tokens, "tokens per rank, comma-separated")->capture_default_str();
  bench->add_option("--hidden", o->hidden)->capture_default_str();
  bench->add_option("--experts", o->experts)->capture_default_str();
  bench->add_option("--topk", o->top_k)->capture_default_str();
  bench->add_option("--dispatch", o->dispatch, "fp8 | bf16")->check(CLI::IsMember({"fp8", "bf16"}))->capture_default_str();
  bench->add_option("--x", o->x_dtype,
                    "dispatch input: bf16 (quantised by the dispatch kernel for an fp8 wire) or fp8 (1x128 blocks, "
                    "quantised here; the kernel copies codes and scales)")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  bench->add_option("--combine", o->combine, "bf16 | mxfp8 | nvfp4")
      ->check(CLI::IsMember({"bf16", "mxfp8", "nvfp4"}))
      ->capture_default_str();
  bench->add_option("--iters", o->iters)->capture_default_str();
  bench->add_option("--warmup", o->warmup)->capture_default_str();
  bench->add_option("--graph-iters", o->graph_iters,
                    "forwards captured back to back in one graph per rank for the amortised table (0: skip)")
      ->capture_default_str();
  bench->add_option("--graph-reps", o->graph_reps, "timed launches of that graph")->capture_default_str();
  bench->add_option("--combine-groups", o->combine_groups,
                    "recv-row groups of send_and_combine (reduce overlapped with later groups' sends), 1-8; 0: by the "
                    "token count (8 from 6144 tokens, 4 from 2048, else 1)")
      ->check(CLI::Range(0, 8))
      ->capture_default_str();
  bench->add_flag("--owner-reduce", o->owner_reduce,
                  "each owner rank sums its experts' partials of a token and sends one combine row per (token, "
                  "owner rank) instead of one per (token, slot)");
  bench->add_flag("--split-combine", o->split_combine,
                  "combine as two kernels (combine_send, then combine) instead of one send_and_combine kernel");
  bench->add_option("--json", o->json, "write the rows as JSON to F")->type_name("F");
  bench->add_option("--csv", o->csv, "write the rows as CSV to F")->type_name("F");
  return [o] { return run_bench_transport(*o); };
}

}  // namespace megamoe::tool
