// Device-resident weights (megamoe/weights.h) on one H200, routed and mega backends, EP1: a layer
// built from device views of a source gives BITWISE the output of one built from the same bytes in
// host memory, for fp8-block (e4m3 + fp32 128x128 scales, kept), bf16, and bf16 quantised into
// fp8-block on the device (plain and power-of-two scales); expert_weight_views() hold, byte for byte,
// the host preparation's images (prepare_weights, then gemm_weights.h's SwiGLU row order) on both
// layers; swapping two experts' regions through the views computes bitwise as a layer built from host
// weights with those experts swapped (what EPLB does); a view on another device or a bad scale is
// refused by name. Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/gpu_skip.h"
#include "kernels/gemm/gemm_weights.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/weights.h"
#include "reference/problem.h"

namespace megamoe {
namespace {

using reference::MoeProblem;

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// What the device source is, and the format the layer computes in.
enum class SourceCase { kFp8Kept, kBf16, kBf16IntoFp8, kBf16IntoFp8Pow2 };

struct DeviceWeightsCase {
  const char* name;
  Backend backend;
  SourceCase source;
  std::string test_name() const { return std::string(to_string(backend)) + "_" + name; }
};

MoeGeometry geometry() {
  MoeGeometry g;
  g.hidden = 512, g.intermediate = 256, g.num_experts = 16, g.top_k = 4;
  g.ep_size = 1, g.max_tokens_per_rank = 64;
  return g;
}

MoeConfig config_for(const DeviceWeightsCase& c) {
  MoeConfig cfg;
  cfg.backend = c.backend;
  if (c.source == SourceCase::kBf16) {
    cfg.weight_format = WeightFormat::kBf16;
    cfg.dispatch_format = DispatchFormat::kBf16;
  }
  cfg.pow2_scales = c.source == SourceCase::kBf16IntoFp8Pow2;
  return cfg;
}

// One device copy of a host view (absent stays absent).
struct DeviceCopy {
  void* ptr = nullptr;
  ~DeviceCopy() { cudaFree(ptr); }
  TensorView make(const TensorView& host) {
    if (!host.present()) return TensorView();
    const size_t bytes = static_cast<size_t>(host.numel() * dtype_bytes(host.dtype));
    EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    TensorView v = host;  // contiguous, as the host view
    v.data = ptr;
    v.device = Device::cuda(0);
    return v;
  }
};

// The MoeWeights of `host` on cuda:0 (the copies live as long as this object).
struct DeviceSource {
  DeviceCopy w13, w13_scale, w2, w2_scale;
  MoeWeights views;
  explicit DeviceSource(const MoeWeights& host) {
    views.w13 = w13.make(host.w13);
    views.w13_scale = w13_scale.make(host.w13_scale);
    views.w2 = w2.make(host.w2);
    views.w2_scale = w2_scale.make(host.w2_scale);
  }
};

std::vector<uint8_t> download(const void* ptr, int64_t bytes) {
  std::vector<uint8_t> h(static_cast<size_t>(bytes));
  EXPECT_EQ(cudaMemcpy(h.data(), ptr, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

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

class Sm90DeviceWeights : public ::testing::TestWithParam<DeviceWeightsCase> {
 protected:
  void SetUp() override {
    MEGAMOE_REQUIRE_SM90_GPUS(1);
    cudaSetDevice(0);
    p_ = reference::make_random_problem(geometry(), 97, {53}, reference::Routing::kWithDropped);
    T_ = p_.ranks[0].num_tokens;
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    const DeviceWeightsCase& c = GetParam();
    cfg_ = config_for(c);
    // The source bytes, in host memory: the problem's fp32 weights prepared as the case's source
    // format (fp8-block with its scales, or bf16), then viewed as a source (as_source()).
    MoeConfig source_cfg = cfg_;
    source_cfg.weight_format = c.source == SourceCase::kFp8Kept ? WeightFormat::kFp8Block : WeightFormat::kBf16;
    source_cfg.pow2_scales = false;
    const Status st = prepare_weights(p_.geometry, source_cfg, reference::local_weights(p_, 0), &source_);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::unique_ptr<MoeLayer> make(const MoeWeights& w) {
    std::unique_ptr<MoeLayer> layer;
    Status st = MoeLayer::create(p_.geometry, cfg_, w, nullptr, &layer);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    if (!layer) return nullptr;
    EXPECT_EQ(layer->backend(), GetParam().backend);
    st = layer->warmup();
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return st.is_ok() ? std::move(layer) : nullptr;
  }

  // y bits of one eager forward (y poisoned first).
  std::vector<uint16_t> forward(MoeLayer& layer) {
    const auto& in = p_.ranks[0];
    const int64_t H = p_.geometry.hidden, k = p_.geometry.top_k;
    const Device dev = layer.device();
    DeviceArray<uint16_t> x(in.x_bf16), y(std::vector<uint16_t>(T_ * H, 0xFFFF));
    DeviceArray<int32_t> ids(in.topk_ids);
    DeviceArray<float> w(in.topk_weights);
    Status st = layer.forward(TensorView(x.ptr, DType::kBFloat16, {T_, H}, dev),
                              TensorView(ids.ptr, DType::kInt32, {T_, k}, dev),
                              TensorView(w.ptr, DType::kFloat32, {T_, k}, dev),
                              TensorView(y.ptr, DType::kBFloat16, {T_, H}, dev), stream_);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    st = layer.check_error(stream_);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return y.get();
  }

  MoeProblem p_;
  int64_t T_ = 0;
  cudaStream_t stream_ = nullptr;
  MoeConfig cfg_;
  PreparedWeights source_;  // the source bytes in host memory
};

TEST_P(Sm90DeviceWeights, DeviceViewsGiveTheHostBuiltLayerBitwise) {
  const MoeWeights host = source_.as_source();
  DeviceSource dev(host);
  auto from_host = make(host);
  auto from_device = make(dev.views);
  ASSERT_TRUE(from_host && from_device);
  EXPECT_TRUE(from_device->prepared_weights().w13.data.empty()) << "device-built: no host copy of the weights";
  EXPECT_EQ(from_device->prepared_weights().format, cfg_.weight_format);
  const std::vector<uint16_t> want = forward(*from_host), got = forward(*from_device);
  size_t diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff += want[i] != got[i];
  std::printf("[device-weights] %s: %zu of %zu output elements differ from the host-built layer\n",
              GetParam().test_name().c_str(), diff, want.size());
  EXPECT_EQ(diff, 0u);
  EXPECT_EQ(forward(*from_device), got) << "repeat differs";
}

// Both layers' views hold the host preparation's images: prepare_weights in the layer's format, w13
// (and its scale rows) in the SwiGLU order, w2 as prepared.
TEST_P(Sm90DeviceWeights, ExpertWeightViewsHoldThePreparedImages) {
  const MoeWeights host = source_.as_source();
  DeviceSource dev(host);
  auto from_host = make(host);
  auto from_device = make(dev.views);
  ASSERT_TRUE(from_host && from_device);
  PreparedWeights prepared;
  ASSERT_TRUE(prepare_weights(p_.geometry, cfg_, host, &prepared).is_ok());
  const MoeGeometry& g = p_.geometry;
  const int64_t El = g.experts_per_rank(), H = g.hidden, I = g.intermediate;
  const bool fp8 = cfg_.weight_format == WeightFormat::kFp8Block;
  const int64_t elem = fp8 ? 1 : 2;
  std::vector<uint8_t> w13_image(prepared.w13.data.size());
  gemm::prepare_w13_for_swiglu(prepared.w13.data.data(), El, I, H, elem, w13_image.data());
  std::vector<float> s13_image(prepared.w13.scales.size() / 4);
  if (fp8)
    gemm::prepare_w13_scales_for_swiglu(reinterpret_cast<const float*>(prepared.w13.scales.data()), El, I, H,
                                        s13_image.data());
  for (MoeLayer* layer : {from_host.get(), from_device.get()}) {
    std::vector<ExpertWeightView> views;
    const Status st = layer->expert_weight_views(&views);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(static_cast<int64_t>(views.size()), El);
    for (int64_t e = 0; e < El; ++e) {
      const ExpertWeightView& v = views[static_cast<size_t>(e)];
      ASSERT_EQ(v.w13_bytes, 2 * I * H * elem);
      ASSERT_EQ(v.w2_bytes, H * I * elem);
      EXPECT_TRUE(download(v.w13, v.w13_bytes) ==
                  std::vector<uint8_t>(w13_image.begin() + e * v.w13_bytes, w13_image.begin() + (e + 1) * v.w13_bytes))
          << "w13 of expert " << e;
      EXPECT_TRUE(download(v.w2, v.w2_bytes) == std::vector<uint8_t>(prepared.w2.data.begin() + e * v.w2_bytes,
                                                                     prepared.w2.data.begin() + (e + 1) * v.w2_bytes))
          << "w2 of expert " << e;
      if (!fp8) {
        EXPECT_EQ(v.w13_scale, nullptr);
        EXPECT_EQ(v.w2_scale_bytes, 0);
        continue;
      }
      ASSERT_EQ(v.w13_scale_bytes, (2 * I / 128) * (H / 128) * 4);
      ASSERT_EQ(v.w2_scale_bytes, (H / 128) * (I / 128) * 4);
      const uint8_t* s13 = reinterpret_cast<const uint8_t*>(s13_image.data());
      EXPECT_TRUE(download(v.w13_scale, v.w13_scale_bytes) ==
                  std::vector<uint8_t>(s13 + e * v.w13_scale_bytes, s13 + (e + 1) * v.w13_scale_bytes))
          << "w13_scale of expert " << e;
      EXPECT_TRUE(download(v.w2_scale, v.w2_scale_bytes) ==
                  std::vector<uint8_t>(prepared.w2.scales.begin() + e * v.w2_scale_bytes,
                                       prepared.w2.scales.begin() + (e + 1) * v.w2_scale_bytes))
          << "w2_scale of expert " << e;
    }
  }
}

// EPLB's move: experts 2 and 5 swapped through the views (all four regions) of the device-built
// layer compute bitwise as a layer built from host weights with experts 2 and 5 swapped.
TEST_P(Sm90DeviceWeights, SwappingExpertsThroughTheViewsEqualsSwappedHostWeights) {
  const MoeWeights host = source_.as_source();
  DeviceSource dev(host);
  auto layer = make(dev.views);
  ASSERT_TRUE(layer);
  const std::vector<uint16_t> before = forward(*layer);
  std::vector<ExpertWeightView> v;
  ASSERT_TRUE(layer->expert_weight_views(&v).is_ok());
  const int a = 2, b = 5;
  auto swap = [&](void* x, void* y, int64_t bytes) {
    if (bytes == 0) return;
    void* tmp = nullptr;
    ASSERT_EQ(cudaMalloc(&tmp, static_cast<size_t>(bytes)), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(tmp, x, bytes, cudaMemcpyDeviceToDevice, stream_), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(x, y, bytes, cudaMemcpyDeviceToDevice, stream_), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(y, tmp, bytes, cudaMemcpyDeviceToDevice, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaFree(tmp);
  };
  swap(v[a].w13, v[b].w13, v[a].w13_bytes);
  swap(v[a].w13_scale, v[b].w13_scale, v[a].w13_scale_bytes);
  swap(v[a].w2, v[b].w2, v[a].w2_bytes);
  swap(v[a].w2_scale, v[b].w2_scale, v[a].w2_scale_bytes);
  const std::vector<uint16_t> swapped = forward(*layer);
  EXPECT_NE(swapped, before) << "the routing uses experts 2 and 5, so swapping them changes the output";

  PreparedWeights host_swapped = source_;
  auto swap_host = [&](std::vector<uint8_t>* bytes, int64_t num_experts) {
    if (bytes->empty()) return;
    const size_t per = bytes->size() / static_cast<size_t>(num_experts);
    std::swap_ranges(bytes->begin() + a * per, bytes->begin() + (a + 1) * per, bytes->begin() + b * per);
  };
  const int64_t El = p_.geometry.experts_per_rank();
  for (QuantizedTensor* t : {&host_swapped.w13, &host_swapped.w2}) {
    swap_host(&t->data, El);
    swap_host(&t->scales, El);
  }
  auto reference_layer = make(host_swapped.as_source());
  ASSERT_TRUE(reference_layer);
  EXPECT_EQ(swapped, forward(*reference_layer));
}

// Refusals on the device path, by name: a negative weight_scale_inv (prepare_weights' value rule,
// read back from the device), views on another device than the layer's.
TEST_P(Sm90DeviceWeights, RefusesBadScalesAndAnotherDevice) {
  const DeviceWeightsCase& c = GetParam();
  const MoeWeights host = source_.as_source();
  if (c.source == SourceCase::kFp8Kept) {
    PreparedWeights bad = source_;
    float neg = -1.f;
    std::memcpy(bad.w2.scales.data() + 4 * 1, &neg, 4);  // [0, 0, 1] of [E, H/128, I/128]
    DeviceSource dev(bad.as_source());
    std::unique_ptr<MoeLayer> layer;
    const Status st = MoeLayer::create(p_.geometry, cfg_, dev.views, nullptr, &layer);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("w2_scale[0, 0, 1]=-1, a weight_scale_inv must be finite and >= 0"), std::string::npos)
        << st.message();
  }
  // Views labelled cuda:1 (the data is on cuda:0; create() refuses them before any device access, so
  // no second GPU is needed) and the layer on the current device, cuda:0.
  DeviceSource dev(host);
  for (TensorView* t : {&dev.views.w13, &dev.views.w13_scale, &dev.views.w2, &dev.views.w2_scale})
    if (t->present()) t->device = Device::cuda(1);
  std::unique_ptr<MoeLayer> layer;
  const Status st = MoeLayer::create(p_.geometry, cfg_, dev.views, nullptr, &layer);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("w13.device=cuda:1, device-resident weights must be on the layer's device cuda:0"),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("copy the weights to the host first"), std::string::npos) << st.message();
}

INSTANTIATE_TEST_SUITE_P(
    Sm90, Sm90DeviceWeights,
    ::testing::Values(DeviceWeightsCase{"Fp8Block_EP1", Backend::kRouted, SourceCase::kFp8Kept},
                      DeviceWeightsCase{"Bf16_EP1", Backend::kRouted, SourceCase::kBf16},
                      DeviceWeightsCase{"Bf16IntoFp8Block_EP1", Backend::kRouted, SourceCase::kBf16IntoFp8},
                      DeviceWeightsCase{"Bf16IntoFp8BlockPow2_EP1", Backend::kRouted, SourceCase::kBf16IntoFp8Pow2},
                      DeviceWeightsCase{"Fp8Block_EP1", Backend::kMega, SourceCase::kFp8Kept},
                      DeviceWeightsCase{"Bf16_EP1", Backend::kMega, SourceCase::kBf16},
                      DeviceWeightsCase{"Bf16IntoFp8Block_EP1", Backend::kMega, SourceCase::kBf16IntoFp8}),
    [](const ::testing::TestParamInfo<DeviceWeightsCase>& info) { return info.param.test_name(); });

}  // namespace
}  // namespace megamoe
