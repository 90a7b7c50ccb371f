#include "reference/ep_protocol.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

#include "megamoe/formats.h"

namespace megamoe {
namespace reference {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

char* at_bytes(void* base, const WorkspaceRegion& r) { return static_cast<char*>(base) + r.offset; }

float silu(float g) { return g / (1.0f + std::exp(-g)); }

// ---- The expert FFN (run_experts) ----
//
// Each output value of FC1 and FC2 is the dot product of one pool row x with one weight row w
// (quantisation points 2 and 5):
//   acc = 0.0; for k = 0..K-1: acc += double(x[k]) * double(w[k]);  out = float(acc)
// invariant: every output is computed with exactly these operations in this order, so its bits do
// not depend on tiling, vector width or threads. The kernel computes a tile of kTileRows pool rows
// x kTileCols weight rows at once, one fp64 accumulator per output (the lanes are independent
// sums, never a split reduction). A product of two floats is exact in fp64, so a fused
// multiply-add, where the compiler contracts one, rounds exactly as the separate add does.
constexpr int kTileRows = 8;             // fp64 lanes: pool rows sharing one pass over a weight tile
constexpr int kTileCols = 4;             // weight rows per tile
constexpr int64_t kRowsPerTask = 16;     // pool rows of one expert per work unit

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// The library is built for baseline x86-64 (SSE2); the kernel gets AVX2 and AVX-512 variants too,
// picked at load time. Every variant computes the same bits (see above).
#define MEGAMOE_CPU_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MEGAMOE_CPU_KERNEL
#endif

// Pool rows [num_rows, K] -> tiles of kTileRows rows, k-major: xt[(tile * K + k) * kTileRows + lane]
// (fp64, exact). Lanes past num_rows are zero; their sums are computed and dropped.
void pack_row_tiles(const float* x, int64_t num_rows, int64_t K, double* xt) {
  const int64_t num_tiles = (num_rows + kTileRows - 1) / kTileRows;
  for (int64_t t = 0; t < num_tiles; ++t) {
    double* tile = xt + t * K * kTileRows;
    for (int64_t lane = 0; lane < kTileRows; ++lane) {
      const int64_t m = t * kTileRows + lane;
      if (m < num_rows) {
        const float* xm = x + m * K;
        for (int64_t k = 0; k < K; ++k) tile[k * kTileRows + lane] = static_cast<double>(xm[k]);
      } else {
        for (int64_t k = 0; k < K; ++k) tile[k * kTileRows + lane] = 0.0;
      }
    }
  }
}

// Weight rows [n0, n0 + kCols) against every row tile. wt: scratch [K, kCols] (the weight tile in
// fp64, converted once for all row tiles).
template <int kCols>
__attribute__((always_inline)) inline void weight_tile_dots(const double* xt, int64_t num_rows, const float* w,
                                                             int64_t K, int64_t n0, double* wt, float* const* out_rows) {
  for (int64_t k = 0; k < K; ++k)
    for (int c = 0; c < kCols; ++c) wt[k * kCols + c] = static_cast<double>(w[(n0 + c) * K + k]);
  for (int64_t m0 = 0; m0 < num_rows; m0 += kTileRows) {
    const double* x = xt + m0 * K;
    double acc[kCols][kTileRows] = {};
    for (int64_t k = 0; k < K; ++k) {
      const double* xk = x + k * kTileRows;
      const double* wk = wt + k * kCols;
      for (int c = 0; c < kCols; ++c)
        for (int lane = 0; lane < kTileRows; ++lane) acc[c][lane] += xk[lane] * wk[c];
    }
    const int64_t tile_rows = std::min<int64_t>(kTileRows, num_rows - m0);
    for (int64_t lane = 0; lane < tile_rows; ++lane)
      for (int c = 0; c < kCols; ++c) out_rows[m0 + lane][n0 + c] = static_cast<float>(acc[c][lane]);
  }
}

// out_rows[m][n] = the dot product of x row m and w row n, for m < num_rows, n < N; x packed by
// pack_row_tiles, w [N, K] row-major, wt scratch [K, kTileCols].
MEGAMOE_CPU_KERNEL void rows_times_weights(const double* xt, int64_t num_rows, const float* w, int64_t N, int64_t K,
                                           double* wt, float* const* out_rows) {
  int64_t n0 = 0;
  for (; n0 + kTileCols <= N; n0 += kTileCols) weight_tile_dots<kTileCols>(xt, num_rows, w, K, n0, wt, out_rows);
  for (; n0 < N; ++n0) weight_tile_dots<1>(xt, num_rows, w, K, n0, wt, out_rows);
}

// The pool regions run_experts reads and writes.
struct ExpertPoolView {
  const WorkspaceLayout* layout = nullptr;
  void* base = nullptr;
  bool pow2_scales = false;
  float* fc2_out = nullptr;  // [pool rows, H]

  // Quantisation point 2 (FC1 input): pool row -> fp32 [H].
  void dequantize_x(int64_t row, float* x) const {
    const WorkspaceParams& p = layout->params;
    const int64_t H = p.hidden;
    const char* xr = at_bytes(base, layout->pool_x) + row * H * ws_elem_bytes(p.dispatch_format);
    if (p.dispatch_format == kWsFp8Block) {
      const float* scales = reinterpret_cast<const float*>(at_bytes(base, layout->pool_x_scales)) + row * (H / 128);
      fmt::dequantize_fp8_1x128(reinterpret_cast<const uint8_t*>(xr), scales, H, x);
    } else {
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(xr);
      for (int64_t c = 0; c < H; ++c) x[c] = fmt::bf16_to_float(xb[c]);
    }
  }

  // Quantisation point 4: h [I] -> the intermediate region's row, and its dequantised values hq [I].
  void store_intermediate(int64_t row, const float* h, float* hq) const {
    const WorkspaceParams& p = layout->params;
    const int64_t I = p.intermediate, nb_i = I / 128;
    char* inter = at_bytes(base, layout->intermediate);
    if (p.intermediate_format == kWsFp8Block) {
      uint8_t* q = reinterpret_cast<uint8_t*>(inter) + row * I;
      float* scales = reinterpret_cast<float*>(at_bytes(base, layout->intermediate_scales)) + row * nb_i;
      fmt::quantize_fp8_1x128(h, I, q, scales, pow2_scales);
      fmt::dequantize_fp8_1x128(q, scales, I, hq);
    } else {
      uint16_t* q = reinterpret_cast<uint16_t*>(inter) + row * I;
      for (int64_t i = 0; i < I; ++i) {
        q[i] = fmt::float_to_bf16(h[i]);
        hq[i] = fmt::bf16_to_float(q[i]);
      }
    }
  }
};

// Up to kRowsPerTask real pool rows of one expert: rows[first, first + count).
struct ExpertTask {
  int64_t expert, first, count;
};

// One worker's buffers, sized for a full task.
struct ExpertScratch {
  std::vector<float> x, gate_up, h, hq;  // [rows, H], [rows, 2I], [I], [rows, I]
  std::vector<double> xt, wt;            // packed row tiles [tiles, max(H, I), kTileRows], [max(H, I), kTileCols]
  std::vector<float*> out_rows;          // [rows]
  ExpertScratch(int64_t H, int64_t I)
      : x(kRowsPerTask * H), gate_up(kRowsPerTask * 2 * I), h(I), hq(kRowsPerTask * I),
        xt((kRowsPerTask + kTileRows - 1) / kTileRows * kTileRows * std::max(H, I)),
        wt(std::max(H, I) * kTileCols), out_rows(kRowsPerTask) {}
};

// Quantisation points 2..5 for one task's rows.
void run_expert_task(const ExpertPoolView& pool, const ExpertWeightsF32& weights, const ExpertTask& task,
                     const int32_t* rows, ExpertScratch* s) {
  const int64_t H = pool.layout->params.hidden, I = pool.layout->params.intermediate, m = task.count;
  const float* w13 = weights.w13.data() + task.expert * 2 * I * H;
  const float* w2 = weights.w2.data() + task.expert * H * I;
  const int32_t* task_rows = rows + task.first;
  // FC1: gate_up[r] = [gate (I) | up (I)] of row r.
  for (int64_t r = 0; r < m; ++r) {
    pool.dequantize_x(task_rows[r], s->x.data() + r * H);
    s->out_rows[r] = s->gate_up.data() + r * 2 * I;
  }
  pack_row_tiles(s->x.data(), m, H, s->xt.data());
  rows_times_weights(s->xt.data(), m, w13, 2 * I, H, s->wt.data(), s->out_rows.data());
  // SwiGLU (point 3), then the intermediate (point 4).
  for (int64_t r = 0; r < m; ++r) {
    const float* gate = s->gate_up.data() + r * 2 * I;
    const float* up = gate + I;
    for (int64_t i = 0; i < I; ++i) s->h[i] = silu(gate[i]) * up[i];
    pool.store_intermediate(task_rows[r], s->h.data(), s->hq.data() + r * I);
    s->out_rows[r] = pool.fc2_out + static_cast<int64_t>(task_rows[r]) * H;
  }
  // FC2 (point 5), straight into the rows' fc2_out.
  pack_row_tiles(s->hq.data(), m, I, s->xt.data());
  rows_times_weights(s->xt.data(), m, w2, H, I, s->wt.data(), s->out_rows.data());
}

}  // namespace

const char* stage_name(int32_t stage) {
  switch (stage) {
    case kStageWarmup: return "warmup-exchange";
    case kStageDispatchReady: return "dispatch-ready";
    case kStageDispatchDone: return "dispatch-done";
    case kStageCombineDone: return "combine-done";
    default: return "none";
  }
}

TokenMetaRef meta_row(const WorkspaceLayout& layout, void* base, int64_t recv_row) {
  return TokenMetaRef{reinterpret_cast<uint8_t*>(at_bytes(base, layout.recv_meta)) + recv_row * layout.meta_bytes,
                      layout.params.top_k};
}

Status compute_layout(const WorkspaceLayout& layout, int64_t num_tokens, const int32_t* topk_ids,
                      DispatchPlan* plan) {
  const WorkspaceParams& p = layout.params;
  const int64_t R = p.ep_size, El = p.experts_per_rank, k = p.top_k, E = R * El;
  if (num_tokens < 0 || num_tokens > p.max_tokens_per_rank)
    return invalid_argument("forward argument", "num_tokens", str(num_tokens),
                            "must be in [0, max_tokens_per_rank=" + str(p.max_tokens_per_rank) + "]");
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_ids[t * k + j];
      const std::string field = "topk_ids[" + str(t) + ", " + str(j) + "]";
      if (e < -1 || e >= E)
        return invalid_argument("forward argument", field, str(e),
                                "expert ids must be in [-1, num_experts=" + str(E) + ") (first bad entry: token " +
                                    str(t) + ", slot " + str(j) + ")");
      for (int64_t j2 = 0; j2 < j && e != -1; ++j2) {
        if (topk_ids[t * k + j2] == e)
          return invalid_argument("forward argument", field, str(e),
                                  "the expert ids of one token must be distinct; token " + str(t) + " repeats expert " +
                                      str(e) + " from slot " + str(j2));
      }
    }
  }
  plan->num_tokens = num_tokens;
  plan->rank_token_counts.assign(R, 0);
  plan->expert_counts.assign(E, 0);
  plan->send_row.assign(num_tokens * R, -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_ids[t * k + j];
      if (e < 0) continue;
      ++plan->expert_counts[e];
      const int64_t r = e / El;
      // invariant: one row per (token, destination rank), however many of its experts live there.
      if (plan->send_row[t * R + r] < 0) plan->send_row[t * R + r] = plan->rank_token_counts[r]++;
    }
  }
  return Status::ok();
}

void encode_dispatch_rows(const WorkspaceLayout& layout, bool pow2_scales, const TensorView& x,
                          const TensorView& x_scale, std::vector<uint8_t>* rows, std::vector<float>* scales) {
  const WorkspaceParams& p = layout.params;
  const int64_t H = p.hidden, T = x.ndim == 2 ? x.shape[0] : 0, nb = H / 128;
  const bool fp8_wire = p.dispatch_format == kWsFp8Block;
  const int64_t row_bytes = H * ws_elem_bytes(p.dispatch_format);
  rows->assign(T * row_bytes, 0);
  scales->assign(fp8_wire ? T * nb : 0, 0.0f);
  std::vector<float> buf(H);
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* out = rows->data() + t * row_bytes;
    if (x.dtype == DType::kBFloat16) {
      const uint16_t* in = x.ptr<uint16_t>() + t * H;
      if (fp8_wire) {
        for (int64_t h = 0; h < H; ++h) buf[h] = fmt::bf16_to_float(in[h]);
        fmt::quantize_fp8_1x128(buf.data(), H, out, scales->data() + t * nb, pow2_scales);
      } else {
        std::memcpy(out, in, row_bytes);
      }
    } else {  // e4m3 + x_scale
      const uint8_t* in = x.ptr<uint8_t>() + t * H;
      const float* in_scales = x_scale.ptr<float>() + t * nb;
      if (fp8_wire) {  // passes through unchanged
        std::memcpy(out, in, row_bytes);
        std::memcpy(scales->data() + t * nb, in_scales, nb * sizeof(float));
      } else {
        fmt::dequantize_fp8_1x128(in, in_scales, H, buf.data());
        uint16_t* o = reinterpret_cast<uint16_t*>(out);
        for (int64_t h = 0; h < H; ++h) o[h] = fmt::float_to_bf16(buf[h]);
      }
    }
  }
}

void dispatch(const WorkspaceLayout& layout, int src_rank, const std::vector<void*>& peer_bases,
              const DispatchPlan& plan, const DispatchSource& source) {
  const WorkspaceParams& p = layout.params;
  const int64_t R = p.ep_size, El = p.experts_per_rank, k = p.top_k, H = p.hidden, T_max = p.max_tokens_per_rank;
  const int64_t nb = H / 128;
  const bool fp8_wire = p.dispatch_format == kWsFp8Block;
  const int64_t row_bytes = H * ws_elem_bytes(p.dispatch_format);
  for (int64_t t = 0; t < plan.num_tokens; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      const int32_t i = plan.send_row[t * R + r];
      if (i < 0) continue;
      void* owner = peer_bases[r];
      const int64_t recv_row = src_rank * T_max + i;
      std::memcpy(at_bytes(owner, layout.recv_tokens) + recv_row * row_bytes, source.rows + t * row_bytes, row_bytes);
      if (fp8_wire)
        std::memcpy(reinterpret_cast<float*>(at_bytes(owner, layout.recv_scales)) + recv_row * nb,
                    source.scales + t * nb, nb * sizeof(float));
      TokenMetaRef meta = meta_row(layout, owner, recv_row);
      std::memset(meta.row, 0, layout.meta_bytes);
      meta.src_token() = static_cast<int32_t>(t);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = source.topk_ids[t * k + j];
        const bool here = e >= 0 && e / El == r;
        meta.local_expert(j) = here ? static_cast<int32_t>(e - r * El) : -1;
        meta.weight(j) = here ? source.topk_weights[t * k + j] : 0.0f;
      }
    }
  }
  // Counts last (a GPU writes them with release semantics after the rows), zeros included. The
  // per-expert counts are the owner's to derive from the metadata (build_expert_pool).
  for (int64_t r = 0; r < R; ++r)
    reinterpret_cast<int32_t*>(at_bytes(peer_bases[r], layout.recv_token_counts))[src_rank] = plan.rank_token_counts[r];
}

Status build_expert_pool(const WorkspaceLayout& layout, void* own_base) {
  const WorkspaceParams& p = layout.params;
  const int64_t R = p.ep_size, El = p.experts_per_rank, k = p.top_k, H = p.hidden, T_max = p.max_tokens_per_rank;
  const int64_t BM = p.segment_align, nb = H / 128;
  const bool fp8_wire = p.dispatch_format == kWsFp8Block;
  const int64_t row_bytes = H * ws_elem_bytes(p.dispatch_format);
  const int32_t* token_counts = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.recv_token_counts));
  int32_t* expert_counts = reinterpret_cast<int32_t*>(at_bytes(own_base, layout.recv_expert_counts));

  // recv_expert_counts[s][e]: the rows from source s whose metadata names local expert e.
  std::vector<int64_t> rows_per_expert(El, 0), from_meta(El);
  for (int64_t s = 0; s < R; ++s) {
    if (token_counts[s] < 0 || token_counts[s] > T_max)
      return Status(StatusCode::kInternal, "ep protocol: recv_token_counts[src=" + str(s) + "]=" +
                                               str(token_counts[s]) + " is outside [0, T_max=" + str(T_max) + "]");
    std::fill(from_meta.begin(), from_meta.end(), 0);
    for (int64_t i = 0; i < token_counts[s]; ++i) {
      TokenMetaRef meta = meta_row(layout, own_base, s * T_max + i);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t le = meta.local_expert(j);
        if (le == -1) continue;
        if (le < 0 || le >= El)
          return Status(StatusCode::kInternal, "ep protocol: recv_meta row " + str(s * T_max + i) + " slot " +
                                                   str(j) + " names local expert " + str(le) + " outside [-1, " +
                                                   str(El) + ")");
        ++from_meta[le];
      }
    }
    for (int64_t e = 0; e < El; ++e) {
      expert_counts[s * El + e] = static_cast<int32_t>(from_meta[e]);
      rows_per_expert[e] += from_meta[e];
    }
  }

  int32_t* offsets = reinterpret_cast<int32_t*>(at_bytes(own_base, layout.expert_offsets));
  int64_t total = 0;
  for (int64_t e = 0; e < El; ++e) {
    offsets[e] = static_cast<int32_t>(total);
    total += (rows_per_expert[e] + BM - 1) / BM * BM;
  }
  offsets[El] = static_cast<int32_t>(total);
  if (total > layout.pool_rows)
    return Status(StatusCode::kInternal, "ep protocol: the expert pool needs " + str(total) + " rows but holds " +
                                             str(layout.pool_rows) + " (pool bound broken)");

  int32_t* pool_src = reinterpret_cast<int32_t*>(at_bytes(own_base, layout.pool_src));
  char* pool_x = at_bytes(own_base, layout.pool_x);
  float* pool_scales = reinterpret_cast<float*>(at_bytes(own_base, layout.pool_x_scales));
  const char* recv_tokens = at_bytes(own_base, layout.recv_tokens);
  const float* recv_scales = reinterpret_cast<const float*>(at_bytes(own_base, layout.recv_scales));
  std::vector<int64_t> cursor(El);
  for (int64_t e = 0; e < El; ++e) cursor[e] = offsets[e];
  // Visiting sources, then rows, in order gives each expert's segment the (source, arrival) order.
  for (int64_t s = 0; s < R; ++s) {
    for (int64_t i = 0; i < token_counts[s]; ++i) {
      const int64_t recv_row = s * T_max + i;
      TokenMetaRef meta = meta_row(layout, own_base, recv_row);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t le = meta.local_expert(j);
        if (le < 0) continue;
        const int64_t row = cursor[le]++;
        pool_src[row] = static_cast<int32_t>(recv_row * k + j);
        std::memcpy(pool_x + row * row_bytes, recv_tokens + recv_row * row_bytes, row_bytes);
        if (fp8_wire) std::memcpy(pool_scales + row * nb, recv_scales + recv_row * nb, nb * sizeof(float));
      }
    }
  }
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t row = cursor[e]; row < offsets[e + 1]; ++row) {
      pool_src[row] = -1;
      std::memset(pool_x + row * row_bytes, 0, row_bytes);
      if (fp8_wire) std::memset(pool_scales + row * nb, 0, nb * sizeof(float));
    }
  }
  return Status::ok();
}

void run_experts(const WorkspaceLayout& layout, void* own_base, const ExpertWeightsF32& weights, bool pow2_scales,
                 const ExpertFn& expert_fn, std::vector<float>* fc2_out, int max_workers, int64_t min_fmas_per_worker) {
  const WorkspaceParams& p = layout.params;
  const int64_t El = p.experts_per_rank, H = p.hidden, I = p.intermediate;
  const int32_t* offsets = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.expert_offsets));
  const int32_t* pool_src = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.pool_src));

  fc2_out->assign(static_cast<size_t>(offsets[El]) * H, 0.0f);
  ExpertPoolView pool;
  pool.layout = &layout;
  pool.base = own_base;
  pool.pow2_scales = pow2_scales;
  pool.fc2_out = fc2_out->data();
  if (expert_fn) {  // test hook: serial, the function need not be thread-safe
    std::vector<float> x(H);
    for (int64_t e = 0; e < El; ++e) {
      for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
        if (pool_src[row] < 0) continue;  // padding
        pool.dequantize_x(row, x.data());
        expert_fn(e, x.data(), pool.fc2_out + row * H);
      }
    }
    return;
  }

  // Work units: up to kRowsPerTask real rows of one expert. invariant: every pool row belongs to
  // exactly one unit, so its outputs are computed by one thread in the order stated above whatever
  // the worker count (the result is bitwise independent of threading).
  std::vector<int32_t> rows;
  std::vector<ExpertTask> tasks;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t first = static_cast<int64_t>(rows.size());
    for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row)
      if (pool_src[row] >= 0) rows.push_back(static_cast<int32_t>(row));
    const int64_t count = static_cast<int64_t>(rows.size()) - first;
    for (int64_t i = 0; i < count; i += kRowsPerTask)
      tasks.push_back(ExpertTask{e, first + i, std::min(kRowsPerTask, count - i)});
  }
  if (tasks.empty()) return;

  const int64_t fmas = static_cast<int64_t>(rows.size()) * 3 * H * I;  // FC1 (2I x H) + FC2 (H x I) per row
  int64_t num_workers = std::min<int64_t>(std::max(max_workers, 1), static_cast<int64_t>(tasks.size()));
  if (min_fmas_per_worker > 0) num_workers = std::min(num_workers, std::max<int64_t>(1, fmas / min_fmas_per_worker));

  std::atomic<size_t> next_task{0};
  auto work = [&] {
    ExpertScratch scratch(H, I);
    for (size_t t = next_task++; t < tasks.size(); t = next_task++)
      run_expert_task(pool, weights, tasks[t], rows.data(), &scratch);
  };
  std::vector<std::thread> helpers;
  for (int64_t w = 1; w < num_workers; ++w) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads: the running ones drain the queue
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
}

void encode_combine_row(int32_t combine_format, const float* partial, int64_t hidden, uint8_t* wire) {
  switch (combine_format) {
    case kWsMxfp8:
      fmt::quantize_mxfp8(partial, hidden, wire, wire + hidden);
      return;
    case kWsNvfp4: {
      const float global_scale = fmt::nvfp4_global_scale(fmt::amax_finite(partial, hidden));
      fmt::quantize_nvfp4(partial, hidden, global_scale, wire, wire + hidden / 2);
      std::memcpy(wire + hidden / 2 + hidden / 16, &global_scale, sizeof(float));
      return;
    }
    default: {
      uint16_t* out = reinterpret_cast<uint16_t*>(wire);
      for (int64_t c = 0; c < hidden; ++c) out[c] = fmt::float_to_bf16(partial[c]);
      return;
    }
  }
}

void decode_combine_row(int32_t combine_format, const uint8_t* wire, int64_t hidden, float* out) {
  switch (combine_format) {
    case kWsMxfp8:
      fmt::dequantize_mxfp8(wire, wire + hidden, hidden, out);
      return;
    case kWsNvfp4: {
      float global_scale;
      std::memcpy(&global_scale, wire + hidden / 2 + hidden / 16, sizeof(float));
      fmt::dequantize_nvfp4(wire, wire + hidden / 2, global_scale, hidden, out);
      return;
    }
    default: {
      const uint16_t* in = reinterpret_cast<const uint16_t*>(wire);
      for (int64_t c = 0; c < hidden; ++c) out[c] = fmt::bf16_to_float(in[c]);
      return;
    }
  }
}

namespace {

// The owner reduce's combine_send (quantisation point 7): one row per (received token, this rank),
// the fp32 sum in slot order of the token's local partials.
void send_owner_sums(const WorkspaceLayout& layout, void* own_base, const std::vector<float>& fc2_out,
                     const PeerTargets& peers) {
  const WorkspaceParams& p = layout.params;
  const int64_t R = p.ep_size, El = p.experts_per_rank, k = p.top_k, H = p.hidden, T_max = p.max_tokens_per_rank;
  const int32_t* offsets = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.expert_offsets));
  const int32_t* pool_src = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.pool_src));
  const int32_t* token_counts = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.recv_token_counts));
  // invariant: peers.bases holds every rank's workspace in rank order, this rank's own among them.
  const int64_t me = std::find(peers.bases.begin(), peers.bases.end(), own_base) - peers.bases.begin();
  // pool_src's inverse: the pool row of (recv row, slot), -1 for a slot whose expert is elsewhere.
  std::vector<int32_t> pool_row_of(static_cast<size_t>(R * T_max * k), -1);
  for (int64_t row = 0; row < offsets[El]; ++row)
    if (pool_src[row] >= 0) pool_row_of[pool_src[row]] = static_cast<int32_t>(row);
  std::vector<float> partial(H), acc(H);
  for (int64_t src = 0; src < R; ++src) {
    for (int64_t i = 0; i < token_counts[src]; ++i) {
      const int64_t recv_row = src * T_max + i;
      TokenMetaRef meta = meta_row(layout, own_base, recv_row);
      bool any_local = false;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        if (meta.local_expert(j) == -1) continue;
        any_local = true;
        const float weight = meta.weight(j);
        const float* fc2 = fc2_out.data() + static_cast<int64_t>(pool_row_of[recv_row * k + j]) * H;
        for (int64_t c = 0; c < H; ++c) partial[c] = fmt::mul_rn(weight, fc2[c]);
        // canonical NaN, as the GPU adds give (inf + -inf is 0xFFC00000 on x86): the encoded codes agree
        for (int64_t c = 0; c < H; ++c) acc[c] = fmt::canonicalize_nan(acc[c] + partial[c]);
      }
      if (!any_local) continue;
      const int64_t token = meta.src_token();
      uint8_t* wire = reinterpret_cast<uint8_t*>(at_bytes(peers.bases[src], layout.combine)) +
                      (token * R + me) * layout.wire_row_bytes;
      encode_combine_row(p.combine_format, acc.data(), H, wire);
    }
  }
}

}  // namespace

void combine_send(const WorkspaceLayout& layout, void* own_base, const std::vector<float>& fc2_out,
                  const PeerTargets& peers) {
  const WorkspaceParams& p = layout.params;
  if (p.owner_reduce) {
    send_owner_sums(layout, own_base, fc2_out, peers);
    return;
  }
  const int64_t El = p.experts_per_rank, k = p.top_k, H = p.hidden, T_max = p.max_tokens_per_rank;
  const int32_t* offsets = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.expert_offsets));
  const int32_t* pool_src = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.pool_src));
  std::vector<float> partial(H);
  for (int64_t row = 0; row < offsets[El]; ++row) {
    if (pool_src[row] < 0) continue;
    const int64_t recv_row = pool_src[row] / k, slot = pool_src[row] % k, src = recv_row / T_max;
    TokenMetaRef meta = meta_row(layout, own_base, recv_row);
    const int64_t token = meta.src_token();
    const float weight = meta.weight(slot);
    const float* fc2 = fc2_out.data() + row * H;
    for (int64_t c = 0; c < H; ++c) partial[c] = fmt::mul_rn(weight, fc2[c]);
    if (p.in_kernel_fc2_reduce) {
      std::lock_guard<std::mutex> lock(*peers.y_locks[src]);
      uint16_t* y = peers.y[src] + token * H;
      for (int64_t c = 0; c < H; ++c)
        y[c] = fmt::float_to_bf16(fmt::bf16_to_float(y[c]) + fmt::round_to_bf16(partial[c]));
    } else {
      uint8_t* wire = reinterpret_cast<uint8_t*>(at_bytes(peers.bases[src], layout.combine)) +
                      (token * k + slot) * layout.wire_row_bytes;
      encode_combine_row(p.combine_format, partial.data(), H, wire);
    }
  }
}

void combine_reduce(const WorkspaceLayout& layout, void* own_base, int64_t num_tokens, const int32_t* topk_ids,
                    uint16_t* y) {
  const WorkspaceParams& p = layout.params;
  const int64_t k = p.top_k, H = p.hidden;
  const uint8_t* combine = reinterpret_cast<const uint8_t*>(at_bytes(own_base, layout.combine));
  std::vector<float> acc(H), part(H);
  if (p.owner_reduce) {  // one row per (token, owner rank), summed in rank order
    const int64_t R = p.ep_size, El = p.experts_per_rank;
    std::vector<char> owns(R);
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::fill(owns.begin(), owns.end(), 0);
      for (int64_t j = 0; j < k; ++j)
        if (topk_ids[t * k + j] != -1) owns[topk_ids[t * k + j] / El] = 1;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t r = 0; r < R; ++r) {
        if (!owns[r]) continue;  // that row was never written this forward
        decode_combine_row(p.combine_format, combine + (t * R + r) * layout.wire_row_bytes, H, part.data());
        for (int64_t c = 0; c < H; ++c) acc[c] += part[c];
      }
      for (int64_t c = 0; c < H; ++c) y[t * H + c] = fmt::float_to_bf16(acc[c]);
    }
    return;
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      if (topk_ids[t * k + j] == -1) continue;  // that row was never written this forward
      decode_combine_row(p.combine_format, combine + (t * k + j) * layout.wire_row_bytes, H, part.data());
      for (int64_t c = 0; c < H; ++c) acc[c] += part[c];
    }
    for (int64_t c = 0; c < H; ++c) y[t * H + c] = fmt::float_to_bf16(acc[c]);
  }
}

void zero_output(int64_t num_tokens, int64_t hidden, uint16_t* y) {
  if (num_tokens > 0) std::memset(y, 0, static_cast<size_t>(num_tokens * hidden) * sizeof(uint16_t));
}

void poison_workspace(const WorkspaceLayout& layout, void* base) {
  std::memset(base, 0xFF, static_cast<size_t>(layout.total_bytes));
  for (const WorkspaceRegion* r :
       {&layout.signals, &layout.error_cell, &layout.recv_token_counts, &layout.recv_expert_counts})
    std::memset(at_bytes(base, *r), 0, static_cast<size_t>(r->bytes));
}

}  // namespace reference
}  // namespace megamoe
