// EP transport over symmetric memory: 2 GPUs over NCCL (ncclCommInitAll group) where there are two,
// else 2 logical ranks sharing GPU 0; one thread per rank.
// Every test checks exact bytes against the host truth built with the fmt:: codecs.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>

#include "comm/gpu_comm.h"
#include "rank_stream.h"
#include "test_transport_harness.h"

namespace megamoe {
namespace test {
namespace {

using gpu_test::drop_rank_stream;
using gpu_test::make_rank_stream;

constexpr int kRanks = 2;

#define REQUIRE_GROUP(group)                                  \
  std::string _reason;                                        \
  auto* group = transport_group(kRanks, &_reason);                 \
  if (!group) GTEST_SKIP() << _reason;

struct RankRun {
  std::unique_ptr<EpTransport> transport;
  const Communicator* comm = nullptr;  // the rank's communicator (its stream's owner on a shared GPU)
  cudaStream_t stream = nullptr;
  RankInputs in;
  std::unique_ptr<DeviceBuffer> x, x_scale, ids, weights, y, expert_out;
};

// Builds the transport and uploads the inputs of `rank`.
void setup_rank(const Case& c, std::shared_ptr<Communicator> comm, int rank, RankRun* run) {
  EpTransportOptions o;
  o.params = c.params();
  o.pow2_scales = c.pow2_scales;
  o.num_sms = c.num_sms;
  o.combine_groups = c.combine_groups;
  MEGAMOE_ASSERT_OK(EpTransport::create(comm, o, &run->transport));
  run->comm = comm.get();
  run->stream = make_rank_stream(run->comm);
  ASSERT_NE(run->stream, nullptr);
  MEGAMOE_ASSERT_OK(run->transport->warmup(run->stream));
  run->in = c.inputs(rank);
  const int64_t T = run->in.num_tokens, H = c.hidden, k = c.top_k;
  run->x.reset(new DeviceBuffer(std::max<int64_t>(T * H * 2, 16)));
  run->ids.reset(new DeviceBuffer(std::max<int64_t>(T * k * 4, 16)));
  run->weights.reset(new DeviceBuffer(std::max<int64_t>(T * k * 4, 16)));
  run->y.reset(new DeviceBuffer(std::max<int64_t>(T * H * 2, 16)));
  if (c.x_fp8) {
    run->x->upload(run->in.x_fp8);
    run->x_scale.reset(new DeviceBuffer(std::max<int64_t>(T * (H / 128) * 4, 16)));
    run->x_scale->upload(run->in.x_scale);
  } else {
    run->x->upload(run->in.x);
  }
  run->ids->upload(run->in.topk_ids);
  run->weights->upload(run->in.topk_weights);
  // The FC2 output the combine reads (filled per test): allocated here, before the barrier.
  const WorkspaceLayout& l = run->transport->layout();
  run->expert_out.reset(new DeviceBuffer(std::max<int64_t>(l.pool_rows * H * 4, 16)));
  run->expert_out->upload(std::vector<float>(static_cast<size_t>(l.pool_rows * H), 0.f));
  // Every rank set up (allocations, synchronous uploads) before any dispatches: on a shared GPU a
  // rank's dispatch kernel would otherwise wait (bounded) through its peer's setup.
  const Status b = gpu_rank_of(comm.get())->barrier("setup", 30000);
  ASSERT_TRUE(b.is_ok()) << b.to_string();
}

void teardown_rank(RankRun* run) {
  if (run->stream) cudaStreamSynchronize(run->stream);
  if (run->transport) {  // collective and bounded: every rank does it on its own thread
    const Status st = run->transport->release(30000);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  run->transport.reset();
  drop_rank_stream(run->comm, run->stream);
}

TensorView view(DeviceBuffer* b, DType dt, std::initializer_list<int64_t> shape, int dev) {
  return TensorView(b ? b->ptr : nullptr, dt, shape, Device::cuda(device_of_rank(dev)));
}

Status dispatch_once(const Case& c, RankRun* run, int rank) {
  const int64_t T = run->in.num_tokens;
  if (c.x_fp8)
    return run->transport->dispatch(view(run->x.get(), DType::kFloat8E4M3, {T, c.hidden}, rank),
                                    view(run->x_scale.get(), DType::kFloat32, {T, c.hidden / 128}, rank),
                                    view(run->ids.get(), DType::kInt32, {T, c.top_k}, rank),
                                    view(run->weights.get(), DType::kFloat32, {T, c.top_k}, rank), run->stream);
  return run->transport->dispatch(view(run->x.get(), DType::kBFloat16, {T, c.hidden}, rank), TensorView(),
                                  view(run->ids.get(), DType::kInt32, {T, c.top_k}, rank),
                                  view(run->weights.get(), DType::kFloat32, {T, c.top_k}, rank), run->stream);
}

// Fused: send_and_combine() (one kernel); split: combine_send() then combine(). Same bits.
Status combine_once(const Case& c, RankRun* run, int rank, bool fused = true) {
  const int64_t T = run->in.num_tokens;
  const WorkspaceLayout& l = run->transport->layout();
  const TensorView out = view(run->expert_out.get(), DType::kFloat32, {l.pool_rows, c.hidden}, rank);
  const TensorView ids = view(run->ids.get(), DType::kInt32, {T, c.top_k}, rank);
  const TensorView y = view(run->y.get(), DType::kBFloat16, {T, c.hidden}, rank);
  if (fused) return run->transport->send_and_combine(out, ids, y, run->stream);
  MEGAMOE_RETURN_IF_ERROR(run->transport->combine_send(out, run->stream));
  return run->transport->combine(ids, y, run->stream);
}

Status forward(const Case& c, RankRun* run, int rank, bool fused = true) {
  MEGAMOE_RETURN_IF_ERROR(dispatch_once(c, run, rank));
  MEGAMOE_RETURN_IF_ERROR(run->transport->build_expert_pool(run->stream));
  return combine_once(c, run, rank, fused);
}

// Rows [first, last) of `ranges` of a region of `row_bytes`-wide rows, every other byte zero: only
// what the transport wrote is copied (compute-sanitizer's initcheck reports a copy of bytes that
// nothing wrote, such as the receive rows past a source's count).
// Copies on the rank's own stream (see DeviceBuffer), complete on return.
template <typename T>
std::vector<T> read_rows(const EpTransport& t, const WorkspaceRegion& r, int64_t row_bytes,
                         const std::vector<std::pair<int64_t, int64_t>>& ranges, cudaStream_t stream) {
  std::vector<T> v(r.bytes / sizeof(T));
  char* host = reinterpret_cast<char*>(v.data());
  for (const auto& [first, last] : ranges) {
    const int64_t begin = first * row_bytes, end = std::min<int64_t>(last * row_bytes, r.bytes);
    if (end > begin)
      cudaMemcpyAsync(host + begin, static_cast<const char*>(t.base()) + r.offset + begin,
                      static_cast<size_t>(end - begin), cudaMemcpyDeviceToHost, stream);
  }
  cudaStreamSynchronize(stream);
  return v;
}

template <typename T>
std::vector<T> read_region(const EpTransport& t, const WorkspaceRegion& r, cudaStream_t stream) {
  return read_rows<T>(t, r, 1, {{0, static_cast<int64_t>(r.bytes)}}, stream);  // every byte
}

std::vector<uint16_t> download_y(const RankRun& run, int64_t n) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  if (n > 0) cudaMemcpyAsync(v.data(), run.y->ptr, static_cast<size_t>(n) * 2, cudaMemcpyDeviceToHost, run.stream);
  cudaStreamSynchronize(run.stream);
  return v;
}

void poison_y(const RankRun& run, int64_t n) {
  if (n > 0) cudaMemsetAsync(run.y->ptr, 0xFF, static_cast<size_t>(n) * 2, run.stream);
}

// The pool rows the host truth says the pool build writes (wire rows of the received tokens, zero
// padding), for the identity experts' FC2 output before any rank launches.
void truth_pool(const Case& c, const std::vector<RankInputs>& all, const Truth& tr, std::vector<uint8_t>* pool_x,
                std::vector<float>* pool_scales, int64_t pool_rows) {
  const int64_t H = c.hidden, k = c.top_k, T_max = c.max_tokens, row_bytes = H * ws_elem_bytes(c.dispatch_format);
  pool_x->assign(static_cast<size_t>(pool_rows * row_bytes), 0);
  pool_scales->assign(static_cast<size_t>(pool_rows * (H / 128)), 0.f);
  for (size_t p = 0; p < tr.pool_src.size(); ++p) {
    const int32_t src = tr.pool_src[p];
    if (src < 0) continue;
    const int64_t row = src / k, s = row / T_max, tok = tr.recv_src_token[s][row % T_max];
    std::vector<uint8_t> bytes;
    std::vector<float> scales;
    encode_wire_row(c, &all[s].x[tok * H], &bytes, &scales);
    std::memcpy(&(*pool_x)[p * row_bytes], bytes.data(), static_cast<size_t>(row_bytes));
    if (c.dispatch_format == kWsFp8Block) std::memcpy(&(*pool_scales)[p * (H / 128)], scales.data(), scales.size() * 4);
  }
}

// Full check of one forward (fused combine): receive regions, pool, output; then `repeats` more
// forwards, the even ones with the split combine (combine_send + combine), and with `graph` CUDA-graph
// replays, must give the same y bit for bit.
// seed_launches > 0: the signal cells start as if that many forwards had run (seed_epoch_for_test).
void run_case(const Case& c, int repeats = 1, bool graph = false, uint64_t seed_launches = 0) {
  REQUIRE_GROUP(group);
  std::vector<RankInputs> all;
  for (int r = 0; r < kRanks; ++r) all.push_back(c.inputs(r));
  run_ranks(kRanks, [&](int rank) {
    RankRun run;
    setup_rank(c, (*group)[rank], rank, &run);
    if (::testing::Test::HasFatalFailure()) return teardown_rank(&run);
    if (seed_launches > 0) {  // every rank seeded before any rank dispatches
      EXPECT_TRUE(run.transport->seed_epoch_for_test(seed_launches).is_ok());
      const Status b = gpu_rank_of((*group)[rank].get())->barrier("seed-epoch", 30000);
      ASSERT_TRUE(b.is_ok()) << b.to_string();
    }
    const EpTransport& t = *run.transport;
    const WorkspaceLayout& l = t.layout();
    const int64_t H = c.hidden, k = c.top_k, El = c.num_experts / kRanks, T_max = c.max_tokens;
    const Truth tr = protocol_truth(c, all, rank);
    // Identity experts: FC2's output is the dequantised pool row, computed from the truth and
    // uploaded before any rank launches. Each forward's kernels then go out back to back and every
    // check reads the regions afterwards: on a shared GPU a rank's host work between its kernels
    // would leave the peer's kernels waiting (bounded) for it.
    {
      std::vector<uint8_t> want_pool_x;
      std::vector<float> want_pool_scales;
      truth_pool(c, all, tr, &want_pool_x, &want_pool_scales, l.pool_rows);
      const std::vector<float> expert_out = identity_expert_out(c, l, want_pool_x, want_pool_scales);
      EXPECT_LE(expert_out.size() * 4, run.expert_out->bytes);
      run.expert_out->upload(expert_out);
    }
    const Status ready = gpu_rank_of((*group)[rank].get())->barrier("expert-out", 30000);
    ASSERT_TRUE(ready.is_ok()) << ready.to_string();

    EXPECT_TRUE(forward(c, &run, rank).is_ok());  // dispatch, pool build, one-kernel combine
    Status st = run.transport->check_error(run.stream);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(read_region<int32_t>(t, l.recv_token_counts, run.stream), tr.recv_token_counts) << "rank " << rank;
    std::vector<std::pair<int64_t, int64_t>> received;  // each source's segment of receive rows
    for (int s = 0; s < kRanks; ++s)
      received.emplace_back(s * T_max, s * T_max + static_cast<int64_t>(tr.recv_src_token[s].size()));
    const int64_t row_bytes = H * ws_elem_bytes(c.dispatch_format);
    const auto recv_x = read_rows<uint8_t>(t, l.recv_tokens, row_bytes, received, run.stream);
    const auto recv_scales = read_rows<float>(t, l.recv_scales, (H / 128) * 4, received, run.stream);
    const auto recv_meta = read_rows<uint8_t>(t, l.recv_meta, l.meta_bytes, received, run.stream);
    int64_t bad_rows = 0;
    for (int s = 0; s < kRanks; ++s) {
      for (size_t i = 0; i < tr.recv_src_token[s].size(); ++i) {
        const int64_t tok = tr.recv_src_token[s][i], row = s * T_max + static_cast<int64_t>(i);
        std::vector<uint8_t> bytes;
        std::vector<float> scales;
        encode_wire_row(c, &all[s].x[tok * H], &bytes, &scales);
        bool ok = std::memcmp(bytes.data(), &recv_x[row * row_bytes], row_bytes) == 0;
        if (c.dispatch_format == kWsFp8Block)
          ok = ok && std::memcmp(scales.data(), &recv_scales[row * (H / 128)], scales.size() * 4) == 0;
        // Metadata: src token, local expert per slot, weights, zero padding.
        std::vector<uint8_t> meta(l.meta_bytes, 0);
        int32_t* mw = reinterpret_cast<int32_t*>(meta.data());
        mw[0] = static_cast<int32_t>(tok);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t id = all[s].topk_ids[tok * k + j];
          bool mine = id >= 0 && id < c.num_experts && id / El == rank;
          for (int64_t jj = 0; jj < j && mine; ++jj) mine = all[s].topk_ids[tok * k + jj] != id;
          mw[1 + j] = mine ? id - rank * static_cast<int32_t>(El) : -1;
          const float w = mine ? all[s].topk_weights[tok * k + j] : 0.f;
          std::memcpy(&mw[1 + k + j], &w, 4);
        }
        ok = ok && std::memcmp(meta.data(), &recv_meta[row * l.meta_bytes], l.meta_bytes) == 0;
        if (!ok && ++bad_rows <= 3)
          ADD_FAILURE() << "rank " << rank << ": recv row " << row << " (source " << s << ", token " << tok
                        << ") differs from the host truth";
      }
    }
    EXPECT_EQ(bad_rows, 0) << "rank " << rank;

    // The per-expert counts are the owner's, from the metadata, in the pool build.
    EXPECT_EQ(read_region<int32_t>(t, l.recv_expert_counts, run.stream), tr.recv_expert_counts) << "rank " << rank;
    const auto offsets = read_region<int32_t>(t, l.expert_offsets, run.stream);
    EXPECT_EQ(offsets, tr.expert_offsets) << "rank " << rank;
    const int64_t used = tr.expert_offsets[El];
    const auto pool_src = read_rows<int32_t>(t, l.pool_src, 4, {{0, used}}, run.stream);
    EXPECT_TRUE(std::equal(tr.pool_src.begin(), tr.pool_src.end(), pool_src.begin())) << "rank " << rank << ": pool_src";
    const auto pool_x = read_rows<uint8_t>(t, l.pool_x, row_bytes, {{0, used}}, run.stream);
    const auto pool_scales = read_rows<float>(t, l.pool_x_scales, (H / 128) * 4, {{0, used}}, run.stream);
    int64_t bad_pool = 0;
    for (int64_t p = 0; p < used; ++p) {
      const int32_t src = tr.pool_src[p];
      const bool ok = src < 0 ? std::all_of(&pool_x[p * row_bytes], &pool_x[(p + 1) * row_bytes], [](uint8_t b) { return b == 0; })
                              : std::memcmp(&pool_x[p * row_bytes], &recv_x[(src / k) * row_bytes], row_bytes) == 0;
      if (!ok && ++bad_pool <= 3) ADD_FAILURE() << "rank " << rank << ": pool row " << p << " (src " << src << ")";
    }
    EXPECT_EQ(bad_pool, 0);

    if (c.dispatch_format == kWsFp8Block) {  // the pool's scales (the rows are compared above)
      int64_t bad_scales = 0;
      for (int64_t p = 0; p < used; ++p) {
        const int32_t src = tr.pool_src[p];
        const float* got = &pool_scales[p * (H / 128)];
        bool ok = true;
        if (src >= 0) ok = std::memcmp(got, &recv_scales[(src / k) * (H / 128)], (H / 128) * 4) == 0;
        if (!ok && ++bad_scales <= 3) ADD_FAILURE() << "rank " << rank << ": pool scales of row " << p;
      }
      EXPECT_EQ(bad_scales, 0);
    }
    const int64_t T = run.in.num_tokens;
    const auto y = download_y(run, T * H);
    const auto want = expected_output(c, run.in);
    int64_t bad = 0;
    double err2 = 0, ref2 = 0;
    for (int64_t i = 0; i < T * H; ++i) {
      if (y[i] != want[i] && ++bad <= 3)
        ADD_FAILURE() << "rank " << rank << ": y[" << i / H << ", " << i % H << "] = " << fmt::bf16_to_float(y[i])
                      << ", host codecs give " << fmt::bf16_to_float(want[i]);
      const double d = fmt::bf16_to_float(y[i]) - fmt::bf16_to_float(want[i]);
      err2 += d * d;
      ref2 += static_cast<double>(fmt::bf16_to_float(want[i])) * fmt::bf16_to_float(want[i]);
    }
    EXPECT_EQ(bad, 0) << "rank " << rank << " (rel L2 vs host codecs " << std::sqrt(err2 / std::max(ref2, 1e-30)) << ")";

    const Status verified = gpu_rank_of((*group)[rank].get())->barrier("verified", 30000);
    ASSERT_TRUE(verified.is_ok()) << verified.to_string();
    for (int it = 0; it < repeats; ++it) {
      poison_y(run, T * H);
      const bool fused = it % 2 == 1;
      EXPECT_TRUE(forward(c, &run, rank, fused).is_ok());
      if (it == repeats - 1 || it % 25 == 0 || !fused) {
        st = run.transport->check_error(run.stream);
        EXPECT_TRUE(st.is_ok()) << st.to_string();
        EXPECT_EQ(download_y(run, T * H), y)
            << "rank " << rank << ": repeat " << it << (fused ? " (fused)" : " (split)") << " differs";
      }
    }
    if (graph) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      EXPECT_EQ(cudaStreamBeginCapture(run.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      const Status cap = forward(c, &run, rank);
      EXPECT_EQ(cudaStreamEndCapture(run.stream, &g), cudaSuccess);
      EXPECT_TRUE(cap.is_ok()) << cap.to_string();
      EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
      // Instantiation may allocate (an implicit synchronisation): every rank's graph is ready first.
      const Status b = gpu_rank_of((*group)[rank].get())->barrier("graph", 30000);
      ASSERT_TRUE(b.is_ok()) << b.to_string();
      for (int it = 0; it < 5; ++it) {
        poison_y(run, T * H);
        EXPECT_EQ(cudaGraphLaunch(exec, run.stream), cudaSuccess);
        st = run.transport->check_error(run.stream);
        EXPECT_TRUE(st.is_ok()) << st.to_string();
        EXPECT_EQ(download_y(run, T * H), y) << "rank " << rank << ": graph replay " << it << " differs";
      }
      if (exec) cudaGraphExecDestroy(exec);
      if (g) cudaGraphDestroy(g);
    }
    teardown_rank(&run);
  });
}

Case base_case() {
  Case c;
  c.tokens = {48, 37};
  return c;
}

TEST(Sm90Transport, Bf16Wire_RankTagged_Counts_RoundTripBitwise_EP2) {
  Case c = base_case();
  c.unit_weights = true;  // y = bf16(x * fan-out) exactly
  run_case(c);
}

TEST(Sm90Transport, Fp8Wire_Bf16Combine_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  run_case(c);
}

TEST(Sm90Transport, Fp8Wire_Pow2Scales_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  c.pow2_scales = true;
  run_case(c);
}

// An e4m3 x with 1x128 scales: copied onto the fp8 wire (codes and scales, the scales gathered per
// part), dequantised onto a bf16 wire; H = 7168 (56 scales a row) and H = 640 (5: 4-byte scale rows).
TEST(Sm90Transport, Fp8Input_BothWires_EP2) {
  Case c = base_case();
  c.x_fp8 = true;
  for (int64_t H : {int64_t{7168}, int64_t{640}}) {
    c.hidden = H;
    c.dispatch_format = kWsFp8Block;
    c.pow2_scales = H == 640;
    run_case(c, 2);
    c.dispatch_format = kWsBf16;
    run_case(c);
  }
  c.hidden = 7168;
  c.dispatch_format = kWsFp8Block;
  c.tokens = {3, 1};  // small T: a row split into many parts
  c.owner_reduce = true;
  run_case(c, 2);
}

TEST(Sm90Transport, Mxfp8Combine_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  c.combine_format = kWsMxfp8;
  run_case(c);
}

TEST(Sm90Transport, Nvfp4Combine_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  c.combine_format = kWsNvfp4;
  run_case(c);
}

TEST(Sm90Transport, ZeroTokenRank_EP2) {
  Case c = base_case();
  c.tokens = {40, 0};
  run_case(c, 2);
  c.tokens = {0, 0};
  run_case(c, 2);
}

TEST(Sm90Transport, AllTokensToOneExpert_EP2) {
  Case c = base_case();
  c.routing = Routing::kOneExpert;
  c.tokens = {64, 64};
  c.block_m = 64;
  run_case(c);
}

// The benchmark's geometry (deepseek-v3 hidden, 256 experts, top-8, fp8 wire) at T = T_max = 128.
Case deepseek_case() {
  Case c;
  c.hidden = 7168;
  c.num_experts = 256;
  c.top_k = 8;
  c.max_tokens = 128;
  c.tokens = {128, 128};
  c.dispatch_format = kWsFp8Block;
  return c;
}

TEST(Sm90Transport, TEqualsMaxTokens_DeepSeekHidden_EP2_H7168_K8_E256) {
  run_case(deepseek_case());
}

// Many tokens per dispatch CTA (cross-CTA prefix counts, multi-warp ranking inside a CTA) and
// combine grids smaller than the work: 2 SMs' worth of CTAs, then the full GPU at T ~ 2000.
TEST(Sm90Transport, ManyTokensPerCta_FewSms_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  c.max_tokens = 2048;
  c.tokens = {600, 451};
  c.num_sms = 2;
  run_case(c, 1);
  c.tokens = {2048, 1531};
  c.num_sms = 0;
  run_case(c);
}

// The fused combine with recv-row groups (reduce behind the sends; token_rows waits): every wire
// format, uneven ranks, a 0-token rank, few CTAs (one reducer), and groups of one row.
void run_grouped_cases(bool owner_reduce) {
  Case c = base_case();
  c.owner_reduce = owner_reduce;
  c.dispatch_format = kWsFp8Block;
  c.combine_groups = 3;
  run_case(c, 4);
  c.combine_format = kWsMxfp8;
  c.combine_groups = 8;
  run_case(c, 2);
  c.combine_format = kWsNvfp4;
  c.tokens = {40, 0};
  run_case(c, 2);
  c.combine_format = kWsBf16;
  c.tokens = {5, 3};
  c.num_sms = 1;  // 2 CTAs: one sends, one reduces
  run_case(c, 2);
}

TEST(Sm90Transport, GroupedCombine_EP2) { run_grouped_cases(false); }

// The owner reduce: each owner sums its slots' partials of a token before one row goes out, the
// source sums the owners' rows in rank order. Every wire format, both combine kernels (run_case
// alternates fused and split), graph replay, and the grouped cases above.
TEST(Sm90Transport, OwnerReduce_EveryWire_EP2) {
  Case c = base_case();
  c.owner_reduce = true;
  c.unit_weights = true;
  run_case(c, 2);
  c.unit_weights = false;
  c.dispatch_format = kWsFp8Block;
  for (int32_t f : {kWsBf16, kWsMxfp8, kWsNvfp4}) {
    c.combine_format = f;
    run_case(c, 4);
  }
  c.combine_format = kWsBf16;
  run_case(c, 1, true);
  run_grouped_cases(true);
}

// The owner reduce at the benchmark's geometry, and many tokens with groups.
TEST(Sm90Transport, OwnerReduce_DeepSeekHidden_EP2_H7168_K8_E256) {
  Case c = deepseek_case();
  c.owner_reduce = true;
  run_case(c, 2);
  c.combine_format = kWsMxfp8;
  run_case(c, 2);
  c.combine_format = kWsBf16;
  c.hidden = 512;
  c.max_tokens = 2048;
  c.tokens = {2048, 1531};
  c.combine_groups = 4;
  run_case(c, 2);
}

TEST(Sm90Transport, Repeat100Bitwise_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  c.combine_format = kWsMxfp8;
  run_case(c, 100);
  c.combine_groups = 5;
  run_case(c, 50);
}

// Forwards across the dispatch cell's wrap: the cells start at 2^32 - 2 launches, so the first
// forward is epoch 2^32 - 1 (whose window [e << 32, (e + 1) << 32) ends at 0 modulo 2^64) and the next
// ones run past 2^32; every one bitwise equal to the host truth, with each combine path (the split
// one, the one-kernel one, and the grouped one whose publishes are ordered stores).
TEST(Sm90Transport, EpochWrap_ForwardsFromCellsSeededAt2To32Minus2_EP2) {
  const uint64_t seed = (uint64_t(1) << 32) - 2;
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  run_case(c, 4, /*graph=*/true, seed);
  c.combine_format = kWsMxfp8;
  c.combine_groups = 4;
  run_case(c, 4, /*graph=*/false, seed);
  c.owner_reduce = true;
  run_case(c, 3, /*graph=*/false, seed);
}

TEST(Sm90Transport, CudaGraphReplayEqualsEager_EP2) {
  Case c = base_case();
  c.dispatch_format = kWsFp8Block;
  run_case(c, 1, true);
  c.combine_groups = 4;
  run_case(c, 1, true);
}

// Two bad slots (token 3 slot 1 = E + 5, token 5 slot 0 = -7): reported once with the first of them
// and the count, then cleared.
void expect_bad_ids_reported(Case c) {
  REQUIRE_GROUP(group);
  c.routing = Routing::kWithBad;
  std::mutex m;
  std::vector<std::string> messages(kRanks);
  run_ranks(kRanks, [&](int rank) {
    RankRun run;
    setup_rank(c, (*group)[rank], rank, &run);
    if (::testing::Test::HasFatalFailure()) return teardown_rank(&run);
    EXPECT_TRUE(dispatch_once(c, &run, rank).is_ok());
    EXPECT_TRUE(run.transport->build_expert_pool(run.stream).is_ok());
    EXPECT_TRUE(combine_once(c, &run, rank).is_ok());
    const Status st = run.transport->check_error(run.stream);
    {
      std::lock_guard<std::mutex> lock(m);
      messages[rank] = st.to_string();
    }
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("topk_ids[3, 1]=" + std::to_string(c.num_experts + 5)), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(" 2 bad slot(s)"), std::string::npos) << st.message();
    EXPECT_TRUE(run.transport->check_error(run.stream).is_ok()) << "the counters clear once reported";
    teardown_rank(&run);
  });
  std::printf("  bad-id report: %s\n", messages[0].c_str());
}

TEST(Sm90Transport, BadTopkIdsReported_EP2) {
  expect_bad_ids_reported(base_case());
}

// Above the dispatch's direct-count limit (128 tokens) every CTA checks its own chunk and the last
// one reports the sums: the two bad slots land in different CTAs, the first must still win.
TEST(Sm90Transport, BadTopkIdsReported_ManyTokens_EP2) {
  Case c = base_case();
  c.max_tokens = 400;
  c.tokens = {300, 260};
  expect_bad_ids_reported(c);
}

TEST(Sm90Transport, TooManyTokensRefusedBeforeLaunch_EP2) {
  REQUIRE_GROUP(group);
  Case c = base_case();
  c.tokens = {64, 64};
  run_ranks(kRanks, [&](int rank) {
    RankRun run;
    setup_rank(c, (*group)[rank], rank, &run);
    if (::testing::Test::HasFatalFailure()) return teardown_rank(&run);
    DeviceBuffer big(65 * c.hidden * 2), ids(65 * c.top_k * 4), w(65 * c.top_k * 4);
    const Status st = run.transport->dispatch(view(&big, DType::kBFloat16, {65, c.hidden}, rank), TensorView(),
                                              view(&ids, DType::kInt32, {65, c.top_k}, rank),
                                              view(&w, DType::kFloat32, {65, c.top_k}, rank), run.stream);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("max_tokens_per_rank=64"), std::string::npos) << st.message();
    teardown_rank(&run);
  });
}

TEST(Sm90Transport, WarmupDuringCaptureRefused_EP2) {
  REQUIRE_GROUP(group);
  Case c = base_case();
  run_ranks(kRanks, [&](int rank) {
    EpTransportOptions o;
    o.params = c.params();
    std::unique_ptr<EpTransport> t;
    MEGAMOE_ASSERT_OK(EpTransport::create((*group)[rank], o, &t));
    cudaStream_t s;
    MEGAMOE_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    MEGAMOE_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    const Status st = t->warmup(s);
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(s, &g);
    if (g) cudaGraphDestroy(g);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(st.message().find("call warmup() on every rank first"), std::string::npos) << st.message();
    cudaStreamDestroy(s);
  });
}

// Rank 1 skips a launch: rank 0 must report a timeout naming the stage and the peer, with no hang.
TEST(Sm90Transport, SkippedLaunchTimesOut_EP2) {
  REQUIRE_GROUP(group);
  Case c = base_case();
  c.max_tokens = 32;  // its own workspace key: the aborted workspace is not shared with other tests
  c.tokens = {16, 16};
  std::vector<Status> results(kRanks);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(kRanks, [&](int rank) {
    RankRun run;
    EpTransportOptions o;
    o.params = c.params();
    o.wait_timeout_ms = 1500;
    MEGAMOE_ASSERT_OK(EpTransport::create((*group)[rank], o, &run.transport));
    run.comm = (*group)[rank].get();
    run.stream = make_rank_stream(run.comm);
    ASSERT_NE(run.stream, nullptr);
    MEGAMOE_ASSERT_OK(run.transport->warmup(run.stream));
    run.in = c.inputs(rank);
    run.x.reset(new DeviceBuffer(16 * c.hidden * 2));
    run.ids.reset(new DeviceBuffer(16 * c.top_k * 4));
    run.weights.reset(new DeviceBuffer(16 * c.top_k * 4));
    run.x->upload(run.in.x);
    run.ids->upload(run.in.topk_ids);
    run.weights->upload(run.in.topk_weights);
    if (rank == 0) {
      EXPECT_TRUE(dispatch_once(c, &run, rank).is_ok());
    }
    results[rank] = run.transport->check_error(run.stream);
    teardown_rank(&run);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("  rank 0: %s\n  (%.2f s)\n", results[0].to_string().c_str(), secs);
  EXPECT_EQ(results[0].code(), StatusCode::kTimeout) << results[0].to_string();
  EXPECT_NE(results[0].message().find("dispatch-done"), std::string::npos);
  EXPECT_NE(results[0].message().find("peer rank 1"), std::string::npos);
  // Rank 1 launched nothing: it reports ok, or (when it checks after rank 0 gave up) rank 0's abort.
  EXPECT_TRUE(results[1].is_ok() || results[1].message().find("rank 0") != std::string::npos)
      << results[1].to_string();
  EXPECT_LT(secs, 30.0);
}

TEST(Sm90Transport, NotGpuCommunicatorRefused) {
  std::vector<std::shared_ptr<Communicator>> host;
  MEGAMOE_ASSERT_OK(create_host_group(2, &host));
  Case c = base_case();
  EpTransportOptions o;
  o.params = c.params();
  std::unique_ptr<EpTransport> t;
  const Status st = EpTransport::create(host[0], o, &t);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("GPU group's communicator"), std::string::npos) << st.message();
}

// The in-kernel FC2 reduce leaves no staged combine rows: only a mega workspace may ask for it
// (host-side rule; no GPU needed).
TEST(TransportOptions, InKernelFc2ReduceOnlyWithMega) {
  Case c = base_case();
  EpTransportOptions o;
  o.params = c.params();
  o.params.in_kernel_fc2_reduce = 1;
  const Status st = o.validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("in_kernel_fc2_reduce=1, needs mega=1"), std::string::npos) << st.message();
  o.params.mega = 1;
  MEGAMOE_ASSERT_OK(o.validate());
}

}  // namespace
}  // namespace test
}  // namespace megamoe
