// The EP dispatch/combine protocol as plain host functions over the symmetric workspace.
//
// Each stage is a function of (WorkspaceLayout, own base, peer bases) and is testable on its own.
// The cpu backend runs them in order, with a group barrier between stages; the GPU paths implement
// the same stages in kernels and are held to the same bytes in every region.
//
//   stage            runs on   reads                         writes
//   compute_layout   source    topk_ids                      DispatchPlan (host)
//   dispatch         source    wire rows, topk ids/weights   owner's recv_tokens/scales/meta,
//                                                            recv_token_counts[src]
//   -- barrier "dispatch-done" --
//   build_expert_pool owner    recv_*                        recv_expert_counts, expert_offsets, pool_src,
//                                                            pool_x(_scales)
//   run_experts      owner     pool_*                        intermediate(_scales), FC2 output (host)
//   combine_send     owner     FC2 output, recv_meta         source's combine rows, or source's y
//   -- barrier "combine-done" --
//   combine_reduce   source    own combine rows              y
//
// Quantisation points (every GPU path must match them bit for bit where stated):
//   1. dispatch wire. fp8-block: a bf16 x row is widened to fp32 and quantised with
//      fmt::quantize_fp8_1x128 (e4m3, one fp32 scale per 128 values; power-of-two scales when
//      config.pow2_scales). An e4m3 x with x_scale goes on the wire unchanged. bf16: a bf16 x row goes
//      unchanged; an e4m3 x is dequantised (code * scale, fp32) and rounded to bf16 (RNE).
//   2. FC1 input: the wire row dequantised to fp32 (fmt::dequantize_fp8_1x128, or bf16 -> fp32).
//      FC1 weights: QuantizedTensor::dequantize of the prepared w13 (exact fp32 values).
//      gate/up = dot products accumulated in fp64, then rounded once to fp32.
//   3. SwiGLU in fp32: h = silu(gate) * up, silu(g) = g / (1 + expf(-g)).
//   4. FC2 input: h requantised with fmt::quantize_fp8_1x128 (pow2 per config) when
//      config.intermediate_format() is fp8-block, else rounded to bf16 (RNE); stored in the
//      intermediate region, and the dequantised values are what FC2 multiplies.
//   5. FC2: dot products of dequantised h with the prepared w2, accumulated in fp64, rounded to fp32.
//   6. partial = topk_weight * fc2_out, one fp32 multiply.
//   7. combine wire (combine_row_bytes() layout): bf16 (RNE) | mxfp8: H e4m3 then H/32 e8m0
//      (fmt::quantize_mxfp8) | nvfp4: H/2 packed e2m1, then H/16 e4m3 scales, then one fp32 global
//      scale = fmt::nvfp4_global_scale(fmt::amax_finite(row)) (fmt::quantize_nvfp4).
//      In-kernel FC2 reduce (bf16 only): the partial is rounded to bf16, then added into the source's
//      bf16 y under the destination's lock: y = bf16(float(y) + float(bf16(partial))) — one rounding
//      per add, as red.add.bf16x2 does; the order of adds is arrival order (not reproducible).
//      Owner reduce (config.owner_reduce): the owner `me` sums a received token's local partials
//      first, acc = +0.0f; for j = 0..k-1 with local_expert[j] != -1: acc = acc + partial_j (fp32,
//      slot order), and encodes acc as above into the source's row src_token*R + me: the wire rounds
//      one sum per owner rank instead of one partial per slot.
//   8. combine reduce: acc = +0.0f; for j = 0..k-1 with topk_ids[t, j] != -1: acc += decoded row
//      t*k+j (fp32 adds, slot order); y = bf16(acc) (RNE). A token with no slots gets +0.
//      Owner reduce: acc = +0.0f; for r = 0..R-1 owning at least one of the token's experts
//      (topk_ids[t, j] / E_l == r for some j with topk_ids[t, j] != -1): acc += decoded row t*R+r
//      (fp32 adds, rank order); y = bf16(acc) (RNE). A token with no slots gets +0.
//
// Row and ordering rules:
//   - A token is written once per destination rank that owns at least one of its experts, at row
//     src*T_max + i, i = its rank among this source's tokens sent to that destination, in token order.
//   - Combine rows of source token t: t*k+j for slot j, or t*R+r for owner rank r with the owner
//     reduce; a row of a slot dropped (-1) or of a rank owning none of the token's experts is never
//     written and never read.
//   - recv_meta row: src_token, local_expert[k] (the slot's expert minus the owner's first expert, or
//     -1 when that slot's expert is elsewhere or is -1), weight[k] (the slot's routing weight where
//     local_expert != -1, else 0), zero padding.
//   - recv_token_counts[src] is written by every source to every destination each forward, zeros
//     included (a rank with 0 tokens still signals). recv_expert_counts[src][e] (rows from src whose
//     metadata names local expert e) is the owner's own, derived from the metadata by the pool build:
//     sending it would repeat what the metadata rows say, and on a GPU it would need the whole
//     source grid's sum before the dispatch could signal.
//   - Expert pool: rows expert-major, ordered by (local expert, source rank, arrival row); each
//     expert's segment starts at expert_offsets[e] (a multiple of segment_align) and is padded with rows
//     whose pool_src = -1 and whose pool_x bytes (and scales) are zero. pool_src = recv_row*k + slot.
//   - The expert ids of one token must be distinct (a router's top-k is); repeats are refused, since
//     they would overflow the pool bound R*T_max*min(k, E_l).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/status.h"
#include "megamoe/tensor.h"
#include "megamoe/workspace.h"

namespace megamoe {
namespace reference {

// Stage ids recorded in the workspace error cell (WaitError::stage).
enum ProtocolStage : int32_t {
  kStageNone = 0,
  kStageWarmup = 1,         // workspace base exchange
  kStageDispatchReady = 2,  // every rank entered forward (and published y)
  kStageDispatchDone = 3,   // every rank's tokens are in its owners' receive regions
  kStageCombineDone = 4,    // every partial is in its source's combine rows (or y)
};
const char* stage_name(int32_t stage);

// One recv_meta row (layout.meta_bytes bytes, 16-byte aligned).
struct TokenMetaRef {
  uint8_t* row;
  int64_t top_k;
  int32_t& src_token() const { return *reinterpret_cast<int32_t*>(row); }
  int32_t& local_expert(int64_t j) const { return reinterpret_cast<int32_t*>(row)[1 + j]; }
  float& weight(int64_t j) const { return reinterpret_cast<float*>(row)[1 + top_k + j]; }
};
TokenMetaRef meta_row(const WorkspaceLayout& layout, void* base, int64_t recv_row);

// What one source rank sends, derived from topk_ids alone.
struct DispatchPlan {
  int64_t num_tokens = 0;
  std::vector<int32_t> rank_token_counts;  // [R] tokens sent to each destination (once per rank)
  std::vector<int32_t> expert_counts;      // [E] (token, slot) pairs per global expert
  std::vector<int32_t> send_row;           // [T, R] row i at destination r, or -1 when not sent there
};

// Stage 1 (source). Checks every id is in [-1, E) and that a token's ids are distinct; the error
// names the first bad token, slot and value.
Status compute_layout(const WorkspaceLayout& layout, int64_t num_tokens, const int32_t* topk_ids, DispatchPlan* plan);

// This rank's tokens in dispatch-wire format.
struct DispatchSource {
  int64_t num_tokens = 0;
  const uint8_t* rows = nullptr;       // [T, H * ws_elem_bytes(dispatch_format)]
  const float* scales = nullptr;       // [T, H/128] (fp8-block only)
  const int32_t* topk_ids = nullptr;   // [T, k]
  const float* topk_weights = nullptr; // [T, k]
};

// Quantisation point 1: x (bf16, or e4m3 + x_scale) -> wire rows (+ scales). x must be contiguous.
void encode_dispatch_rows(const WorkspaceLayout& layout, bool pow2_scales, const TensorView& x,
                          const TensorView& x_scale, std::vector<uint8_t>* rows, std::vector<float>* scales);

// Stage 2 (source `src_rank`): writes into every owner's receive regions through peer_bases.
void dispatch(const WorkspaceLayout& layout, int src_rank, const std::vector<void*>& peer_bases,
              const DispatchPlan& plan, const DispatchSource& source);

// Stage 3 (owner): builds expert_offsets, pool_src, pool_x(_scales) from the receive regions.
// Returns kInternal when the received counts are inconsistent with the metadata or exceed the pool.
Status build_expert_pool(const WorkspaceLayout& layout, void* own_base);

// This rank's expert weights as the experts compute with them (dequantised prepared weights).
struct ExpertWeightsF32 {
  int64_t num_experts = 0, hidden = 0, intermediate = 0;
  std::vector<float> w13;  // [E_l, 2I, H], gate rows then up rows
  std::vector<float> w2;   // [E_l, H, I]
};

// Replaces the expert FFN (tests: identity experts). x is the dequantised FC1 input row [H]; out [H]
// receives FC2's output (before the routing weight).
using ExpertFn = std::function<void(int64_t local_expert, const float* x, float* out)>;

// run_experts starts one worker per this many multiply-adds of FFN work (3*H*I per real pool row):
// 1 to 2 ms of work, against 10 to 100 us to start and join a thread; a small forward stays on one.
constexpr int64_t kMinFmasPerWorker = int64_t{1} << 24;

// Stage 4 (owner): FC1 -> SwiGLU -> intermediate -> FC2 for every real pool row (quantisation
// points 2..5). fc2_out is resized to [expert_offsets[E_l], H]; padding rows stay 0. With a
// non-empty `expert_fn` it replaces the FFN (called serially, from this thread) and the
// intermediate region is not written.
// Threads: up to max_workers (this thread included), at most one per min_fmas_per_worker
// multiply-adds (0: no such limit) and one per work unit (up to 16 rows of one expert). Each pool
// row is computed by one thread in a fixed operation order: the bits do not depend on the count.
void run_experts(const WorkspaceLayout& layout, void* own_base, const ExpertWeightsF32& weights, bool pow2_scales,
                 const ExpertFn& expert_fn, std::vector<float>* fc2_out, int max_workers = 1,
                 int64_t min_fmas_per_worker = kMinFmasPerWorker);

// Where combine_send writes: every rank's workspace and, for the in-kernel reduce, every rank's y.
struct PeerTargets {
  std::vector<void*> bases;          // [R]
  std::vector<uint16_t*> y;          // [R] bf16 outputs this forward (in-kernel reduce only)
  std::vector<std::mutex*> y_locks;  // [R] (in-kernel reduce only)
};

// Quantisation point 7 for one row of H values, and its inverse.
void encode_combine_row(int32_t combine_format, const float* partial, int64_t hidden, uint8_t* wire);
void decode_combine_row(int32_t combine_format, const uint8_t* wire, int64_t hidden, float* out);

// Stage 5 (owner): partial = weight * fc2_out[row] for every real pool row, sent to its source; with
// the owner reduce, one sum of those partials per received token (point 7), in the row of this rank:
// own_base's index in peers.bases (the all-gathered bases).
void combine_send(const WorkspaceLayout& layout, void* own_base, const std::vector<float>& fc2_out,
                  const PeerTargets& peers);

// Stage 6 (source, not with the in-kernel reduce): y[t] = sum over slots in slot order, or over owner
// ranks in rank order with the owner reduce (point 8).
void combine_reduce(const WorkspaceLayout& layout, void* own_base, int64_t num_tokens, const int32_t* topk_ids,
                    uint16_t* y);

// The in-kernel reduce's starting point: y = +0 (bf16) for this rank's tokens, before any peer adds.
void zero_output(int64_t num_tokens, int64_t hidden, uint16_t* y);

// Fills a fresh workspace: 0xFF everywhere (NaN in every fp format, -1 in every index), except the
// signals, error cell and count regions, which start at zero.
void poison_workspace(const WorkspaceLayout& layout, void* base);

}  // namespace reference
}  // namespace megamoe
