// The EP protocol simulated with R ranks as threads: the host group's barriers, and every protocol
// stage checked against the truth computed here (counts, rows, ordering, padding, combine).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include "comm/host_group.h"
#include "ep_protocol_cases.h"
#include "megamoe/formats.h"
#include "reference/cpu_backend.h"
#include "reference/ep_protocol.h"
#include "reference/group_runner.h"
#include "reference/problem.h"

namespace megamoe {
namespace {

using reference::Routing;
using namespace test;  // ep_protocol_cases.h
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

HostGroup* make_group(int size, std::vector<std::shared_ptr<Communicator>>* comms) {
  EXPECT_TRUE(create_host_group(size, comms).is_ok());
  return host_group_of((*comms)[0].get());
}

// ------------------------------------------------------------------------------------------------
// Host group

TEST(HostGroup, AllGatherEveryEpoch_4Ranks_200Epochs) {
  std::vector<std::shared_ptr<Communicator>> comms;
  HostGroup* group = make_group(4, &comms);
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      for (intptr_t epoch = 1; epoch <= 200; ++epoch) {
        std::vector<void*> all;
        if (!group->all_gather(r, "gather", reinterpret_cast<void*>(r * 100000 + epoch), &all).is_ok()) {
          ++bad[r];
          return;
        }
        for (int p = 0; p < 4; ++p)
          if (all[p] != reinterpret_cast<void*>(p * 100000 + epoch)) ++bad[r];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(bad[r], 0) << "rank " << r;
    EXPECT_EQ(group->epoch(r), 200);
  }
}

TEST(HostGroup, MissingRankTimesOutNamingStageAndPeer_NoHang) {
  std::vector<std::shared_ptr<Communicator>> comms;
  HostGroup* group = make_group(3, &comms);
  group->set_wait_timeout_ms(150);
  std::vector<Status> st(3);
  std::vector<WaitError> err(3, WaitError{});
  const auto t0 = Clock::now();
  std::thread a([&] { st[0] = group->barrier(0, "dispatch-ready", &err[0]); });
  std::thread b([&] { st[2] = group->barrier(2, "dispatch-ready", &err[2]); });
  a.join();
  b.join();
  const double elapsed = seconds_since(t0);
  EXPECT_LT(elapsed, 3.0) << "a bounded wait must not hang";
  int timed_out_here = 0;
  for (int r : {0, 2}) {
    EXPECT_EQ(st[r].code(), StatusCode::kTimeout) << st[r].to_string();
    EXPECT_NE(st[r].message().find("dispatch-ready"), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find("peers [1]"), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find("expected 3 ranks, seen 2"), std::string::npos) << st[r].message();
    if (err[r].flag) {
      ++timed_out_here;
      EXPECT_EQ(err[r].rank, r);
      EXPECT_EQ(err[r].peer, 1);
      EXPECT_EQ(err[r].expected, 3);
      EXPECT_EQ(err[r].seen, 2);
    }
  }
  EXPECT_GE(timed_out_here, 1);
  // The late rank (and anyone after) fails fast with the first reason.
  const auto t1 = Clock::now();
  Status late = group->barrier(1, "dispatch-ready");
  EXPECT_LT(seconds_since(t1), 0.5);
  EXPECT_EQ(late.code(), StatusCode::kTimeout);
  EXPECT_NE(late.message().find("peers [1]"), std::string::npos) << late.message();
  EXPECT_FALSE(group->check(0).is_ok());
  std::printf("timeout reported after %.3f s: %s\n", elapsed, st[0].message().c_str());
}

TEST(HostGroup, AbortWakesEveryWaiterPromptly) {
  std::vector<std::shared_ptr<Communicator>> comms;
  HostGroup* group = make_group(3, &comms);
  group->set_wait_timeout_ms(60000);
  std::vector<Status> st(2);
  const auto t0 = Clock::now();
  std::thread a([&] { st[0] = group->barrier(0, "combine-done"); });
  std::thread b([&] { st[1] = group->barrier(1, "combine-done"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  group->abort(2, "rank 2 refused its inputs", StatusCode::kInvalidArgument);
  a.join();
  b.join();
  EXPECT_LT(seconds_since(t0), 5.0);
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("rank 2 refused its inputs"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("combine-done"), std::string::npos) << s.message();
  }
  group->abort(0, "a later reason");  // the first reason wins
  Status later = group->check(1);
  EXPECT_NE(later.message().find("rank 2 refused its inputs"), std::string::npos);
  EXPECT_EQ(later.message().find("a later reason"), std::string::npos);
}

TEST(HostGroup, DifferentStagesAtOneEpochAbortInsteadOfWaiting) {
  std::vector<std::shared_ptr<Communicator>> comms;
  HostGroup* group = make_group(2, &comms);
  group->set_wait_timeout_ms(60000);
  Status s0, s1;
  const auto t0 = Clock::now();
  std::thread a([&] { s0 = group->barrier(0, "warmup-exchange"); });
  std::thread b([&] { s1 = group->barrier(1, "dispatch-ready"); });
  a.join();
  b.join();
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_EQ(s0.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s1.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s0.message().find("collective order broken"), std::string::npos) << s0.message();
  EXPECT_NE(s1.message().find("collective order broken"), std::string::npos) << s1.message();
}

// ------------------------------------------------------------------------------------------------
// Protocol stages, driven directly

class EpProtocol : public testing::TestWithParam<ProtocolCase> {};

TEST_P(EpProtocol, StagesMatchTheTruth) {
  const ProtocolCase c = GetParam();
  const int R = c.ep_size;
  MoeGeometry g;
  g.hidden = kH, g.intermediate = kI, g.num_experts = kE, g.top_k = kK, g.ep_size = R, g.max_tokens_per_rank = kTMax;
  reference::MoeProblem problem = reference::make_random_problem(g, 1234 + R, token_pattern(R), c.routing);
  // Rank tags: element 0 = source rank, element 1 = token (exact in bf16).
  for (int s = 0; s < R; ++s)
    for (int64_t t = 0; t < problem.ranks[s].num_tokens; ++t) {
      problem.ranks[s].x_bf16[t * kH + 0] = fmt::float_to_bf16(static_cast<float>(s + 1));
      problem.ranks[s].x_bf16[t * kH + 1] = fmt::float_to_bf16(static_cast<float>(t + 1));
    }

  WorkspaceParams params;
  params.ep_size = R, params.experts_per_rank = kE / R, params.top_k = kK, params.hidden = kH, params.intermediate = kI;
  params.max_tokens_per_rank = kTMax, params.segment_align = c.block_m, params.dispatch_format = c.dispatch_format;
  params.intermediate_format = kWsFp8Block, params.combine_format = c.combine_format;
  const WorkspaceLayout layout = WorkspaceLayout::make(params);
  const int64_t El = params.experts_per_rank, BM = c.block_m;

  std::vector<std::unique_ptr<Buffer>> ws;
  std::vector<void*> bases;
  for (int r = 0; r < R; ++r) {
    ws.push_back(std::make_unique<Buffer>(layout.total_bytes));
    reference::poison_workspace(layout, ws.back()->p);
    bases.push_back(ws.back()->p);
  }
  std::vector<std::shared_ptr<Communicator>> comms;
  HostGroup* group = make_group(R, &comms);
  group->set_wait_timeout_ms(20000);

  std::vector<reference::DispatchPlan> plans(R);
  std::vector<std::vector<uint8_t>> wire_rows(R);
  std::vector<std::vector<float>> wire_scales(R);
  std::vector<std::vector<uint16_t>> y(R);
  std::vector<Status> st(R);
  const reference::ExpertFn identity = [](int64_t, const float* x, float* out) { std::memcpy(out, x, kH * 4); };
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r]() {
      const reference::RankInputs& in = problem.ranks[r];
      const int64_t T = in.num_tokens;
      auto step = [&]() -> Status {
        MEGAMOE_RETURN_IF_ERROR(reference::compute_layout(layout, T, in.topk_ids.data(), &plans[r]));
        TensorView x(const_cast<uint16_t*>(in.x_bf16.data()), DType::kBFloat16, {T, kH});
        reference::encode_dispatch_rows(layout, false, x, TensorView(), &wire_rows[r], &wire_scales[r]);
        MEGAMOE_RETURN_IF_ERROR(group->barrier(r, "dispatch-ready"));
        reference::DispatchSource src{T, wire_rows[r].data(), wire_scales[r].empty() ? nullptr : wire_scales[r].data(),
                                      in.topk_ids.data(), in.topk_weights.data()};
        reference::dispatch(layout, r, bases, plans[r], src);
        MEGAMOE_RETURN_IF_ERROR(group->barrier(r, "dispatch-done"));
        MEGAMOE_RETURN_IF_ERROR(reference::build_expert_pool(layout, bases[r]));
        std::vector<float> fc2;
        reference::run_experts(layout, bases[r], reference::ExpertWeightsF32{}, false, identity, &fc2);
        reference::PeerTargets peers;
        peers.bases = bases;
        reference::combine_send(layout, bases[r], fc2, peers);
        MEGAMOE_RETURN_IF_ERROR(group->barrier(r, "combine-done"));
        y[r].assign(T * kH, 0xFFFF);
        reference::combine_reduce(layout, bases[r], T, in.topk_ids.data(), y[r].data());
        return Status::ok();
      };
      st[r] = step();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();

  const int64_t row_bytes = kH * ws_elem_bytes(c.dispatch_format), nb = kH / 128;
  const bool fp8 = c.dispatch_format == kWsFp8Block;
  for (int s = 0; s < R; ++s) {
    // Layout: per-rank and per-expert counts equal the truth.
    const reference::RankInputs& in = problem.ranks[s];
    std::vector<int32_t> truth_rank(R, 0), truth_expert(kE, 0);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      std::set<int> owners;
      for (int64_t j = 0; j < kK; ++j) {
        const int32_t e = in.topk_ids[t * kK + j];
        if (e < 0) continue;
        ++truth_expert[e];
        owners.insert(e / El);
      }
      for (int o : owners) ++truth_rank[o];
    }
    EXPECT_EQ(plans[s].rank_token_counts, truth_rank) << "source " << s;
    EXPECT_EQ(plans[s].expert_counts, truth_expert) << "source " << s;
  }

  for (int r = 0; r < R; ++r) {
    void* base = bases[r];
    const int32_t* token_counts = layout.at<int32_t>(base, layout.recv_token_counts);
    const int32_t* expert_counts = layout.at<int32_t>(base, layout.recv_expert_counts);
    std::vector<int64_t> rows_per_expert(El, 0);
    for (int s = 0; s < R; ++s) {
      const reference::RankInputs& in = problem.ranks[s];
      ASSERT_EQ(token_counts[s], plans[s].rank_token_counts[r]) << "owner " << r << " source " << s;
      for (int64_t e = 0; e < El; ++e) {
        EXPECT_EQ(expert_counts[s * El + e], plans[s].expert_counts[r * El + e]);
        rows_per_expert[e] += expert_counts[s * El + e];
      }
      // Each token once per destination, compacted in token order, payload and metadata exact.
      int64_t prev_token = -1;
      for (int64_t i = 0; i < token_counts[s]; ++i) {
        const int64_t recv_row = s * kTMax + i;
        reference::TokenMetaRef meta = reference::meta_row(layout, base, recv_row);
        const int64_t t = meta.src_token();
        ASSERT_GT(t, prev_token) << "rows from one source are in token order, each token once";
        ASSERT_LT(t, in.num_tokens);
        prev_token = t;
        bool any_here = false;
        for (int64_t j = 0; j < kK; ++j) {
          const int32_t e = in.topk_ids[t * kK + j];
          const bool here = e >= 0 && e / El == r;
          any_here |= here;
          EXPECT_EQ(meta.local_expert(j), here ? e - r * El : -1);
          EXPECT_EQ(meta.weight(j), here ? in.topk_weights[t * kK + j] : 0.0f);
        }
        EXPECT_TRUE(any_here) << "token " << t << " of rank " << s << " sent to rank " << r << " without an expert there";
        const uint8_t* row = layout.at<uint8_t>(base, layout.recv_tokens) + recv_row * row_bytes;
        EXPECT_EQ(std::memcmp(row, wire_rows[s].data() + t * row_bytes, row_bytes), 0) << "payload of (" << s << ", " << t << ")";
        if (fp8) {
          EXPECT_EQ(std::memcmp(layout.at<float>(base, layout.recv_scales) + recv_row * nb,
                                wire_scales[s].data() + t * nb, nb * 4), 0);
        } else {  // the rank tag itself
          const uint16_t* tag = reinterpret_cast<const uint16_t*>(row);
          EXPECT_EQ(fmt::bf16_to_float(tag[0]), s + 1.0f);
          EXPECT_EQ(fmt::bf16_to_float(tag[1]), t + 1.0f);
        }
      }
    }

    // Expert pool: segments padded to BM, ordered by (expert, source, arrival), padding -1 / zero.
    const int32_t* offsets = layout.at<int32_t>(base, layout.expert_offsets);
    const int32_t* pool_src = layout.at<int32_t>(base, layout.pool_src);
    const uint8_t* pool_x = layout.at<uint8_t>(base, layout.pool_x);
    ASSERT_EQ(offsets[0], 0);
    for (int64_t e = 0; e < El; ++e) {
      ASSERT_EQ(offsets[e + 1] - offsets[e], (rows_per_expert[e] + BM - 1) / BM * BM) << "expert " << e;
      ASSERT_EQ(offsets[e] % BM, 0);
      int64_t prev = -1;
      for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
        const int64_t n = row - offsets[e];
        if (n >= rows_per_expert[e]) {
          EXPECT_EQ(pool_src[row], -1) << "padding row " << row;
          for (int64_t b = 0; b < row_bytes; ++b) ASSERT_EQ(pool_x[row * row_bytes + b], 0) << "padding row " << row;
          continue;
        }
        const int64_t recv_row = pool_src[row] / kK, slot = pool_src[row] % kK;
        ASSERT_GT(recv_row, prev) << "expert " << e << " rows ordered by (source, arrival)";
        prev = recv_row;
        EXPECT_EQ(reference::meta_row(layout, base, recv_row).local_expert(slot), e);
        EXPECT_EQ(std::memcmp(pool_x + row * row_bytes, layout.at<uint8_t>(base, layout.recv_tokens) + recv_row * row_bytes,
                              row_bytes), 0);
      }
    }
    ASSERT_LE(offsets[El], layout.pool_rows);
  }

  // combine(dispatch(x)) with identity experts: y[t] = bf16(sum_j decode(encode(w_j * x_wire[t]))), slot order.
  for (int s = 0; s < R; ++s) {
    const reference::RankInputs& in = problem.ranks[s];
    std::vector<float> xq(kH), partial(kH), wire_dec(kH), acc(kH);
    std::vector<uint8_t> wire(layout.wire_row_bytes);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const uint8_t* row = wire_rows[s].data() + t * row_bytes;
      if (fp8) fmt::dequantize_fp8_1x128(row, wire_scales[s].data() + t * nb, kH, xq.data());
      else for (int64_t h = 0; h < kH; ++h) xq[h] = fmt::bf16_to_float(reinterpret_cast<const uint16_t*>(row)[h]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < kK; ++j) {
        if (in.topk_ids[t * kK + j] < 0) continue;
        for (int64_t h = 0; h < kH; ++h) partial[h] = fmt::mul_rn(in.topk_weights[t * kK + j], xq[h]);
        reference::encode_combine_row(c.combine_format, partial.data(), kH, wire.data());
        reference::decode_combine_row(c.combine_format, wire.data(), kH, wire_dec.data());
        for (int64_t h = 0; h < kH; ++h) acc[h] += wire_dec[h];
      }
      for (int64_t h = 0; h < kH; ++h)
        ASSERT_EQ(y[s][t * kH + h], fmt::float_to_bf16(acc[h])) << "rank " << s << " token " << t << " h " << h;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EpProtocol,
    testing::Values(ProtocolCase{1, Routing::kUniform, kWsBf16, kWsBf16, 128},
                    ProtocolCase{1, Routing::kWithDropped, kWsFp8Block, kWsNvfp4, 64},
                    ProtocolCase{2, Routing::kUniform, kWsBf16, kWsBf16, 128},
                    ProtocolCase{2, Routing::kUniform, kWsFp8Block, kWsBf16, 64},
                    ProtocolCase{2, Routing::kWithDropped, kWsFp8Block, kWsMxfp8, 128},
                    ProtocolCase{2, Routing::kSingleExpert, kWsBf16, kWsNvfp4, 64},
                    ProtocolCase{4, Routing::kUniform, kWsBf16, kWsBf16, 64},
                    ProtocolCase{4, Routing::kWithDropped, kWsBf16, kWsBf16, 128},
                    ProtocolCase{4, Routing::kSingleExpert, kWsFp8Block, kWsBf16, 128},
                    ProtocolCase{4, Routing::kUniform, kWsFp8Block, kWsNvfp4, 128},
                    ProtocolCase{8, Routing::kUniform, kWsBf16, kWsBf16, 128},
                    ProtocolCase{8, Routing::kWithDropped, kWsFp8Block, kWsBf16, 64},
                    ProtocolCase{8, Routing::kSingleExpert, kWsBf16, kWsBf16, 64},
                    ProtocolCase{8, Routing::kUniform, kWsFp8Block, kWsMxfp8, 128}),
    case_name);

// ------------------------------------------------------------------------------------------------
// The same protocol through the layer (MoeLayer::create, host group, one thread per rank)

MoeConfig identity_config() {
  MoeConfig c;
  c.backend = Backend::kCpu;
  c.weight_format = WeightFormat::kBf16;
  c.dispatch_format = DispatchFormat::kBf16;
  c.combine_dtype = CombineDtype::kBf16;
  return c;
}

void install_identity_experts(reference::GroupRunner& runner) {
  for (int r = 0; r < runner.size(); ++r) {
    auto* cpu = dynamic_cast<CpuMoeLayer*>(runner.layer(r));
    ASSERT_NE(cpu, nullptr);
    cpu->set_expert_fn_for_testing([](int64_t, const float* x, float* out) { std::memcpy(out, x, kH * 4); });
  }
}

class LayerIdentity : public testing::TestWithParam<std::tuple<int, Routing>> {};

// combine(dispatch(x)) == x * fan-out, bitwise, with unit routing weights and the bf16 wire.
TEST_P(LayerIdentity, CombineOfDispatchIsXTimesFanOut) {
  const int R = std::get<0>(GetParam());
  const Routing routing = std::get<1>(GetParam());
  MoeGeometry g;
  g.hidden = kH, g.intermediate = kI, g.num_experts = kE, g.top_k = kK, g.ep_size = R, g.max_tokens_per_rank = kTMax;
  reference::MoeProblem problem = reference::make_random_problem(g, 99 + R, token_pattern(R), routing);
  for (auto& in : problem.ranks)
    for (float& w : in.topk_weights) w = 1.0f;
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(problem, identity_config(), &runner).is_ok());
  install_identity_experts(*runner);
  for (int iteration = 0; iteration < 2; ++iteration) {  // the second forward reuses the workspace
    std::vector<std::vector<uint16_t>> y;
    Status st = runner->forward_all(&y);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    for (int r = 0; r < R; ++r) {
      const auto& in = problem.ranks[r];
      for (int64_t t = 0; t < in.num_tokens; ++t) {
        int fan_out = 0;
        for (int64_t j = 0; j < kK; ++j) fan_out += in.topk_ids[t * kK + j] >= 0 ? 1 : 0;
        for (int64_t h = 0; h < kH; ++h) {
          // A token with no slots gets +0 (not 0 * x, which is -0 for a negative x).
          const float want = fan_out == 0 ? 0.0f : static_cast<float>(fan_out) * fmt::bf16_to_float(in.x_bf16[t * kH + h]);
          ASSERT_EQ(y[r][t * kH + h], fmt::float_to_bf16(want))
              << "rank " << r << " token " << t << " h " << h << " fan-out " << fan_out;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, LayerIdentity,
                         testing::Combine(testing::Values(1, 2, 4, 8),
                                          testing::Values(Routing::kUniform, Routing::kSingleExpert,
                                                          Routing::kWithDropped)),
                         [](const testing::TestParamInfo<std::tuple<int, Routing>>& info) {
                           return "EP" + std::to_string(std::get<0>(info.param)) + "_" +
                                  reference::to_string(std::get<1>(info.param));
                         });

// ------------------------------------------------------------------------------------------------
// run_experts against quantisation points 2..5 written out plainly: one pool row and one dot product
// at a time, each an fp64 sum in k order rounded once to fp32. Every fc2 value and every byte of the
// intermediate region (and its scales) must match bit for bit, on 1 and on several threads.

float plain_dot(const float* a, const float* b, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return static_cast<float>(acc);
}

struct ExpertFfnCase {
  WeightFormat weight_format;
  DispatchFormat dispatch_format;
  bool pow2_scales;
  Routing routing;
};

class RunExpertsBits : public testing::TestWithParam<ExpertFfnCase> {};

TEST_P(RunExpertsBits, EqualsPlainDotProducts_AnyWorkerCount) {
  const ExpertFfnCase c = GetParam();
  // 4 experts, 61 tokens, top-2 (some slots dropped): 15..37 rows per expert, so several work
  // units per expert, full and partial row tiles, and padding rows.
  MoeGeometry g;
  g.hidden = 384, g.intermediate = 256, g.num_experts = 4, g.top_k = 2, g.ep_size = 1, g.max_tokens_per_rank = 64;
  const int64_t H = g.hidden, I = g.intermediate, E = g.num_experts, k = g.top_k, T = 61;
  reference::MoeProblem problem = reference::make_random_problem(g, 21, {T}, c.routing);
  MoeConfig cfg;
  cfg.backend = Backend::kCpu;
  cfg.weight_format = c.weight_format;
  cfg.dispatch_format = c.dispatch_format;
  cfg.combine_dtype = CombineDtype::kBf16;
  cfg.pow2_scales = c.pow2_scales;
  std::unique_ptr<MoeLayer> layer;
  ASSERT_TRUE(MoeLayer::create(g, cfg, reference::local_weights(problem, 0), nullptr, &layer).is_ok());
  auto& in = problem.ranks[0];
  std::vector<uint16_t> y(T * H);
  // A forward fills the expert pool; run_experts then runs again on it below.
  ASSERT_TRUE(layer->forward(TensorView(in.x_bf16.data(), DType::kBFloat16, {T, H}),
                             TensorView(in.topk_ids.data(), DType::kInt32, {T, k}),
                             TensorView(in.topk_weights.data(), DType::kFloat32, {T, k}),
                             TensorView(y.data(), DType::kBFloat16, {T, H}))
                  .is_ok());
  auto* cpu = dynamic_cast<CpuMoeLayer*>(layer.get());
  ASSERT_NE(cpu, nullptr);
  const WorkspaceLayout& l = cpu->layout();
  void* base = cpu->workspace_base();
  reference::ExpertWeightsF32 weights;
  weights.num_experts = E, weights.hidden = H, weights.intermediate = I;
  layer->prepared_weights().w13.dequantize(&weights.w13);
  layer->prepared_weights().w2.dequantize(&weights.w2);

  const bool fp8_x = l.params.dispatch_format == kWsFp8Block, fp8_h = l.params.intermediate_format == kWsFp8Block;
  const int64_t x_bytes = H * ws_elem_bytes(l.params.dispatch_format);
  const int64_t h_bytes = I * ws_elem_bytes(l.params.intermediate_format);
  const int32_t* offsets = l.at<int32_t>(base, l.expert_offsets);
  const int32_t* pool_src = l.at<int32_t>(base, l.pool_src);
  const int64_t pool_rows = offsets[E];
  // The truth, row by row.
  std::vector<float> want_fc2(pool_rows * H, 0.0f);
  std::vector<uint8_t> want_h(pool_rows * h_bytes, 0xAB);
  std::vector<float> want_h_scales(pool_rows * (I / 128), 0.0f);
  std::vector<float> x(H), h(I), hq(I);
  int64_t real_rows = 0, min_rows = pool_rows, max_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t rows_here = 0;
    for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
      if (pool_src[row] < 0) continue;
      ++rows_here;
      const uint8_t* xr = l.at<uint8_t>(base, l.pool_x) + row * x_bytes;
      if (fp8_x) {
        fmt::dequantize_fp8_1x128(xr, l.at<float>(base, l.pool_x_scales) + row * (H / 128), H, x.data());
      } else {
        for (int64_t c2 = 0; c2 < H; ++c2) x[c2] = fmt::bf16_to_float(reinterpret_cast<const uint16_t*>(xr)[c2]);
      }
      const float* w13 = weights.w13.data() + e * 2 * I * H;
      for (int64_t i = 0; i < I; ++i) {
        const float gate = plain_dot(x.data(), w13 + i * H, H), up = plain_dot(x.data(), w13 + (I + i) * H, H);
        h[i] = gate / (1.0f + std::exp(-gate)) * up;
      }
      uint8_t* q = want_h.data() + row * h_bytes;
      if (fp8_h) {
        fmt::quantize_fp8_1x128(h.data(), I, q, want_h_scales.data() + row * (I / 128), c.pow2_scales);
        fmt::dequantize_fp8_1x128(q, want_h_scales.data() + row * (I / 128), I, hq.data());
      } else {
        for (int64_t i = 0; i < I; ++i) {
          reinterpret_cast<uint16_t*>(q)[i] = fmt::float_to_bf16(h[i]);
          hq[i] = fmt::bf16_to_float(reinterpret_cast<uint16_t*>(q)[i]);
        }
      }
      const float* w2 = weights.w2.data() + e * H * I;
      for (int64_t c2 = 0; c2 < H; ++c2) want_fc2[row * H + c2] = plain_dot(hq.data(), w2 + c2 * I, I);
    }
    real_rows += rows_here;
    min_rows = std::min(min_rows, rows_here);
    max_rows = std::max(max_rows, rows_here);
  }
  ASSERT_GT(max_rows, 16) << "the case must span several work units of one expert";

  for (int workers : {1, 3, 8}) {
    uint8_t* inter = l.at<uint8_t>(base, l.intermediate);
    float* inter_scales = l.at<float>(base, l.intermediate_scales);
    for (int64_t row = 0; row < pool_rows; ++row) {  // padding rows must stay untouched
      std::memset(inter + row * h_bytes, 0xAB, h_bytes);
      if (fp8_h) std::memset(inter_scales + row * (I / 128), 0, (I / 128) * sizeof(float));
    }
    std::vector<float> fc2;
    reference::run_experts(l, base, weights, c.pow2_scales, reference::ExpertFn(), &fc2, workers, 0);
    ASSERT_EQ(fc2.size(), want_fc2.size());
    int64_t bad = 0, first_bad = -1;
    for (size_t i = 0; i < fc2.size(); ++i) {
      if (std::memcmp(&fc2[i], &want_fc2[i], sizeof(float)) != 0 && bad++ == 0) first_bad = static_cast<int64_t>(i);
    }
    EXPECT_EQ(bad, 0) << "workers=" << workers << ": fc2 values differing from the plain sums, first at row "
                      << first_bad / H << " column " << first_bad % H;
    EXPECT_EQ(std::memcmp(inter, want_h.data(), want_h.size()), 0) << "workers=" << workers << ": intermediate";
    if (fp8_h) {
      EXPECT_EQ(std::memcmp(inter_scales, want_h_scales.data(), want_h_scales.size() * sizeof(float)), 0)
          << "workers=" << workers << ": intermediate scales";
    }
  }
  std::printf("%lld real rows of %lld pool rows, %lld..%lld per expert\n", static_cast<long long>(real_rows),
              static_cast<long long>(pool_rows), static_cast<long long>(min_rows), static_cast<long long>(max_rows));
}

INSTANTIATE_TEST_SUITE_P(
    Formats, RunExpertsBits,
    testing::Values(ExpertFfnCase{WeightFormat::kFp8Block, DispatchFormat::kFp8Block, false, Routing::kUniform},
                    ExpertFfnCase{WeightFormat::kFp8Block, DispatchFormat::kFp8Block, true, Routing::kWithDropped},
                    ExpertFfnCase{WeightFormat::kBf16, DispatchFormat::kBf16, false, Routing::kWithDropped},
                    ExpertFfnCase{WeightFormat::kNvfp4, DispatchFormat::kBf16, false, Routing::kUniform}),
    [](const testing::TestParamInfo<ExpertFfnCase>& info) {
      const ExpertFfnCase& c = info.param;
      const char* w = c.weight_format == WeightFormat::kFp8Block ? "Wfp8"
                      : c.weight_format == WeightFormat::kBf16   ? "Wbf16"
                                                                 : "Wnvfp4";
      return std::string(w) + (c.dispatch_format == DispatchFormat::kFp8Block ? "_Dfp8" : "_Dbf16") +
             (c.pow2_scales ? "_Pow2_" : "_") + reference::to_string(c.routing);
    });

TEST(LayerTimeout, RankThatSkipsAForwardMakesPeersReportStageAndPeer) {
  MoeGeometry g;
  g.hidden = kH, g.intermediate = kI, g.num_experts = kE, g.top_k = kK, g.ep_size = 4, g.max_tokens_per_rank = kTMax;
  reference::MoeProblem problem = reference::make_random_problem(g, 7, token_pattern(4));
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(problem, identity_config(), &runner).is_ok());
  install_identity_experts(*runner);
  ASSERT_TRUE(runner->warmup_all().is_ok());
  runner->group()->set_wait_timeout_ms(200);

  std::vector<std::vector<uint16_t>> y;
  std::vector<Status> st;
  const auto t0 = Clock::now();
  Status first = runner->forward_all(&y, &st, {false, false, true, false});
  const double elapsed = seconds_since(t0);
  EXPECT_FALSE(first.is_ok());
  EXPECT_LT(elapsed, 5.0) << "no hang";
  bool cell_written = false;
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(st[r].code(), StatusCode::kTimeout) << st[r].to_string();
    EXPECT_NE(st[r].message().find("'dispatch-ready'"), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find("peers [2]"), std::string::npos) << st[r].message();
    const WaitError cell = dynamic_cast<CpuMoeLayer*>(runner->layer(r))->last_wait_error();
    if (cell.flag) {
      cell_written = true;
      EXPECT_EQ(cell.rank, r);
      EXPECT_EQ(cell.stage, reference::kStageDispatchReady);
      EXPECT_EQ(cell.peer, 2);
      EXPECT_EQ(cell.expected, 4);
      EXPECT_EQ(cell.seen, 3);
    }
  }
  EXPECT_TRUE(cell_written) << "the rank that timed out records (rank, stage, peer, expected, seen)";
  std::printf("peers reported after %.3f s: %s\n", elapsed, st[0].message().c_str());

  // The group is aborted: every rank now fails fast with the first reason.
  const auto t1 = Clock::now();
  Status again = runner->forward_all(&y, &st);
  EXPECT_LT(seconds_since(t1), 1.0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kTimeout) << st[r].to_string();
    EXPECT_NE(st[r].message().find("peers [2]"), std::string::npos) << st[r].message();
  }
}

}  // namespace
}  // namespace megamoe
