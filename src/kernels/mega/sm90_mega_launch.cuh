// sm90_mega_launch.cuh — one configuration's launch of the MegaMoE kernel (explicitly instantiated
// in the sm90_mega_inst_*.cu files, so the configurations compile in parallel).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include "kernels/gemm/sm90_gemm_plan.cuh"
#include "kernels/mega/sm90_mega_kernel.cuh"

namespace megamoe::mega {

// The planned tensor maps and parameters of both GEMMs at one BLOCK_M.
struct MegaGemms {
  gemm::GroupedGemmPlan fc1, fc2;
};

template <class Cfg>
constexpr int mega_smem_bytes() {
  return Cfg::smem_bytes(kMegaMaxLocalExperts);
}

// Raises the dynamic shared memory limit (once per device) and returns how many CTAs of this
// configuration one SM holds.
template <class Cfg, class Cfg1>
cudaError_t mega_config_occupancy(int* ctas_per_sm) {
  static std::mutex mutex;
  static uint64_t raised_on = 0;  // bit d: raised on CUDA device d (d < 64)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  const auto kernel = sm90_mega_kernel<Cfg, Cfg1, false>;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!(raised_on >> device & 1u)) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, mega_smem_bytes<Cfg>());
      if (err == cudaSuccess)  // the in-kernel FC2 reduce's variant: the same threads and shared memory
        err = cudaFuncSetAttribute(sm90_mega_kernel<Cfg, Cfg1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   mega_smem_bytes<Cfg>());
      if (err != cudaSuccess) return err;
      raised_on |= uint64_t(1) << device;
    }
  }
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, Cfg::kNumThreads, mega_smem_bytes<Cfg>());
}

// A cooperative launch (the driver refuses it unless every CTA can be resident at once), or a plain one
// whose residency the plan checked (a shared GPU: MegaPlanArgs::cooperative).
template <class Cfg, class Cfg1>
cudaError_t launch_mega_config(const MegaGemms& g, const MegaArgs& a, int grid, bool cooperative, cudaStream_t stream) {
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(unsigned(grid));
  lc.blockDim = dim3(unsigned(Cfg::kNumThreads));
  lc.dynamicSmemBytes = size_t(mega_smem_bytes<Cfg>());
  lc.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  lc.attrs = cooperative ? &attr : nullptr;
  lc.numAttrs = cooperative ? 1 : 0;
  if (a.fc2_reduce)
    return cudaLaunchKernelEx(&lc, sm90_mega_kernel<Cfg, Cfg1, true>, g.fc1.tmap_a, g.fc1.tmap_b, g.fc1.tmap_sfa,
                              g.fc2.tmap_a, g.fc2.tmap_b, g.fc2.tmap_sfa, g.fc1.params, g.fc2.params, a);
  return cudaLaunchKernelEx(&lc, sm90_mega_kernel<Cfg, Cfg1, false>, g.fc1.tmap_a, g.fc1.tmap_b, g.fc1.tmap_sfa,
                            g.fc2.tmap_a, g.fc2.tmap_b, g.fc2.tmap_sfa, g.fc1.params, g.fc2.params, a);
}

// X(BLOCK_M, fp8): the combine's wire and mode are runtime arguments (MegaArgs).
#define MEGAMOE_MEGA_CONFIGS(X) \
  X(16, true)                   \
  X(64, true)                   \
  X(128, true)                  \
  X(64, false)                  \
  X(128, false)

template <int BM, bool kFp8>
using MegaFc2Cfg = gemm::GroupedGemmConfig<BM, kMegaBlockN, kFp8, gemm::GemmEpilogue::kStoreBf16, 1>;
template <int BM, bool kFp8>
using MegaFc1Cfg = gemm::GroupedGemmConfig<BM, kMegaBlockN, kFp8, kFp8 ? gemm::GemmEpilogue::kSwigluFp8 : gemm::GemmEpilogue::kSwigluBf16, 1>;

// nvfp4 weights (expanded to bf16 at upload: the bf16 configurations, bf16 activations, wire and
// intermediate) with FC1's scaled SwiGLU epilogue (w13's per-expert global scale on the accumulators;
// w2's is folded into the row weights at placement): X(BLOCK_M). FC2 is the bf16 configuration.
#define MEGAMOE_MEGA_CONFIGS_NVFP4(X) \
  X(64)                               \
  X(128)

template <int BM>
using MegaFc1CfgNvfp4 = gemm::GroupedGemmConfig<BM, kMegaBlockN, false, gemm::GemmEpilogue::kSwigluBf16Scaled, 1>;

// mxfp4 weights (the grouped GEMM's mxfp4 mode: swapped 16-row tiles; fp8 activations, wire and
// intermediate): X(BLOCK_M).
#define MEGAMOE_MEGA_CONFIGS_MXFP4(X) X(16)

// A configuration run on the ring of another with fewer stages: the kernel carves FC2's configuration
// and FC1's SwiGLU epilogue runs on that carve (rebind_smem), so both must name one stage count. With
// mxfp4's smaller weight slots the SwiGLU configuration (less staging) fits one stage more than FC2's.
// Its smem_bytes() stays the base's: nothing sizes a launch by it.
template <class Base, int kRingStages>
struct MegaOnRing : Base {
  static_assert(kRingStages >= 3 && kRingStages <= Base::kStages, "at most the stages the configuration fits");
  static constexpr int kStages = kRingStages;
};

template <int BM>
using MegaFc2CfgFp4 = gemm::GroupedGemmConfig<BM, kMegaBlockN, true, gemm::GemmEpilogue::kStoreBf16, 1, true>;
template <int BM>
using MegaFc1CfgFp4 = MegaOnRing<gemm::GroupedGemmConfig<BM, kMegaBlockN, true, gemm::GemmEpilogue::kSwigluFp8, 1, true>,
                                 MegaFc2CfgFp4<BM>::kStages>;

#define MEGAMOE_MEGA_EXTERN_MXFP4(BM)                                                                              \
  extern template cudaError_t launch_mega_config<MegaFc2CfgFp4<BM>, MegaFc1CfgFp4<BM>>(                            \
      const MegaGemms&, const MegaArgs&, int, bool, cudaStream_t);                                                 \
  extern template cudaError_t mega_config_occupancy<MegaFc2CfgFp4<BM>, MegaFc1CfgFp4<BM>>(int*);
#define MEGAMOE_MEGA_INSTANTIATE_MXFP4(BM)                                                                         \
  template cudaError_t launch_mega_config<MegaFc2CfgFp4<BM>, MegaFc1CfgFp4<BM>>(                                   \
      const MegaGemms&, const MegaArgs&, int, bool, cudaStream_t);                                                 \
  template cudaError_t mega_config_occupancy<MegaFc2CfgFp4<BM>, MegaFc1CfgFp4<BM>>(int*);

#define MEGAMOE_MEGA_EXTERN_NVFP4(BM)                                                                              \
  extern template cudaError_t launch_mega_config<MegaFc2Cfg<BM, false>, MegaFc1CfgNvfp4<BM>>(                      \
      const MegaGemms&, const MegaArgs&, int, bool, cudaStream_t);                                                 \
  extern template cudaError_t mega_config_occupancy<MegaFc2Cfg<BM, false>, MegaFc1CfgNvfp4<BM>>(int*);
#define MEGAMOE_MEGA_INSTANTIATE_NVFP4(BM)                                                                         \
  template cudaError_t launch_mega_config<MegaFc2Cfg<BM, false>, MegaFc1CfgNvfp4<BM>>(                             \
      const MegaGemms&, const MegaArgs&, int, bool, cudaStream_t);                                                 \
  template cudaError_t mega_config_occupancy<MegaFc2Cfg<BM, false>, MegaFc1CfgNvfp4<BM>>(int*);

#define MEGAMOE_MEGA_EXTERN(BM, FP8)                                                                               \
  extern template cudaError_t launch_mega_config<MegaFc2Cfg<BM, FP8>, MegaFc1Cfg<BM, FP8>>(                        \
      const MegaGemms&, const MegaArgs&, int, bool, cudaStream_t);                                                 \
  extern template cudaError_t mega_config_occupancy<MegaFc2Cfg<BM, FP8>, MegaFc1Cfg<BM, FP8>>(int*);
#define MEGAMOE_MEGA_INSTANTIATE(BM, FP8)                                                                          \
  template cudaError_t launch_mega_config<MegaFc2Cfg<BM, FP8>, MegaFc1Cfg<BM, FP8>>(                               \
      const MegaGemms&, const MegaArgs&, int, bool, cudaStream_t);                                                 \
  template cudaError_t mega_config_occupancy<MegaFc2Cfg<BM, FP8>, MegaFc1Cfg<BM, FP8>>(int*);

}  // namespace megamoe::mega
