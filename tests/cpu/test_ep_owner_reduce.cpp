// The owner-reduced combine (MoeConfig::owner_reduce, ep_protocol.h points 7 and 8): each owner sends
// one combine row per (token, owner rank), the fp32 sum in slot order of its local partials; the
// source sums the owners' rows in rank order. The protocol simulated with R ranks as threads (as in
// test_ep_protocol.cpp), checked against the truth computed here and against the per-slot combine on
// the same inputs; and the two summation orders, with data where the order shows in y.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/host_group.h"
#include "ep_protocol_cases.h"
#include "megamoe/formats.h"
#include "megamoe/workspace.h"
#include "reference/ep_protocol.h"
#include "reference/problem.h"

namespace megamoe {
namespace {

using reference::Routing;
using namespace test;  // ep_protocol_cases.h

// Expert e's output: x rotated by e and scaled by 1 + e/8, so two experts of one owner give different
// partials (identity experts would differ only by their routing weights).
void rotating_expert(int64_t global_expert, const float* x, float* out) {
  const float scale = 1.0f + 0.125f * static_cast<float>(global_expert);
  for (int64_t h = 0; h < kH; ++h) out[h] = fmt::mul_rn(x[(h + global_expert) % kH], scale);
}

// What a protocol run leaves: every rank's workspace, its dispatch wire rows and its output.
struct ProtocolRun {
  std::vector<std::unique_ptr<Buffer>> ws;
  std::vector<void*> bases;
  std::vector<std::vector<uint8_t>> wire_rows;
  std::vector<std::vector<float>> wire_scales;
  std::vector<std::vector<uint16_t>> y;
};

// Every stage, one thread per rank, with the host group's barriers; experts are rotating_expert.
void run_protocol(const WorkspaceLayout& layout, const reference::MoeProblem& problem, ProtocolRun* run) {
  const int R = static_cast<int>(layout.params.ep_size);
  const int64_t El = layout.params.experts_per_rank;
  for (int r = 0; r < R; ++r) {
    run->ws.push_back(std::make_unique<Buffer>(layout.total_bytes));
    reference::poison_workspace(layout, run->ws.back()->p);
    run->bases.push_back(run->ws.back()->p);
  }
  run->wire_rows.resize(R);
  run->wire_scales.resize(R);
  run->y.resize(R);
  std::vector<std::shared_ptr<Communicator>> comms;
  ASSERT_TRUE(create_host_group(R, &comms).is_ok());
  HostGroup* group = host_group_of(comms[0].get());
  group->set_wait_timeout_ms(20000);
  std::vector<Status> st(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r]() {
      const reference::RankInputs& in = problem.ranks[r];
      const int64_t T = in.num_tokens;
      auto step = [&]() -> Status {
        reference::DispatchPlan plan;
        MEGAMOE_RETURN_IF_ERROR(reference::compute_layout(layout, T, in.topk_ids.data(), &plan));
        TensorView x(const_cast<uint16_t*>(in.x_bf16.data()), DType::kBFloat16, {T, kH});
        reference::encode_dispatch_rows(layout, false, x, TensorView(), &run->wire_rows[r], &run->wire_scales[r]);
        MEGAMOE_RETURN_IF_ERROR(group->barrier(r, "dispatch-ready"));
        reference::DispatchSource src{T, run->wire_rows[r].data(),
                                      run->wire_scales[r].empty() ? nullptr : run->wire_scales[r].data(),
                                      in.topk_ids.data(), in.topk_weights.data()};
        reference::dispatch(layout, r, run->bases, plan, src);
        MEGAMOE_RETURN_IF_ERROR(group->barrier(r, "dispatch-done"));
        MEGAMOE_RETURN_IF_ERROR(reference::build_expert_pool(layout, run->bases[r]));
        std::vector<float> fc2;
        const reference::ExpertFn expert = [&](int64_t e, const float* xe, float* out) {
          rotating_expert(r * El + e, xe, out);
        };
        reference::run_experts(layout, run->bases[r], reference::ExpertWeightsF32{}, false, expert, &fc2);
        reference::PeerTargets peers;
        peers.bases = run->bases;
        reference::combine_send(layout, run->bases[r], fc2, peers);
        MEGAMOE_RETURN_IF_ERROR(group->barrier(r, "combine-done"));
        run->y[r].assign(T * kH, 0xFFFF);
        reference::combine_reduce(layout, run->bases[r], T, in.topk_ids.data(), run->y[r].data());
        return Status::ok();
      };
      st[r] = step();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
}

class OwnerReduce : public testing::TestWithParam<ProtocolCase> {};

TEST_P(OwnerReduce, CombineRowsAndOutputMatchTheTruth) {
  const ProtocolCase c = GetParam();
  const int R = c.ep_size;
  MoeGeometry g;
  g.hidden = kH, g.intermediate = kI, g.num_experts = kE, g.top_k = kK, g.ep_size = R, g.max_tokens_per_rank = kTMax;
  const reference::MoeProblem problem = reference::make_random_problem(g, 4321 + R, token_pattern(R), c.routing);
  WorkspaceParams params;
  params.ep_size = R, params.experts_per_rank = kE / R, params.top_k = kK, params.hidden = kH, params.intermediate = kI;
  params.max_tokens_per_rank = kTMax, params.segment_align = c.block_m, params.dispatch_format = c.dispatch_format;
  params.intermediate_format = kWsFp8Block, params.combine_format = c.combine_format;
  const WorkspaceLayout per_slot_layout = WorkspaceLayout::make(params);
  params.owner_reduce = 1;
  const WorkspaceLayout layout = WorkspaceLayout::make(params);
  ASSERT_EQ(layout.combine.bytes, kTMax * R * layout.wire_row_bytes);
  ProtocolRun owner, per_slot;
  ASSERT_NO_FATAL_FAILURE(run_protocol(layout, problem, &owner));
  ASSERT_NO_FATAL_FAILURE(run_protocol(per_slot_layout, problem, &per_slot));

  const int64_t El = kE / R, row_bytes = kH * ws_elem_bytes(c.dispatch_format), nb = kH / 128;
  const int64_t wire_bytes = layout.wire_row_bytes;
  std::vector<float> xq(kH), expert_out(kH), acc(kH), decoded(kH), y_acc(kH);
  std::vector<uint8_t> want(wire_bytes), unwritten(wire_bytes, 0xFF);
  int64_t rows_checked = 0, rows_with_sums = 0;
  std::vector<float> y_owner, y_slot;
  for (int s = 0; s < R; ++s) {
    const reference::RankInputs& in = problem.ranks[s];
    const uint8_t* combine = layout.at<uint8_t>(owner.bases[s], layout.combine);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const uint8_t* wire_x = owner.wire_rows[s].data() + t * row_bytes;
      if (c.dispatch_format == kWsFp8Block) {
        fmt::dequantize_fp8_1x128(wire_x, owner.wire_scales[s].data() + t * nb, kH, xq.data());
      } else {
        for (int64_t h = 0; h < kH; ++h) xq[h] = fmt::bf16_to_float(reinterpret_cast<const uint16_t*>(wire_x)[h]);
      }
      std::fill(y_acc.begin(), y_acc.end(), 0.0f);
      for (int r = 0; r < R; ++r) {
        // (a) row t*R + r: owner r's slots of token t, summed in slot order, encoded once.
        std::fill(acc.begin(), acc.end(), 0.0f);
        int local_slots = 0;
        for (int64_t j = 0; j < kK; ++j) {
          const int32_t e = in.topk_ids[t * kK + j];
          if (e < 0 || e / El != r) continue;
          ++local_slots;
          rotating_expert(e, xq.data(), expert_out.data());
          for (int64_t h = 0; h < kH; ++h) acc[h] = acc[h] + fmt::mul_rn(in.topk_weights[t * kK + j], expert_out[h]);
        }
        const uint8_t* row = combine + (t * R + r) * wire_bytes;
        if (local_slots == 0) {
          EXPECT_EQ(std::memcmp(row, unwritten.data(), wire_bytes), 0)
              << "source " << s << " token " << t << ": rank " << r << " owns none of its experts but wrote its row";
          continue;
        }
        reference::encode_combine_row(c.combine_format, acc.data(), kH, want.data());
        ASSERT_EQ(std::memcmp(row, want.data(), wire_bytes), 0)
            << "source " << s << " token " << t << " owner " << r << " (" << local_slots << " local slots)";
        ++rows_checked;
        rows_with_sums += local_slots > 1 ? 1 : 0;
        // (b) y: the owners' rows decoded and summed in rank order.
        reference::decode_combine_row(c.combine_format, row, kH, decoded.data());
        for (int64_t h = 0; h < kH; ++h) y_acc[h] += decoded[h];
      }
      for (int64_t h = 0; h < kH; ++h) {
        ASSERT_EQ(owner.y[s][t * kH + h], fmt::float_to_bf16(y_acc[h])) << "rank " << s << " token " << t << " h " << h;
        y_owner.push_back(fmt::bf16_to_float(owner.y[s][t * kH + h]));
        y_slot.push_back(fmt::bf16_to_float(per_slot.y[s][t * kH + h]));
      }
    }
  }
  EXPECT_GT(rows_with_sums, 0) << "no owner summed two slots: the case does not exercise the owner's sum";
  // (c) The per-slot combine rounds each partial on the wire, the owner reduce each owner's sum: two
  // independent roundings of relative RMS eps (bf16 2.3e-3, mxfp8 4e-2, nvfp4 1.1e-1) differ by about
  // sqrt(2) eps; the bounds are 2.3 to 4 eps.
  const double bound = c.combine_format == kWsBf16 ? 1e-2 : c.combine_format == kWsMxfp8 ? 0.1 : 0.25;
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < y_owner.size(); ++i) {
    diff2 += (double(y_owner[i]) - y_slot[i]) * (double(y_owner[i]) - y_slot[i]);
    ref2 += double(y_slot[i]) * y_slot[i];
  }
  const double rel = std::sqrt(diff2 / ref2);
  std::printf("%lld owner rows (%lld summing several slots); owner vs per-slot rel_l2 %.3e (bound %.3g)\n",
              static_cast<long long>(rows_checked), static_cast<long long>(rows_with_sums), rel, bound);
  EXPECT_LT(rel, bound);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OwnerReduce,
    testing::Values(ProtocolCase{2, Routing::kUniform, kWsBf16, kWsBf16, 1},
                    ProtocolCase{2, Routing::kWithDropped, kWsFp8Block, kWsBf16, 64},
                    ProtocolCase{2, Routing::kUniform, kWsFp8Block, kWsMxfp8, 1},
                    ProtocolCase{2, Routing::kWithDropped, kWsBf16, kWsNvfp4, 64},
                    ProtocolCase{4, Routing::kWithDropped, kWsBf16, kWsBf16, 64},
                    ProtocolCase{4, Routing::kWithDropped, kWsBf16, kWsMxfp8, 1},
                    ProtocolCase{4, Routing::kUniform, kWsFp8Block, kWsNvfp4, 1}),
    case_name);

// Where the order of the fp32 adds shows in y: rows +X, -X and X * 2^-30 sum to X * 2^-30 in this
// order and to 0 in any order that adds the small row before the two large ones cancel.
float order_probe(int which, int64_t h) {
  const float x = std::ldexp(1.0f, static_cast<int>(h % 8));
  return which == 0 ? x : which == 1 ? -x : std::ldexp(x, -30);
}

// The owner sums in slot order, not in pool order (expert-major): slots 0, 1, 2 hold experts 5, 3, 1.
TEST(OwnerReduceOrder, OwnerSumsInSlotOrder_EP1) {
  WorkspaceParams params;
  params.ep_size = 1, params.experts_per_rank = kE, params.top_k = kK, params.hidden = kH, params.intermediate = kI;
  params.max_tokens_per_rank = 2, params.dispatch_format = kWsBf16, params.owner_reduce = 1;
  const WorkspaceLayout layout = WorkspaceLayout::make(params);
  Buffer ws(layout.total_bytes);
  reference::poison_workspace(layout, ws.p);
  const std::vector<int32_t> ids = {5, 3, 1, -1, 2, -1, -1, -1};
  const std::vector<float> weights(8, 1.0f);
  std::vector<uint16_t> x(2 * kH);
  for (int64_t i = 0; i < 2 * kH; ++i) x[i] = fmt::float_to_bf16(0.25f + static_cast<float>(i % 7));
  reference::DispatchPlan plan;
  ASSERT_TRUE(reference::compute_layout(layout, 2, ids.data(), &plan).is_ok());
  const reference::DispatchSource source{2, reinterpret_cast<const uint8_t*>(x.data()), nullptr, ids.data(),
                                         weights.data()};
  reference::dispatch(layout, 0, {ws.p}, plan, source);
  ASSERT_TRUE(reference::build_expert_pool(layout, ws.p).is_ok());
  const int32_t* offsets = layout.at<int32_t>(ws.p, layout.expert_offsets);
  const int32_t* pool_src = layout.at<int32_t>(ws.p, layout.pool_src);
  std::vector<float> fc2(static_cast<size_t>(offsets[kE] * kH));
  for (int64_t row = 0; row < offsets[kE]; ++row) {  // token 0: the probe rows by slot; token 1: x * 3
    const int64_t token = pool_src[row] / kK, slot = pool_src[row] % kK;
    for (int64_t h = 0; h < kH; ++h)
      fc2[row * kH + h] = token == 0 ? order_probe(static_cast<int>(slot), h) : 3.0f * fmt::bf16_to_float(x[kH + h]);
  }
  reference::PeerTargets peers;
  peers.bases = {ws.p};
  reference::combine_send(layout, ws.p, fc2, peers);
  std::vector<uint16_t> y(2 * kH, 0xFFFF);
  reference::combine_reduce(layout, ws.p, 2, ids.data(), y.data());
  for (int64_t h = 0; h < kH; ++h) {
    ASSERT_EQ(y[h], fmt::float_to_bf16(order_probe(2, h))) << "h " << h << ": not summed in slot order";
    ASSERT_EQ(y[kH + h], fmt::float_to_bf16(3.0f * fmt::bf16_to_float(x[kH + h]))) << "h " << h;
  }
}

// The source sums the owners' rows in rank order (not in slot order), reading only owners' rows.
TEST(OwnerReduceOrder, SourceSumsOwnerRowsInRankOrder_EP4) {
  WorkspaceParams params;
  params.ep_size = 4, params.experts_per_rank = kE / 4, params.top_k = kK, params.hidden = kH, params.intermediate = kI;
  params.max_tokens_per_rank = 3, params.owner_reduce = 1;
  const WorkspaceLayout layout = WorkspaceLayout::make(params);
  Buffer ws(layout.total_bytes);
  reference::poison_workspace(layout, ws.p);  // rows nobody writes stay NaN
  const int64_t El = kE / 4;
  // Token 0: slots on ranks 2, 1, 0 (none on 3: its row stays NaN); token 1: ranks 0, 1, 2, 0 (rank 0's
  // row read once); token 2: no slots.
  const std::vector<int32_t> ids = {static_cast<int32_t>(2 * El), static_cast<int32_t>(El + 1), 0, -1,
                                    1, static_cast<int32_t>(El), static_cast<int32_t>(2 * El + 3), 2,
                                    -1, -1, -1, -1};
  std::vector<float> row(kH);
  for (int64_t t = 0; t < 2; ++t)
    for (int r = 0; r < 3; ++r) {
      for (int64_t h = 0; h < kH; ++h) row[h] = order_probe(r, h);
      reference::encode_combine_row(kWsBf16, row.data(), kH,
                                    layout.at<uint8_t>(ws.p, layout.combine) + (t * 4 + r) * layout.wire_row_bytes);
    }
  std::vector<uint16_t> y(3 * kH, 0xFFFF);
  reference::combine_reduce(layout, ws.p, 3, ids.data(), y.data());
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t h = 0; h < kH; ++h)
      ASSERT_EQ(y[t * kH + h], fmt::float_to_bf16(order_probe(2, h))) << "token " << t << " h " << h;
  for (int64_t h = 0; h < kH; ++h) ASSERT_EQ(y[2 * kH + h], 0) << "a token with no slots gets +0";
}

}  // namespace
}  // namespace megamoe
