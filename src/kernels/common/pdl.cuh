// Programmatic dependent launch (sm_90) for the transport's chain of kernels: dispatch -> pool build
// (3 kernels) -> combine, each launched with launch_pdl, each starting with pdl_enter().
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may begin launching
// while the kernel before it in the stream still runs, once every CTA of that kernel has called
// griddepcontrol.launch_dependents (or exited); its CTAs then block in griddepcontrol.wait until
// the previous kernel has completed and its memory is visible. So the launch latency of each kernel
// hides behind its predecessor's tail, and nothing is read early.
// invariant: every kernel launched with launch_pdl calls pdl_enter() before touching memory (and
// before it can complete), so completion still chains: kernel N done implies kernel N - 1 done.
// invariant: a kernel that needs its whole grid co-resident (combine_kernel) is safe: its CTAs pass
// griddepcontrol.wait only once the previous grid is gone, and its dependents can only launch after
// every one of its own CTAs has started (launch_dependents counts all of them).
// Outside a PDL launch (or before sm_90) both instructions do nothing.
// Used only for small launches (pdl_wanted): on 2 H200s whole forwards at 1 / 8 tokens are ~2 us
// faster with it, at 128 the same, and at 1024 / 8192 tokens 7 / 87 us slower: CTAs that launch early
// onto a busy GPU end up unevenly spread over the SMs (docs/perf-history/transport.md, session 5).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe {
namespace kernels {

__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Programmatic launch for this many tokens per rank (the transport's small launches).
inline bool pdl_wanted(int64_t num_tokens) { return num_tokens <= 128; }

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute when
// `pdl` (else an ordinary launch; the kernel's pdl_enter() is then a no-op).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                       Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = pdl ? &attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KernelArgs>(args)...);
}

}  // namespace kernels
}  // namespace megamoe
