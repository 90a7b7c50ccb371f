// Test harness of the EP transport GPU tests: a GPU group shared by the tests, rank threads, device
// buffers, and the host-side truth of the protocol (built with the fmt:: codecs, so device and host
// must agree bit for bit).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_skip.h"
#include "kernels/transport/ep_transport.h"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/workspace.h"

namespace megamoe {
namespace test {

#define MEGAMOE_ASSERT_OK(expr)                                     \
  do {                                                              \
    const ::megamoe::Status _st = (expr);                           \
    ASSERT_TRUE(_st.is_ok()) << #expr << ": " << _st.to_string();   \
  } while (0)

#define MEGAMOE_CUDA_OK(expr)                                                      \
  do {                                                                             \
    const cudaError_t _e = (expr);                                                 \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e);         \
  } while (0)

// The group the transport tests share: 2 GPUs over NCCL where there are two, else 2 logical ranks
// sharing GPU 0 (create_shared_gpu_group); null with `reason` when the machine cannot host either.
std::vector<std::shared_ptr<Communicator>>* transport_group(int n, std::string* reason);
// The CUDA device of `rank` in that group.
int device_of_rank(int rank);
// "NCCL" or "shared GPU", for the tests' output.
const char* transport_group_kind();

// Runs fn(rank) on one thread per rank (each with its device set) and joins them.
void run_ranks(int n, const std::function<void(int)>& fn);

// Test buffers. On a shared GPU a rank must not allocate or free device memory between the setup
// barrier and its last launch: cudaMalloc / cudaFree are implicit synchronisation points (the CUDA
// programming guide, "Implicit Synchronization"), so the call would wait for a peer's kernel that
// is itself waiting (bounded) for this rank's launch. Allocate and upload in setup; the tests copy
// back on the rank's own stream.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) cudaMalloc(&ptr, n);
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Complete on return, on a private stream: a pageable cudaMemcpy may return before its DMA lands,
  // and the legacy stream would order against a logical peer's work on a shared GPU.
  template <typename T>
  void upload(const std::vector<T>& v) {
    if (v.empty()) return;
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMemcpyAsync(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};

enum class Routing { kRandom, kOneExpert, kWithBad };

// One rank's inputs, generated identically on every thread from (seed, rank).
struct RankInputs {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;        // [T, H] bf16
  std::vector<uint8_t> x_fp8;     // [T, H] e4m3 codes of x (1x128 blocks), with Case::x_fp8
  std::vector<float> x_scale;     // [T, H / 128]
  std::vector<int32_t> topk_ids;  // [T, k]
  std::vector<float> topk_weights;
};

struct Case {
  int num_ranks = 2;
  int64_t hidden = 512, num_experts = 16, top_k = 4, max_tokens = 64, block_m = 128;
  int32_t dispatch_format = kWsBf16, combine_format = kWsBf16;
  bool unit_weights = false;
  bool pow2_scales = false;
  int num_sms = 0;  // EpTransportOptions::num_sms (0: every SM); small values force many tokens per CTA
  int combine_groups = 0;  // EpTransportOptions::combine_groups (0: by the token count)
  bool owner_reduce = false;  // WorkspaceParams::owner_reduce: one combine row per (token, owner)
  bool x_fp8 = false;         // dispatch x given as e4m3 + 1x128 scales (x quantised on the host)
  Routing routing = Routing::kRandom;
  std::vector<int64_t> tokens;  // per rank
  uint32_t seed = 1;

  WorkspaceParams params() const;
  RankInputs inputs(int rank) const;
};

// Host truth of every stage for `dest` given all ranks' inputs.
struct Truth {
  std::vector<int32_t> recv_token_counts;   // [R]
  std::vector<int32_t> recv_expert_counts;  // [R * E_l]
  std::vector<std::vector<int64_t>> recv_src_token;  // [R][i]
  std::vector<int32_t> expert_offsets;      // [E_l + 1]
  std::vector<int32_t> pool_src;            // [expert_offsets[E_l]]
};
Truth protocol_truth(const Case& c, const std::vector<RankInputs>& all, int dest);

// The wire row of one token (quantisation point 1): fp8 codes + scales, or bf16 bytes. With x_fp8 the
// input is x quantised (1x128, pow2 per the case): the fp8 wire carries exactly those codes and scales
// (the same as quantising x in the kernel), the bf16 wire their dequantised values rounded to bf16.
void encode_wire_row(const Case& c, const uint16_t* x_row, std::vector<uint8_t>* bytes, std::vector<float>* scales);

// y of `rank` given every rank's inputs and the identity experts (FC2 output = dequantised wire row),
// through the host codecs: partial = w * x, encoded, decoded, summed in slot order (owner reduce:
// each owner's partials summed in slot order, encoded, decoded, summed in rank order).
std::vector<uint16_t> expected_output(const Case& c, const RankInputs& in);

// Dequantised pool_x rows (the identity experts' output) from a downloaded pool.
std::vector<float> identity_expert_out(const Case& c, const WorkspaceLayout& l, const std::vector<uint8_t>& pool_x,
                                       const std::vector<float>& pool_scales);

}  // namespace test
}  // namespace megamoe
