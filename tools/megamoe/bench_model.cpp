#include "bench_model.h"

#include <algorithm>

#include "megamoe/workspace.h"
#include "presets.h"

namespace megamoe::tool {

// bf16 MMAs for bf16 weights and for nvfp4 ones with a bf16 dispatch (expanded to bf16 for the bf16
// GEMM: intermediate_format() bf16 in both), fp8 otherwise.
double gemm_peak(const MoeConfig& c) {
  return c.intermediate_format() == DispatchFormat::kBf16 ? kH200Bf16FlopsPerS : kH200Fp8FlopsPerS;
}

ForwardModel model_forward(const MoeGeometry& g, const MoeConfig& c, int64_t tokens, int64_t num_sets,
                           const std::vector<std::vector<const int32_t*>>& ids) {
  const int64_t R = g.ep_size, E = g.num_experts, k = g.top_k, H = g.hidden, I = g.intermediate;
  const int64_t El = g.experts_per_rank();
  const double flops_per_pair = 2.0 * 3.0 * static_cast<double>(H) * static_cast<double>(I);
  const double bytes_per_expert = static_cast<double>(prepared_bytes_per_expert(c.weight_format, H, I));
  // Dispatch: one row per (token, destination rank): the token, its scales (fp8) and its meta row.
  const double dispatch_row = static_cast<double>(
      H * (c.dispatch_format == DispatchFormat::kBf16 ? 2 : 1) +
      (c.dispatch_format == DispatchFormat::kFp8Block ? H / 128 * 4 : 0) + token_meta_bytes(k));
  // Combine: one row per (token, slot) whose expert lives elsewhere; the in-kernel reduce adds bf16;
  // the owner reduce sends one row per (token, owner rank elsewhere).
  const WorkspaceParams wp = workspace_params(g, c);
  const double combine_row =
      static_cast<double>(c.in_kernel_fc2_reduce ? 2 * H : combine_row_bytes(wp.combine_format, H));

  ForwardModel m;
  int64_t hbm_votes = 0, gemm_votes = 0, link_votes = 0;
  for (int64_t s = 0; s < num_sets; ++s) {
    std::vector<double> pairs(R, 0), sent(R, 0), recv(R, 0);
    std::vector<char> hit(static_cast<size_t>(E), 0);
    for (int64_t r = 0; r < R; ++r) {
      const int32_t* rid = ids[r][s];
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<char> to_rank(R, 0);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = rid[t * k + j];
          if (e < 0 || e >= E) continue;
          const int64_t owner = e / El;
          pairs[owner] += 1;
          hit[e] = 1;
          to_rank[owner] = 1;
          if (owner != r && !c.uses_owner_reduce()) {
            sent[owner] += combine_row;
            recv[r] += combine_row;
          }
        }
        for (int64_t d = 0; d < R; ++d) {
          if (!to_rank[d] || d == r) continue;
          sent[r] += dispatch_row;
          recv[d] += dispatch_row;
          if (c.uses_owner_reduce()) {
            sent[d] += combine_row;
            recv[r] += combine_row;
          }
        }
      }
    }
    double floor_s = 0;
    std::string bound = "hbm";
    for (int64_t r = 0; r < R; ++r) {
      double hit_bytes = 0;
      for (int64_t e = r * El; e < (r + 1) * El; ++e) hit_bytes += hit[e] ? bytes_per_expert : 0;
      const double t_hbm = hit_bytes / kH200HbmBytesPerS;
      const double t_gemm = pairs[r] * flops_per_pair / gemm_peak(c);
      const double t_link = std::max(sent[r], recv[r]) / kH200NvlinkBytesPerS;
      const double t = std::max({t_hbm, t_gemm, t_link});
      if (t > floor_s) {
        floor_s = t;
        bound = t == t_hbm ? "hbm" : t == t_gemm ? "gemm" : "nvlink";
      }
      m.flops += pairs[r] * flops_per_pair / static_cast<double>(num_sets);
      m.weight_bytes += hit_bytes / static_cast<double>(num_sets);
      m.nvlink_bytes += sent[r] / static_cast<double>(num_sets);
    }
    m.floor_s += floor_s / static_cast<double>(num_sets);
    (bound == "hbm" ? hbm_votes : bound == "gemm" ? gemm_votes : link_votes)++;
  }
  m.bound = hbm_votes >= gemm_votes && hbm_votes >= link_votes ? "hbm" : gemm_votes >= link_votes ? "gemm" : "nvlink";
  return m;
}

}  // namespace megamoe::tool
