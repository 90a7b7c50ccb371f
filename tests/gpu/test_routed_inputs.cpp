// The routed backend's inputs beyond int32 ids and fp32 weights, on one H200: int64 ids and bf16
// weights (converted on the device) give the int32 / fp32 bits, config.output_scale gives the bits of
// prescaled weights, and set_expert_counts() accumulates the received rows per local expert on the
// device, in eager forwards and in CUDA-graph replays. Skips without a Hopper GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "gpu/gpu_skip.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "reference/problem.h"

namespace megamoe {
namespace {

using reference::MoeProblem;

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceArray(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(ptr); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

MoeGeometry geometry() {
  MoeGeometry g;
  g.hidden = 512, g.intermediate = 256, g.num_experts = 16, g.top_k = 4;
  g.ep_size = 1, g.max_tokens_per_rank = 64;
  return g;
}

MoeConfig routed(float output_scale = 1.0f) {
  MoeConfig c;
  c.backend = Backend::kRouted;
  c.output_scale = output_scale;
  return c;
}

class Sm90RoutedInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string skip = gpu_test::gpu_skip_reason(1);
    if (!skip.empty()) GTEST_SKIP() << skip;
    p_ = reference::make_random_problem(geometry(), 31, {53}, reference::Routing::kWithDropped);
    auto& in = p_.ranks[0];
    T_ = in.num_tokens;
    for (float& w : in.topk_weights) w = fmt::round_to_bf16(w);  // bf16 holds these exactly
    cudaStreamCreate(&stream_);
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::unique_ptr<MoeLayer> make(const MoeConfig& c) {
    std::unique_ptr<MoeLayer> layer;
    Status st = MoeLayer::create(p_.geometry, c, reference::local_weights(p_, 0), nullptr, &layer);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    if (layer) {
      st = layer->warmup();
      EXPECT_TRUE(st.is_ok()) << st.to_string();
    }
    return layer;
  }

  // y bits of one eager forward (y poisoned first).
  std::vector<uint16_t> forward(MoeLayer& layer, const void* ids, DType ids_dtype, const void* w, DType w_dtype) {
    const int64_t H = p_.geometry.hidden, k = p_.geometry.top_k;
    DeviceArray<uint16_t> x(p_.ranks[0].x_bf16), y(std::vector<uint16_t>(T_ * H, 0xFFFF));
    Status st = layer.forward(TensorView(x.ptr, DType::kBFloat16, {T_, H}, layer.device()),
                              TensorView(const_cast<void*>(ids), ids_dtype, {T_, k}, layer.device()),
                              TensorView(const_cast<void*>(w), w_dtype, {T_, k}, layer.device()),
                              TensorView(y.ptr, DType::kBFloat16, {T_, H}, layer.device()), stream_);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    st = layer.check_error(stream_);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return y.get();
  }

  MoeProblem p_;
  int64_t T_ = 0;
  cudaStream_t stream_ = nullptr;
};

TEST_F(Sm90RoutedInputs, Int64IdsAndBf16WeightsEqualInt32Fp32Bitwise_EP1) {
  const auto& in = p_.ranks[0];
  std::vector<int64_t> ids64(in.topk_ids.begin(), in.topk_ids.end());
  std::vector<uint16_t> w_bf16(in.topk_weights.size());
  for (size_t i = 0; i < w_bf16.size(); ++i) w_bf16[i] = fmt::float_to_bf16(in.topk_weights[i]);
  DeviceArray<int32_t> d_ids32(in.topk_ids);
  DeviceArray<int64_t> d_ids64(ids64);
  DeviceArray<float> d_w32(in.topk_weights);
  DeviceArray<uint16_t> d_wbf16(w_bf16);
  auto layer = make(routed());
  ASSERT_TRUE(layer);
  const auto want = forward(*layer, d_ids32.ptr, DType::kInt32, d_w32.ptr, DType::kFloat32);
  EXPECT_TRUE(forward(*layer, d_ids64.ptr, DType::kInt64, d_w32.ptr, DType::kFloat32) == want) << "int64 ids";
  EXPECT_TRUE(forward(*layer, d_ids32.ptr, DType::kInt32, d_wbf16.ptr, DType::kBFloat16) == want) << "bf16 weights";
  EXPECT_TRUE(forward(*layer, d_ids64.ptr, DType::kInt64, d_wbf16.ptr, DType::kBFloat16) == want) << "both";
}

TEST_F(Sm90RoutedInputs, OutputScaleEqualsPrescaledWeightsBitwise_EP1) {
  const float s = 2.5f;
  const auto& in = p_.ranks[0];
  std::vector<float> prescaled(in.topk_weights.size());
  for (size_t i = 0; i < prescaled.size(); ++i) prescaled[i] = s * in.topk_weights[i];
  DeviceArray<int32_t> d_ids(in.topk_ids);
  DeviceArray<float> d_w(in.topk_weights), d_prescaled(prescaled);
  auto scaled = make(routed(s));
  auto plain = make(routed());
  ASSERT_TRUE(scaled && plain);
  EXPECT_TRUE(forward(*scaled, d_ids.ptr, DType::kInt32, d_w.ptr, DType::kFloat32) ==
              forward(*plain, d_ids.ptr, DType::kInt32, d_prescaled.ptr, DType::kFloat32));
}

TEST_F(Sm90RoutedInputs, ExpertCountsAccumulateOnTheDevice_EagerAndGraphReplay_EP1) {
  const auto& in = p_.ranks[0];
  const int64_t E = p_.geometry.num_experts, H = p_.geometry.hidden, k = p_.geometry.top_k;
  std::vector<int64_t> truth(E, 0);
  for (int32_t e : in.topk_ids)
    if (e >= 0) ++truth[e];
  std::vector<int64_t> ids64(in.topk_ids.begin(), in.topk_ids.end());
  DeviceArray<int64_t> d_ids(ids64), counts(std::vector<int64_t>(E, 0));
  DeviceArray<float> d_w(in.topk_weights);
  auto layer = make(routed(0.5f));  // int64 ids and a scale: the conversion kernel is captured too
  ASSERT_TRUE(layer);
  ASSERT_TRUE(layer->set_expert_counts(TensorView(counts.ptr, DType::kInt64, {E}, layer->device())).is_ok());
  const auto eager = forward(*layer, d_ids.ptr, DType::kInt64, d_w.ptr, DType::kFloat32);
  auto got = counts.get();
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(got[e], truth[e]) << "eager, expert " << e;

  DeviceArray<uint16_t> x(in.x_bf16), y(std::vector<uint16_t>(T_ * H, 0xFFFF));
  const Device dev = layer->device();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  Status st = layer->forward(TensorView(x.ptr, DType::kBFloat16, {T_, H}, dev), TensorView(d_ids.ptr, DType::kInt64, {T_, k}, dev),
                             TensorView(d_w.ptr, DType::kFloat32, {T_, k}, dev), TensorView(y.ptr, DType::kBFloat16, {T_, H}, dev),
                             stream_);
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_OK(cudaGraphLaunch(exec, stream_));
  st = layer->check_error(stream_);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  got = counts.get();
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(got[e], 4 * truth[e]) << "after 3 replays, expert " << e;
  EXPECT_TRUE(y.get() == eager) << "replay equals eager";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace megamoe
