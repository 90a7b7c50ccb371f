// The FP4 weight formats' layer check, shared by test_layer_mxfp4 and test_layer_nvfp4: one forward
// of a built harness against the cpu backend within the same-points bound of one forward, a repeat
// and a CUDA-graph replay bitwise equal to it, and the float64 reference on the unquantised weights
// reported (the format's own rounding).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu/layer_harness.h"
#include "megamoe/formats.h"
#include "reference/error_model.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace megamoe::gpu_test {

// tag: the format printed first ("mxfp4"); name: the case; combine: the wire the bound is for.
inline void check_fp4_layer(Harness& h, const MoeProblem& problem, CombineDtype combine, const char* tag,
                            const std::string& name) {
  const int R = static_cast<int>(problem.geometry.ep_size);
  const int64_t H = problem.geometry.hidden;
  std::vector<std::vector<uint16_t>> y_gpu, y_cpu, y_again, y_graph, unused;
  ASSERT_TRUE(h.run(problem.ranks, &y_gpu, &y_cpu));
  for (int r = 0; r < R; ++r) {
    ASSERT_EQ(y_gpu[r].size(), y_cpu[r].size());
    if (y_gpu[r].empty()) continue;
    const reference::ErrorBound bound =
        reference::same_points_bound_one_forward(combine, static_cast<int64_t>(y_gpu[r].size()) / H);
    const double err = rel_l2_bf16(y_gpu[r], y_cpu[r]);
    std::printf("[%s] %s rank %d: rel-L2 vs cpu backend = %.3e (bound %.2e: %s)\n", tag, name.c_str(), r, err,
                bound.rel_l2, bound.derivation.c_str());
    EXPECT_LE(err, bound.rel_l2) << name << " rank " << r;
  }
  ASSERT_TRUE(h.run(problem.ranks, &y_again, &unused));
  EXPECT_EQ(y_gpu, y_again) << "repeated forwards differ: a race";
  ASSERT_TRUE(h.run(problem.ranks, &y_graph, &unused, /*graph=*/true));
  EXPECT_EQ(y_gpu, y_graph) << "CUDA-graph replay differs from eager";
  // The float64 reference on the unquantised fp32 weights, reported: the format's own rounding of them.
  for (int r = 0; r < R; ++r) {
    const RankInputs& in = problem.ranks[r];
    if (in.num_tokens == 0) continue;
    std::vector<float> x(in.x_bf16.size()), y(y_gpu[r].size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = fmt::bf16_to_float(in.x_bf16[i]);
    for (size_t i = 0; i < y.size(); ++i) y[i] = fmt::bf16_to_float(y_gpu[r][i]);
    std::vector<double> ref(y.size());
    reference::reference_moe(problem.geometry, in.num_tokens, x.data(), in.topk_ids.data(), in.topk_weights.data(),
                             problem.w13.data(), problem.w2.data(), ref.data());
    std::printf("[%s] %s rank %d: rel-L2 vs float64 on the unquantised weights = %.3e\n", tag, name.c_str(), r,
                reference::rel_l2(y.data(), ref.data(), static_cast<int64_t>(y.size())));
  }
}

}  // namespace megamoe::gpu_test
