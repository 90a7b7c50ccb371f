// See reference_check.h.
#include "reference_check.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <thread>

#include "megamoe/formats.h"
#include "reference/reference_moe.h"

namespace megamoe::tool {

std::vector<float> consumed_x(const MoeConfig& c, const uint16_t* x_bf16, int64_t T, int64_t H) {
  std::vector<float> x(static_cast<size_t>(T * H));
  for (size_t i = 0; i < x.size(); ++i) x[i] = fmt::bf16_to_float(x_bf16[i]);
  if (c.dispatch_format != DispatchFormat::kFp8Block) return x;
  std::vector<uint8_t> q(static_cast<size_t>(H));
  std::vector<float> scales(static_cast<size_t>(H / fmt::kFp8BlockSize));
  for (int64_t t = 0; t < T; ++t) {
    float* row = x.data() + t * H;
    fmt::quantize_fp8_1x128(row, H, q.data(), scales.data(), c.pow2_scales);
    fmt::dequantize_fp8_1x128(q.data(), scales.data(), H, row);
  }
  return x;
}

double ErrorSums::rel_l2() const { return sum_sq_ref > 0 ? std::sqrt(sum_sq_err / sum_sq_ref) : std::sqrt(sum_sq_err); }

void ErrorSums::add(const ErrorSums& o) {
  tokens += o.tokens;
  sum_sq_err += o.sum_sq_err;
  sum_sq_ref += o.sum_sq_ref;
  max_abs = std::max(max_abs, o.max_abs);
  non_finite += o.non_finite;
}

ErrorSums compare_output(const uint16_t* y, const double* ref, int64_t n) {
  ErrorSums e;
  for (int64_t i = 0; i < n; ++i) {
    const double v = fmt::bf16_to_float(y[i]);
    if (!std::isfinite(v)) {
      ++e.non_finite;
      continue;
    }
    const double d = v - ref[i];
    e.sum_sq_err += d * d;
    e.sum_sq_ref += ref[i] * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
  }
  return e;
}

std::vector<int64_t> spread_rows(int64_t T, int64_t n) {
  std::vector<int64_t> rows;
  if (T <= 0 || n <= 0) return rows;
  if (n >= T) {
    for (int64_t t = 0; t < T; ++t) rows.push_back(t);
    return rows;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = n == 1 ? 0 : i * (T - 1) / (n - 1);
    if (rows.empty() || rows.back() != t) rows.push_back(t);
  }
  return rows;
}

Status reference_rows(const MoeGeometry& g, const MoeConfig& c, const reference::RankInputs& in,
                      const std::vector<int64_t>& rows, const ExpertWeightsFn& expert_weights, int threads,
                      std::vector<double>* ref) {
  const int64_t H = g.hidden, I = g.intermediate, k = g.top_k, n = static_cast<int64_t>(rows.size());
  // The chosen tokens as the layer consumed them, and each expert's (row, slot weight) list.
  std::vector<uint16_t> x_bf16(static_cast<size_t>(n * H));
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(in.x_bf16.data() + rows[i] * H, H, x_bf16.data() + i * H);
  const std::vector<float> x = consumed_x(c, x_bf16.data(), n, H);
  std::map<int64_t, std::vector<std::pair<int64_t, float>>> by_expert;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = in.topk_ids[rows[i] * k + j];
      if (e >= 0) by_expert[e].emplace_back(i, in.topk_weights[rows[i] * k + j]);
    }
  const std::vector<std::pair<int64_t, std::vector<std::pair<int64_t, float>>>> experts(by_expert.begin(),
                                                                                          by_expert.end());
  // Each thread sums its experts' contributions into its own buffer: y[i] += w * FC2_e(SwiGLU(FC1_e(x_i))),
  // each by the float64 reference of a one-expert geometry.
  const int nthreads = std::max(1, std::min<int>(threads, static_cast<int>(experts.size())));
  std::vector<std::vector<double>> partial(static_cast<size_t>(nthreads), std::vector<double>(n * H, 0.0));
  std::vector<Status> status(static_cast<size_t>(nthreads));
  std::atomic<size_t> next{0};
  MoeGeometry one = g;  // one expert, one slot per token: ids [n, 1]
  one.num_experts = 1;
  one.top_k = 1;
  one.ep_size = 1;
  one.ep_rank = 0;
  auto body = [&](int t) {
    std::vector<float> w13(static_cast<size_t>(2 * I * H)), w2(static_cast<size_t>(H * I));
    std::vector<double> y(static_cast<size_t>(n * H));
    for (size_t idx = next++; idx < experts.size(); idx = next++) {
      const auto& [e, slots] = experts[idx];
      if (const Status st = expert_weights(e, w13.data(), w2.data()); !st) {
        status[t] = st;
        return;
      }
      std::vector<int32_t> ids(static_cast<size_t>(n), -1);
      std::vector<float> weights(static_cast<size_t>(n), 0.f);
      for (const auto& [row, w] : slots) {
        ids[row] = 0;  // a token reaches an expert once (its k experts are distinct) or through -1 slots
        weights[row] += w;
      }
      reference::reference_moe(one, n, x.data(), ids.data(), weights.data(), w13.data(), w2.data(), y.data());
      for (int64_t i = 0; i < n * H; ++i) partial[t][i] += y[i];
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < nthreads; ++t) pool.emplace_back(body, t);
  for (std::thread& th : pool) th.join();
  for (const Status& st : status) MEGAMOE_RETURN_IF_ERROR(st);
  ref->assign(static_cast<size_t>(n * H), 0.0);
  for (const auto& p : partial)
    for (int64_t i = 0; i < n * H; ++i) (*ref)[i] += p[i];
  return Status::ok();
}

}  // namespace megamoe::tool
