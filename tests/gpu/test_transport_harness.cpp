#include "test_transport_harness.h"

#include <algorithm>
#include <mutex>

namespace megamoe {
namespace test {

namespace {
bool g_shared_gpu = false;
}  // namespace

std::vector<std::shared_ptr<Communicator>>* transport_group(int n, std::string* reason) {
  static std::mutex mutex;
  static std::vector<std::shared_ptr<Communicator>>* group = nullptr;
  static std::string failure;
  static bool tried = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (!tried) {
    tried = true;
    g_shared_gpu = !gpu_test::gpu_skip_reason(1).empty() || gpu_test::cuda_device_count_or_zero() < 2;
    failure = gpu_test::gpu_skip_reason(1);
    if (!failure.empty()) {
      failure = "the EP transport tests: " + failure;
    } else {
      auto* g = new std::vector<std::shared_ptr<Communicator>>();
      const Status st = g_shared_gpu ? create_shared_gpu_group(0, 2, g) : create_nccl_group({0, 1}, g);
      if (!st.is_ok()) {
        failure = std::string("cannot build the ") + transport_group_kind() + " group: " + st.to_string();
        delete g;
      } else {
        group = g;
      }
    }
  }
  if (!group || static_cast<int>(group->size()) < n) {
    if (reason) *reason = failure.empty() ? "fewer ranks than the test needs" : failure;
    return nullptr;
  }
  return group;
}

int device_of_rank(int rank) { return g_shared_gpu ? 0 : rank; }
const char* transport_group_kind() { return g_shared_gpu ? "shared GPU" : "NCCL"; }

void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([r, &fn] {
      cudaSetDevice(device_of_rank(r));
      fn(r);
    });
  for (auto& t : threads) t.join();
}

WorkspaceParams Case::params() const {
  WorkspaceParams p;
  p.ep_size = num_ranks;
  p.experts_per_rank = num_experts / num_ranks;
  p.top_k = top_k;
  p.hidden = hidden;
  p.intermediate = 128;
  p.max_tokens_per_rank = max_tokens;
  p.segment_align = block_m;
  p.dispatch_format = dispatch_format;
  p.intermediate_format = kWsBf16;
  p.combine_format = combine_format;
  p.owner_reduce = owner_reduce ? 1 : 0;
  return p;
}

RankInputs Case::inputs(int rank) const {
  RankInputs in;
  const int64_t T = tokens.at(rank);
  in.num_tokens = T;
  std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(rank) * 104729u + 17u);
  std::normal_distribution<float> normal(0.f, 1.f);
  in.x.resize(T * hidden);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < hidden; ++h) {
      // Varied magnitudes per 32-block so the block scales differ.
      const float mag = std::ldexp(1.f, static_cast<int>((h / 32 + t + rank) % 9) - 4);
      in.x[t * hidden + h] = fmt::float_to_bf16(normal(rng) * mag);
    }
    in.x[t * hidden + 0] = fmt::float_to_bf16(static_cast<float>(rank + 1));  // rank tag
    in.x[t * hidden + 1] = fmt::float_to_bf16(static_cast<float>(t % 256));   // token tag
  }
  if (x_fp8) {
    in.x_fp8.assign(T * hidden, 0);
    in.x_scale.assign(T * (hidden / 128), 0.f);
    std::vector<float> f(hidden);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < hidden; ++h) f[h] = fmt::bf16_to_float(in.x[t * hidden + h]);
      fmt::quantize_fp8_1x128(f.data(), hidden, &in.x_fp8[t * hidden], &in.x_scale[t * (hidden / 128)], pow2_scales);
    }
  }
  in.topk_ids.assign(T * top_k, -1);
  in.topk_weights.assign(T * top_k, 0.f);
  std::uniform_real_distribution<float> uni(0.05f, 1.f);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(num_experts) - 1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> chosen;
    for (int64_t j = 0; j < top_k; ++j) {
      int32_t id = -1;
      if (routing == Routing::kOneExpert) {
        id = j == 0 ? 3 : -1;
      } else if (rng() % 10 != 0) {  // ~10% empty slots
        do id = pick(rng);
        while (std::find(chosen.begin(), chosen.end(), id) != chosen.end());
        chosen.push_back(id);
      }
      in.topk_ids[t * top_k + j] = id;
      in.topk_weights[t * top_k + j] = unit_weights ? 1.f : uni(rng);
    }
  }
  if (routing == Routing::kWithBad && T > 5) {
    in.topk_ids[3 * top_k + 1] = static_cast<int32_t>(num_experts + 5);  // first bad: token 3, slot 1
    in.topk_ids[5 * top_k + 0] = -7;
  }
  return in;
}

namespace {
bool valid_slot(const int32_t* ids, int64_t j, int64_t E) {
  if (ids[j] < 0 || ids[j] >= E) return false;
  for (int64_t jj = 0; jj < j; ++jj)
    if (ids[jj] == ids[j]) return false;
  return true;
}
}  // namespace

Truth protocol_truth(const Case& c, const std::vector<RankInputs>& all, int dest) {
  Truth tr;
  const int R = c.num_ranks;
  const int64_t El = c.num_experts / R, k = c.top_k, BM = c.block_m;
  tr.recv_token_counts.assign(R, 0);
  tr.recv_expert_counts.assign(R * El, 0);
  tr.recv_src_token.assign(R, {});
  for (int s = 0; s < R; ++s) {
    const RankInputs& in = all[s];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const int32_t* ids = &in.topk_ids[t * k];
      bool here = false;
      for (int64_t j = 0; j < k; ++j)
        if (valid_slot(ids, j, c.num_experts) && ids[j] / El == dest) {
          here = true;
          tr.recv_expert_counts[s * El + ids[j] - dest * El]++;
        }
      if (here) {
        tr.recv_token_counts[s]++;
        tr.recv_src_token[s].push_back(t);
      }
    }
  }
  tr.expert_offsets.assign(El + 1, 0);
  std::vector<std::vector<int32_t>> seg(El);
  for (int64_t e = 0; e < El; ++e)
    for (int s = 0; s < R; ++s)
      for (size_t i = 0; i < tr.recv_src_token[s].size(); ++i) {
        const int32_t* ids = &all[s].topk_ids[tr.recv_src_token[s][i] * k];
        for (int64_t j = 0; j < k; ++j)
          if (valid_slot(ids, j, c.num_experts) && ids[j] == dest * El + e)
            seg[e].push_back(static_cast<int32_t>((s * c.max_tokens + static_cast<int64_t>(i)) * k + j));
      }
  for (int64_t e = 0; e < El; ++e) {
    tr.expert_offsets[e + 1] = tr.expert_offsets[e] + static_cast<int32_t>((seg[e].size() + BM - 1) / BM * BM);
    for (size_t q = 0; q < seg[e].size(); ++q) tr.pool_src.push_back(seg[e][q]);
    for (int64_t q = static_cast<int64_t>(seg[e].size()); q < (static_cast<int64_t>(seg[e].size()) + BM - 1) / BM * BM; ++q)
      tr.pool_src.push_back(-1);
  }
  return tr;
}

void encode_wire_row(const Case& c, const uint16_t* x_row, std::vector<uint8_t>* bytes, std::vector<float>* scales) {
  const int64_t H = c.hidden;
  std::vector<float> f(H);
  for (int64_t h = 0; h < H; ++h) f[h] = fmt::bf16_to_float(x_row[h]);
  if (c.dispatch_format == kWsFp8Block || c.x_fp8) {
    bytes->assign(H, 0);
    scales->assign(H / 128, 0.f);
    fmt::quantize_fp8_1x128(f.data(), H, bytes->data(), scales->data(), c.pow2_scales);
    if (c.dispatch_format == kWsFp8Block) return;
    // e4m3 x on a bf16 wire: code * scale (fp32), rounded to bf16
    fmt::dequantize_fp8_1x128(bytes->data(), scales->data(), H, f.data());
    scales->clear();
    bytes->assign(H * 2, 0);
    uint16_t* b = reinterpret_cast<uint16_t*>(bytes->data());
    for (int64_t h = 0; h < H; ++h) b[h] = fmt::float_to_bf16(f[h]);
  } else {
    bytes->assign(reinterpret_cast<const uint8_t*>(x_row), reinterpret_cast<const uint8_t*>(x_row + H));
    scales->clear();
  }
}

namespace {
void dequant_wire_row(const Case& c, const std::vector<uint8_t>& bytes, const std::vector<float>& scales, float* out) {
  const int64_t H = c.hidden;
  if (c.dispatch_format == kWsFp8Block) {
    fmt::dequantize_fp8_1x128(bytes.data(), scales.data(), H, out);
  } else {
    const uint16_t* b = reinterpret_cast<const uint16_t*>(bytes.data());
    for (int64_t h = 0; h < H; ++h) out[h] = fmt::bf16_to_float(b[h]);
  }
}

void codec_round_trip(int32_t format, const std::vector<float>& p, std::vector<float>* out) {
  const int64_t H = static_cast<int64_t>(p.size());
  out->resize(H);
  if (format == kWsBf16) {
    for (int64_t h = 0; h < H; ++h) (*out)[h] = fmt::round_to_bf16(p[h]);
  } else if (format == kWsMxfp8) {
    std::vector<uint8_t> q(H), s(H / 32);
    fmt::quantize_mxfp8(p.data(), H, q.data(), s.data());
    fmt::dequantize_mxfp8(q.data(), s.data(), H, out->data());
  } else {
    std::vector<uint8_t> q(H / 2), s(H / 16);
    const float g = fmt::nvfp4_global_scale(fmt::amax_finite(p.data(), H));
    fmt::quantize_nvfp4(p.data(), H, g, q.data(), s.data());
    fmt::dequantize_nvfp4(q.data(), s.data(), g, H, out->data());
  }
}
}  // namespace

std::vector<uint16_t> expected_output(const Case& c, const RankInputs& in) {
  const int64_t H = c.hidden, k = c.top_k;
  std::vector<uint16_t> y(in.num_tokens * H);
  std::vector<uint8_t> bytes;
  std::vector<float> scales, xdq(H), p(H), dec;
  for (int64_t t = 0; t < in.num_tokens; ++t) {
    encode_wire_row(c, &in.x[t * H], &bytes, &scales);
    dequant_wire_row(c, bytes, scales, xdq.data());
    std::vector<float> acc(H, 0.f);
    const int32_t* ids = &in.topk_ids[t * k];
    if (c.owner_reduce) {
      const int64_t El = c.num_experts / c.num_ranks;
      for (int r = 0; r < c.num_ranks; ++r) {
        bool any = false;
        std::fill(p.begin(), p.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          if (!valid_slot(ids, j, c.num_experts) || ids[j] / El != r) continue;
          any = true;
          const float w = in.topk_weights[t * k + j];
          for (int64_t h = 0; h < H; ++h) p[h] += fmt::mul_rn(w, xdq[h]);
        }
        if (!any) continue;
        codec_round_trip(c.combine_format, p, &dec);
        for (int64_t h = 0; h < H; ++h) acc[h] += dec[h];
      }
    } else {
      for (int64_t j = 0; j < k; ++j) {
        if (!valid_slot(ids, j, c.num_experts)) continue;
        const float w = in.topk_weights[t * k + j];
        for (int64_t h = 0; h < H; ++h) p[h] = w * xdq[h];
        codec_round_trip(c.combine_format, p, &dec);
        for (int64_t h = 0; h < H; ++h) acc[h] += dec[h];
      }
    }
    for (int64_t h = 0; h < H; ++h) y[t * H + h] = fmt::float_to_bf16(acc[h]);
  }
  return y;
}

std::vector<float> identity_expert_out(const Case& c, const WorkspaceLayout& l, const std::vector<uint8_t>& pool_x,
                                       const std::vector<float>& pool_scales) {
  const int64_t H = c.hidden, P = l.pool_rows;
  std::vector<float> out(P * H, 0.f);
  const int64_t row_bytes = H * ws_elem_bytes(c.dispatch_format);
  for (int64_t p = 0; p < P; ++p) {
    std::vector<uint8_t> bytes(pool_x.begin() + p * row_bytes, pool_x.begin() + (p + 1) * row_bytes);
    std::vector<float> scales;
    if (c.dispatch_format == kWsFp8Block)
      scales.assign(pool_scales.begin() + p * (H / 128), pool_scales.begin() + (p + 1) * (H / 128));
    dequant_wire_row(c, bytes, scales, &out[p * H]);
  }
  return out;
}

}  // namespace test
}  // namespace megamoe
