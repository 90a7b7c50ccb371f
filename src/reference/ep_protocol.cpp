#include "reference/ep_protocol.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "megamoe/formats.h"

namespace megamoe {
namespace reference {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

char* at_bytes(void* base, const WorkspaceRegion& r) { return static_cast<char*>(base) + r.offset; }

// fp64 accumulation of fp32 products, rounded once to fp32 (quantisation points 2 and 5).
float dot_f64(const float* a, const float* b, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return static_cast<float>(acc);
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

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
  // Counts last (a GPU writes them with release semantics after the rows), zeros included.
  for (int64_t r = 0; r < R; ++r) {
    void* owner = peer_bases[r];
    reinterpret_cast<int32_t*>(at_bytes(owner, layout.recv_token_counts))[src_rank] = plan.rank_token_counts[r];
    int32_t* expert_counts = reinterpret_cast<int32_t*>(at_bytes(owner, layout.recv_expert_counts));
    for (int64_t e = 0; e < El; ++e) expert_counts[src_rank * El + e] = plan.expert_counts[r * El + e];
  }
}

Status build_expert_pool(const WorkspaceLayout& layout, void* own_base) {
  const WorkspaceParams& p = layout.params;
  const int64_t R = p.ep_size, El = p.experts_per_rank, k = p.top_k, H = p.hidden, T_max = p.max_tokens_per_rank;
  const int64_t BM = p.block_m, nb = H / 128;
  const bool fp8_wire = p.dispatch_format == kWsFp8Block;
  const int64_t row_bytes = H * ws_elem_bytes(p.dispatch_format);
  const int32_t* token_counts = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.recv_token_counts));
  const int32_t* expert_counts = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.recv_expert_counts));

  // Cross-check the counts against the metadata: a mismatch is a protocol bug, never an input error.
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
      if (from_meta[e] != expert_counts[s * El + e])
        return Status(StatusCode::kInternal, "ep protocol: recv_expert_counts[src=" + str(s) + "][" + str(e) +
                                                 "]=" + str(expert_counts[s * El + e]) + " but the metadata of the " +
                                                 "rows from that source names the expert " + str(from_meta[e]) +
                                                 " times");
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
                 const ExpertFn& expert_fn, std::vector<float>* fc2_out) {
  const WorkspaceParams& p = layout.params;
  const int64_t El = p.experts_per_rank, H = p.hidden, I = p.intermediate;
  const int64_t nb_h = H / 128, nb_i = I / 128;
  const bool fp8_x = p.dispatch_format == kWsFp8Block, fp8_h = p.intermediate_format == kWsFp8Block;
  const int64_t x_row_bytes = H * ws_elem_bytes(p.dispatch_format);
  const int32_t* offsets = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.expert_offsets));
  const int32_t* pool_src = reinterpret_cast<const int32_t*>(at_bytes(own_base, layout.pool_src));
  const char* pool_x = at_bytes(own_base, layout.pool_x);
  const float* pool_scales = reinterpret_cast<const float*>(at_bytes(own_base, layout.pool_x_scales));
  char* inter = at_bytes(own_base, layout.intermediate);
  float* inter_scales = reinterpret_cast<float*>(at_bytes(own_base, layout.intermediate_scales));

  fc2_out->assign(static_cast<size_t>(offsets[El]) * H, 0.0f);
  std::vector<float> x(H), h(I), hq(I);
  for (int64_t e = 0; e < El; ++e) {
    const float* w13 = expert_fn ? nullptr : weights.w13.data() + e * 2 * I * H;
    const float* w2 = expert_fn ? nullptr : weights.w2.data() + e * H * I;
    for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
      if (pool_src[row] < 0) continue;  // padding
      const char* xr = pool_x + row * x_row_bytes;
      if (fp8_x) {
        fmt::dequantize_fp8_1x128(reinterpret_cast<const uint8_t*>(xr), pool_scales + row * nb_h, H, x.data());
      } else {
        const uint16_t* xb = reinterpret_cast<const uint16_t*>(xr);
        for (int64_t c = 0; c < H; ++c) x[c] = fmt::bf16_to_float(xb[c]);
      }
      float* out = fc2_out->data() + row * H;
      if (expert_fn) {
        expert_fn(e, x.data(), out);
        continue;
      }
      for (int64_t i = 0; i < I; ++i) {
        const float gate = dot_f64(x.data(), w13 + i * H, H);
        const float up = dot_f64(x.data(), w13 + (I + i) * H, H);
        h[i] = silu(gate) * up;
      }
      if (fp8_h) {
        uint8_t* q = reinterpret_cast<uint8_t*>(inter) + row * I;
        fmt::quantize_fp8_1x128(h.data(), I, q, inter_scales + row * nb_i, pow2_scales);
        fmt::dequantize_fp8_1x128(q, inter_scales + row * nb_i, I, hq.data());
      } else {
        uint16_t* q = reinterpret_cast<uint16_t*>(inter) + row * I;
        for (int64_t i = 0; i < I; ++i) {
          q[i] = fmt::float_to_bf16(h[i]);
          hq[i] = fmt::bf16_to_float(q[i]);
        }
      }
      for (int64_t c = 0; c < H; ++c) out[c] = dot_f64(hq.data(), w2 + c * I, I);
    }
  }
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

void combine_send(const WorkspaceLayout& layout, void* own_base, const std::vector<float>& fc2_out,
                  const PeerTargets& peers) {
  const WorkspaceParams& p = layout.params;
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
