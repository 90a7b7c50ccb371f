// megamoe launch / bench-transport (see transport_cmd.h).
#include "transport_cmd.h"

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

#include "comm/nccl_comm.h"
#include "core/env.h"
#include "kernels/transport/ep_transport.h"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "ranks.h"

namespace megamoe::tool {
namespace {

int g_exit_code = -1;

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
  std::vector<int64_t> tokens = {1, 8, 128, 512, 1024, 4096, 8192};
  int64_t hidden = 7168, experts = 256, top_k = 8;
  std::string dispatch = "fp8", combine = "bf16";
  std::string x_dtype = "bf16";  // dispatch input: bf16 (quantised in the kernel for an fp8 wire) or fp8 + scales
  int iters = 30, warmup = 5;
  int graph_iters = 32, graph_reps = 5;  // back-to-back forwards per graph, graph launches timed
  bool split_combine = false;            // combine_send + combine (two kernels) instead of send_and_combine
  int combine_groups = 0;                // EpTransportOptions::combine_groups
  bool owner_reduce = false;             // WorkspaceParams::owner_reduce: one combine row per (token, owner)
  uint32_t seed = 1;
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

struct Stats {
  double med = 0, min = 0, max = 0;
};
Stats stats_of(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.med = v[v.size() / 2];
  s.min = v.front();
  s.max = v.back();
  return s;
}

struct PointResult {
  Stats dispatch, combine, total, nccl_dispatch, nccl_combine;
  // Back-to-back forwards in one graph per rank (launch skew amortised over graph_iters forwards):
  // per-forward phase medians from event nodes, and whole-graph µs per forward / per dispatch.
  Stats g_dispatch, g_pool, g_combine;
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

// One rank's run of one point. `sync` is a host barrier across ranks (threads or processes).
// The combine phase: one kernel (send_and_combine), or with --split-combine the two-kernel path that
// backends whose FC2 epilogue writes the wire rows use (combine_send here standing in for it).
Status combine_phase(const BenchOptions& o, EpTransport* tr, const TensorView& out, const TensorView& ids,
                     const TensorView& y, cudaStream_t stream) {
  if (!o.split_combine) return tr->send_and_combine(out, ids, y, stream);
  MEGAMOE_RETURN_IF_ERROR(tr->combine_send(out, stream));
  return tr->combine(ids, y, stream);
}

void bench_point(const BenchOptions& o, std::shared_ptr<Communicator> comm, int64_t T,
                 const std::function<void()>& sync, bool /*host_barrier*/, PointResult* res) {
  NcclRankComm* nccl = nccl_rank_of(comm.get());
  const int rank = comm->rank(), R = comm->size();
  MEGAMOE_RANK_CUDA(cudaSetDevice(nccl->device()));
  EpTransportOptions opt;
  WorkspaceParams& p = opt.params;
  p.ep_size = R;
  p.experts_per_rank = o.experts / R;
  p.top_k = o.top_k;
  p.hidden = o.hidden;
  p.intermediate = 128;
  p.max_tokens_per_rank = T;
  opt.combine_groups = o.combine_groups;
  p.dispatch_format = o.dispatch == "bf16" ? kWsBf16 : kWsFp8Block;
  p.intermediate_format = kWsBf16;
  p.combine_format = o.combine == "mxfp8" ? kWsMxfp8 : o.combine == "nvfp4" ? kWsNvfp4 : kWsBf16;
  p.owner_reduce = o.owner_reduce ? 1 : 0;
  std::unique_ptr<EpTransport> tr;
  BENCH_CHECK(EpTransport::create(comm, opt, &tr));
  cudaStream_t stream;
  MEGAMOE_RANK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BENCH_CHECK(tr->warmup(stream));
  const WorkspaceLayout& l = tr->layout();
  const int64_t H = o.hidden, k = o.top_k, El = p.experts_per_rank;

  // Inputs: random bf16 x and routing (every rank derives every rank's routing: bytes per direction).
  std::vector<RankRouting> routing;
  for (int r = 0; r < R; ++r) routing.push_back(make_routing(o, r, T));
  std::vector<uint16_t> x(T * H);
  uint32_t lcg = 12345u + rank;
  for (auto& v : x) {
    lcg = lcg * 1664525u + 1013904223u;
    v = fmt::float_to_bf16((static_cast<int32_t>(lcg >> 8) - (1 << 23)) * (1.f / (1 << 22)));
  }
  // An fp8 input: x quantised here (1x128 blocks), the kernel copies codes and scales.
  const bool x_fp8 = o.x_dtype == "fp8";
  std::vector<uint8_t> xq;
  std::vector<float> xs;
  if (x_fp8) {
    xq.resize(T * H);
    xs.resize(T * H / 128);
    std::vector<float> row(H);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < H; ++i) row[i] = fmt::bf16_to_float(x[t * H + i]);
      fmt::quantize_fp8_1x128(row.data(), H, &xq[t * H], &xs[t * H / 128], false);
    }
  }
  void *dx, *dxs = nullptr, *dids, *dw, *dy, *dout, *a2a_send, *a2a_recv;
  const int64_t row_bytes = H * ws_elem_bytes(p.dispatch_format) +
                            (p.dispatch_format == kWsFp8Block ? H / 128 * 4 : 0) + l.meta_bytes;
  // Bytes rank `src` sends to rank `dst`: dispatch rows, and the combine rows `dst` sends back to `src`.
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
  std::vector<size_t> disp_send(R), disp_recv(R), comb_send(R), comb_recv(R);
  for (int q = 0; q < R; ++q) {
    disp_send[q] = q == rank ? 0 : tokens_to(rank, q) * row_bytes;
    disp_recv[q] = q == rank ? 0 : tokens_to(q, rank) * row_bytes;
    // I own, q is the source: a row per (token, slot), or with the owner reduce per token
    comb_send[q] = q == rank ? 0 : (o.owner_reduce ? tokens_to(q, rank) : pairs_to(q, rank)) * l.wire_row_bytes;
    comb_recv[q] = q == rank ? 0 : (o.owner_reduce ? tokens_to(rank, q) : pairs_to(rank, q)) * l.wire_row_bytes;
  }
  size_t max_a2a = 16;
  for (int q = 0; q < R; ++q) max_a2a = std::max({max_a2a, disp_send[q], disp_recv[q], comb_send[q], comb_recv[q]});
  MEGAMOE_RANK_CUDA(cudaMalloc(&dx, std::max<int64_t>(T * H * 2, 16)));
  MEGAMOE_RANK_CUDA(cudaMalloc(&dids, std::max<int64_t>(T * k * 4, 16)));
  MEGAMOE_RANK_CUDA(cudaMalloc(&dw, std::max<int64_t>(T * k * 4, 16)));
  MEGAMOE_RANK_CUDA(cudaMalloc(&dy, std::max<int64_t>(T * H * 2, 16)));
  MEGAMOE_RANK_CUDA(cudaMalloc(&dout, std::max<int64_t>(l.pool_rows * H * 2, 16)));
  MEGAMOE_RANK_CUDA(cudaMalloc(&a2a_send, max_a2a * R));
  MEGAMOE_RANK_CUDA(cudaMalloc(&a2a_recv, max_a2a * R));
  if (x_fp8) {
    MEGAMOE_RANK_CUDA(cudaMalloc(&dxs, std::max<int64_t>(T * H / 128 * 4, 16)));
    MEGAMOE_RANK_CUDA(cudaMemcpy(dx, xq.data(), T * H, cudaMemcpyHostToDevice));
    MEGAMOE_RANK_CUDA(cudaMemcpy(dxs, xs.data(), T * H / 128 * 4, cudaMemcpyHostToDevice));
  } else {
    MEGAMOE_RANK_CUDA(cudaMemcpy(dx, x.data(), T * H * 2, cudaMemcpyHostToDevice));
  }
  MEGAMOE_RANK_CUDA(cudaMemcpy(dids, routing[rank].ids.data(), T * k * 4, cudaMemcpyHostToDevice));
  MEGAMOE_RANK_CUDA(cudaMemcpy(dw, routing[rank].weights.data(), T * k * 4, cudaMemcpyHostToDevice));
  MEGAMOE_RANK_CUDA(cudaMemset(dout, 0x3C, l.pool_rows * H * 2));  // FC2 stand-in (values do not change bytes)
  const Device dev = Device::cuda(nccl->device());
  const TensorView vx(dx, x_fp8 ? DType::kFloat8E4M3 : DType::kBFloat16, {T, H}, dev),
      vxs(dxs, DType::kFloat32, {T, H / 128}, dev), vids(dids, DType::kInt32, {T, k}, dev),
      vw(dw, DType::kFloat32, {T, k}, dev), vy(dy, DType::kBFloat16, {T, H}, dev),
      vout(dout, DType::kBFloat16, {l.pool_rows, H}, dev);

  cudaEvent_t ev[4];
  for (auto& e : ev) MEGAMOE_RANK_CUDA(cudaEventCreate(&e));
  // The three phases of one forward, each a CUDA graph: dispatch | expert pool | combine (send + reduce).
  cudaGraph_t graphs[3];
  cudaGraphExec_t execs[3];
  for (int phase = 0; phase < 3; ++phase) {
    MEGAMOE_RANK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    Status cap;
    if (phase == 0) cap = tr->dispatch(vx, x_fp8 ? vxs : TensorView(), vids, vw, stream);
    if (phase == 1) cap = tr->build_expert_pool(stream);
    if (phase == 2) {
      cap = combine_phase(o, tr.get(), vout, vids, vy, stream);
    }
    MEGAMOE_RANK_CUDA(cudaStreamEndCapture(stream, &graphs[phase]));
    BENCH_CHECK(cap);
    MEGAMOE_RANK_CUDA(cudaGraphInstantiate(&execs[phase], graphs[phase], 0));
  }

  auto a2a = [&](const std::vector<size_t>& send, const std::vector<size_t>& recv) {
    ncclGroupStart();
    for (int q = 0; q < R; ++q) {
      if (send[q]) ncclSend(static_cast<char*>(a2a_send) + q * max_a2a, send[q], ncclUint8, q, nccl->nccl(), stream);
      if (recv[q]) ncclRecv(static_cast<char*>(a2a_recv) + q * max_a2a, recv[q], ncclUint8, q, nccl->nccl(), stream);
    }
    return ncclGroupEnd();
  };
  // The stream waits on a host gate while the timed work is enqueued; the gate opens after every rank
  // has enqueued (barrier), so neither host launch latency nor rank skew lands inside the events.
  std::atomic<int> gate{0};
  // Bounded (2 s): a gate that never opens must not hang the benchmark.
  auto hold = [](void* g) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (static_cast<std::atomic<int>*>(g)->load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() < until) {
    }
  };
  std::vector<double> td, tc, tt, nd, nc;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    gate.store(0);
    MEGAMOE_RANK_CUDA(cudaLaunchHostFunc(stream, hold, &gate));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[0], stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(execs[0], stream));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[1], stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(execs[1], stream));
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[2], stream));
    MEGAMOE_RANK_CUDA(cudaGraphLaunch(execs[2], stream));
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
    if (a2a(disp_send, disp_recv) != ncclSuccess) {
      res->error = "ncclSend/ncclRecv failed";
      return;
    }
    MEGAMOE_RANK_CUDA(cudaEventRecord(ev[1], stream));
    if (a2a(comb_send, comb_recv) != ncclSuccess) {
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
  BENCH_CHECK(tr->check_error(stream));

  // Amortised: N forwards back to back in one graph per rank, and N dispatches back to back; every
  // rank launches its graph right after a host barrier, so the launch skew between ranks is paid once
  // per N forwards. Event nodes around each phase give per-forward phase times.
  if (o.graph_iters > 0) {
    const int N = o.graph_iters;
    std::vector<cudaEvent_t> pe(4 * N);
    for (auto& e : pe) MEGAMOE_RANK_CUDA(cudaEventCreate(&e));
    cudaGraph_t gf = nullptr, gd = nullptr;
    cudaGraphExec_t xf = nullptr, xd = nullptr;
    MEGAMOE_RANK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    Status cap;
    // External event nodes: they record timestamps when the graph runs (plain captured events do not).
    for (int i = 0; i < N && cap.is_ok(); ++i) {
      cudaEventRecordWithFlags(pe[4 * i], stream, cudaEventRecordExternal);
      cap = tr->dispatch(vx, x_fp8 ? vxs : TensorView(), vids, vw, stream);
      cudaEventRecordWithFlags(pe[4 * i + 1], stream, cudaEventRecordExternal);
      if (cap.is_ok()) cap = tr->build_expert_pool(stream);
      cudaEventRecordWithFlags(pe[4 * i + 2], stream, cudaEventRecordExternal);
      if (cap.is_ok()) cap = combine_phase(o, tr.get(), vout, vids, vy, stream);
      cudaEventRecordWithFlags(pe[4 * i + 3], stream, cudaEventRecordExternal);
    }
    MEGAMOE_RANK_CUDA(cudaStreamEndCapture(stream, &gf));
    BENCH_CHECK(cap);
    MEGAMOE_RANK_CUDA(cudaGraphInstantiate(&xf, gf, 0));
    MEGAMOE_RANK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < N && cap.is_ok(); ++i) cap = tr->dispatch(vx, x_fp8 ? vxs : TensorView(), vids, vw, stream);
    MEGAMOE_RANK_CUDA(cudaStreamEndCapture(stream, &gd));
    BENCH_CHECK(cap);
    MEGAMOE_RANK_CUDA(cudaGraphInstantiate(&xd, gd, 0));
    // Without event nodes: N forwards, and N x (dispatch + pool build).
    cudaGraph_t gc = nullptr, gdp = nullptr;
    cudaGraphExec_t xc = nullptr, xdp = nullptr;
    for (int which = 0; which < 2; ++which) {
      MEGAMOE_RANK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < N && cap.is_ok(); ++i) {
        cap = tr->dispatch(vx, x_fp8 ? vxs : TensorView(), vids, vw, stream);
        if (cap.is_ok()) cap = tr->build_expert_pool(stream);
        if (cap.is_ok() && which == 0) cap = combine_phase(o, tr.get(), vout, vids, vy, stream);
      }
      MEGAMOE_RANK_CUDA(cudaStreamEndCapture(stream, which == 0 ? &gc : &gdp));
      BENCH_CHECK(cap);
      MEGAMOE_RANK_CUDA(cudaGraphInstantiate(which == 0 ? &xc : &xdp, which == 0 ? gc : gdp, 0));
    }
    std::vector<double> fwd, disp_only, clean_fwd, disp_pool, gdisp, gpool, gcomb;
    // One graph launched right after a host barrier; µs per forward (the barrier's skew paid once).
    auto time_graph = [&](cudaGraphExec_t x, std::vector<double>* out) -> bool {
      sync();
      if (cudaEventRecord(ev[0], stream) != cudaSuccess || cudaGraphLaunch(x, stream) != cudaSuccess ||
          cudaEventRecord(ev[1], stream) != cudaSuccess || cudaStreamSynchronize(stream) != cudaSuccess)
        return false;
      float ms = 0;
      if (cudaEventElapsedTime(&ms, ev[0], ev[1]) != cudaSuccess) return false;
      out->push_back(ms * 1e3 / N);
      return true;
    };
    for (int rep = 0; rep < o.graph_reps + 1; ++rep) {  // the first rep warms up
      if (!time_graph(xf, &fwd) || !time_graph(xd, &disp_only) || !time_graph(xc, &clean_fwd) ||
          !time_graph(xdp, &disp_pool)) {
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
    BENCH_CHECK(tr->check_error(stream));
    res->g_forward_us = stats_of(fwd).med;
    res->g_dispatch_only_us = stats_of(disp_only).med;
    res->g_clean_forward_us = stats_of(clean_fwd).med;
    res->g_dispatch_pool_us = stats_of(disp_pool).med;
    res->g_dispatch = stats_of(gdisp);
    res->g_pool = stats_of(gpool);
    res->g_combine = stats_of(gcomb);
    cudaGraphExecDestroy(xf);
    cudaGraphExecDestroy(xd);
    cudaGraphExecDestroy(xc);
    cudaGraphExecDestroy(xdp);
    cudaGraphDestroy(gf);
    cudaGraphDestroy(gd);
    cudaGraphDestroy(gc);
    cudaGraphDestroy(gdp);
    for (auto& e : pe) cudaEventDestroy(e);
  }

  res->dispatch = stats_of(td);
  res->combine = stats_of(tc);
  res->total = stats_of(tt);
  res->nccl_dispatch = stats_of(nd);
  res->nccl_combine = stats_of(nc);
  res->dispatch_bytes = static_cast<double>(*std::max_element(disp_send.begin(), disp_send.end()));
  res->combine_bytes = static_cast<double>(*std::max_element(comb_send.begin(), comb_send.end()));
  for (int phase = 0; phase < 3; ++phase) {
    cudaGraphExecDestroy(execs[phase]);
    cudaGraphDestroy(graphs[phase]);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  for (void* q : {dx, dxs, dids, dw, dy, dout, a2a_send, a2a_recv}) cudaFree(q);
  sync();
  tr.reset();  // collective release
  cudaStreamDestroy(stream);
}

void print_header(const BenchOptions& o, int R) {
  std::printf("# bench-transport: EP%d, hidden=%lld, experts=%lld, top-%lld, dispatch=%s, combine=%s%s (%s), %d iters (each phase a CUDA graph, launched behind a host gate opened after all ranks enqueued); GB/s = bytes rank 0 sends to its peer / time\n",
              R, static_cast<long long>(o.hidden), static_cast<long long>(o.experts), static_cast<long long>(o.top_k),
              o.dispatch.c_str(), o.combine.c_str(), o.owner_reduce ? " owner-reduced" : "",
              o.split_combine ? "combine_send + combine" : "send_and_combine",
              o.iters);
  std::fflush(stdout);
  std::printf("%8s | %26s %8s | %26s %8s | %9s | %20s | %20s\n", "tokens", "dispatch us med/min/max", "GB/s",
              "combine us med/min/max", "GB/s", "d+c us", "nccl a2a disp us GB/s", "nccl a2a comb us GB/s");
}

void print_graph_header() {
  std::printf("# amortised: graph of N back-to-back forwards per rank (dispatch | pool | combine), per-forward phase medians from event nodes (forward 0 excluded), and whole graphs / N\n");
  std::printf("# no-event columns: graphs without event nodes, / N: F = forwards, D = dispatches, DP = dispatch + pool; combine = F - DP, d+c = D + F - DP\n");
  std::printf("%8s | %26s %8s | %9s | %26s %8s | %9s | %10s | %12s || %9s %9s %9s | %10s %9s\n", "tokens",
              "dispatch us med/min/max", "GB/s", "pool us", "combine us med/min/max", "GB/s", "d+c us", "fwd us/N",
              "disp-only us/N", "F us/N", "DP us/N", "c us", "c GB/s", "d+c us");
  std::fflush(stdout);
}

void print_graph_row(int64_t T, const PointResult& r) {
  auto gbs = [](double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; };
  const double c = r.g_clean_forward_us - r.g_dispatch_pool_us;
  std::printf("%8lld | %8.1f %8.1f %8.1f %8.1f | %9.1f | %8.1f %8.1f %8.1f %8.1f | %9.1f | %10.1f | %12.1f || %9.1f %9.1f %9.1f | %10.1f %9.1f\n",
              static_cast<long long>(T), r.g_dispatch.med, r.g_dispatch.min, r.g_dispatch.max,
              gbs(r.dispatch_bytes, r.g_dispatch.med), r.g_pool.med, r.g_combine.med, r.g_combine.min,
              r.g_combine.max, gbs(r.combine_bytes, r.g_combine.med), r.g_dispatch.med + r.g_combine.med,
              r.g_forward_us, r.g_dispatch_only_us, r.g_clean_forward_us, r.g_dispatch_pool_us, c,
              gbs(r.combine_bytes, c), r.g_dispatch_only_us + c);
  std::fflush(stdout);
}

void print_row(int64_t T, const PointResult& r) {
  auto gbs = [](double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; };
  std::printf("%8lld | %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f %8.1f | %9.1f | %10.1f %9.1f | %10.1f %9.1f\n",
              static_cast<long long>(T), r.dispatch.med, r.dispatch.min, r.dispatch.max, gbs(r.dispatch_bytes, r.dispatch.med),
              r.combine.med, r.combine.min, r.combine.max, gbs(r.combine_bytes, r.combine.med), r.total.med,
              r.nccl_dispatch.med, gbs(r.dispatch_bytes, r.nccl_dispatch.med), r.nccl_combine.med,
              gbs(r.combine_bytes, r.nccl_combine.med));
  std::fflush(stdout);
}

int run_bench_transport(const BenchOptions& o) {
  if (!env_knobs().rank.empty()) {  // one rank per process, under `megamoe launch`
    NcclBootstrap b;
    Status st = NcclBootstrap::from_env(&b);
    std::shared_ptr<Communicator> comm;
    if (st.is_ok()) st = create_nccl_rank(b, &comm);
    if (!st.is_ok()) {
      std::fprintf(stderr, "megamoe bench-transport: error: %s\n", st.to_string().c_str());
      return 3;
    }
    NcclRankComm* nccl = nccl_rank_of(comm.get());
    void* flag = nullptr;
    cudaMalloc(&flag, 4);
    cudaStream_t s;
    cudaStreamCreate(&s);
    auto sync = [&] {
      const Status st = nccl_barrier(nccl->nccl(), flag, s, b.rank, "bench-transport barrier");
      if (!st) std::fprintf(stderr, "megamoe bench-transport: rank %d: %s\n", b.rank, st.to_string().c_str());
    };
    if (b.rank == 0) print_header(o, b.world_size);
    int rc = 0;
    std::vector<std::pair<int64_t, PointResult>> rows;
    for (int64_t T : o.tokens) {
      PointResult r;
      bench_point(o, comm, T, sync, false, &r);
      if (!r.error.empty()) {
        std::fprintf(stderr, "megamoe bench-transport: rank %d, tokens %lld: %s\n", b.rank, static_cast<long long>(T),
                     r.error.c_str());
        rc = 3;
        break;
      }
      if (b.rank == 0) print_row(T, r);
      rows.emplace_back(T, r);
    }
    if (b.rank == 0 && rc == 0 && o.graph_iters > 0) {
      print_graph_header();
      for (const auto& [T, r] : rows) print_graph_row(T, r);
    }
    cudaFree(flag);
    return rc;
  }
  std::vector<int> devices(o.ranks);
  for (int r = 0; r < o.ranks; ++r) devices[r] = r;
  std::vector<std::shared_ptr<Communicator>> comms;
  const Status st = create_nccl_group(devices, &comms);
  if (!st.is_ok()) {
    std::fprintf(stderr, "megamoe bench-transport: error: %s\n", st.to_string().c_str());
    return 3;
  }
  print_header(o, o.ranks);
  ThreadBarrier barrier(o.ranks);
  std::vector<std::pair<int64_t, PointResult>> rows;
  for (int64_t T : o.tokens) {
    std::vector<PointResult> res(o.ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < o.ranks; ++r)
      threads.emplace_back([&, r] { bench_point(o, comms[r], T, [&] { barrier.wait(); }, true, &res[r]); });
    for (auto& t : threads) t.join();
    for (int r = 0; r < o.ranks; ++r)
      if (!res[r].error.empty()) {
        std::fprintf(stderr, "megamoe bench-transport: rank %d, tokens %lld: %s\n", r, static_cast<long long>(T),
                     res[r].error.c_str());
        return 3;
      }
    print_row(T, res[0]);
    rows.emplace_back(T, res[0]);
  }
  if (o.graph_iters > 0) {
    print_graph_header();
    for (const auto& [T, r] : rows) print_graph_row(T, r);
  }
  return 0;
}

}  // namespace

void register_transport_commands(CLI::App& app) {
  auto* launch = app.add_subcommand("launch", "start N processes of a command, one per GPU, as NCCL ranks");
  auto n = std::make_shared<int>(2);
  auto command = std::make_shared<std::vector<std::string>>();
  launch->add_option("-n,--nproc", *n, "number of ranks (processes)")->capture_default_str();
  launch->add_option("command", *command, "the command and its arguments (after --)")->required();
  launch->callback([n, command] { g_exit_code = run_launch(*n, *command); });

  auto* bench = app.add_subcommand("bench-transport",
                                   "EP transport dispatch/combine µs and GB/s beside an NCCL all-to-all of the same bytes");
  auto o = std::make_shared<BenchOptions>();
  bench->add_option("--ranks", o->ranks, "GPUs driven by this process (ignored under megamoe launch)")->capture_default_str();
  bench->add_option("--tokens", o->tokens, "tokens per rank, a list")->delimiter(',');
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
  bench->callback([o] { g_exit_code = run_bench_transport(*o); });
}

bool transport_command_result(int* exit_code) {
  if (g_exit_code < 0) return false;
  if (exit_code) *exit_code = g_exit_code;
  return true;
}

}  // namespace megamoe::tool
