// Kernels of `megamoe bench-link` (sm90_link_probe.h): four ways of moving bytes to or from a peer.
#include "sm90_link_probe.h"

#include <nccl_device.h>

#include "kernels/common/pdl.cuh"
#include "kernels/common/sm90_signals.cuh"
#include "kernels/gemm/sm90_gemm_ptx.cuh"
#include "kernels/transport/sm90_transport_args.cuh"

namespace megamoe {
namespace kernels {

namespace {

using namespace gemm::ptx;

template <bool kRemoteSrc>
__global__ void __launch_bounds__(1024) link_copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                         int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = kRemoteSrc ? src[i + u * stride] : ld_nc_v4(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = kRemoteSrc ? src[i] : ld_nc_v4(src + i);
}

// kStaged: warp w of the grid sends chunks w, w + W, ... through two shared-memory buffers.
__global__ void link_staged_kernel(const char* __restrict__ src, char* __restrict__ dst, int64_t chunks, int chunk) {
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  char* buf = smem + static_cast<int64_t>(warp) * 2 * chunk;
  const int64_t W = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  int it = 0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp; j < chunks; j += W, ++it) {
    char* b = buf + (it & 1) * chunk;
    if (it >= 2) {  // the store issued two chunks ago has read this buffer
      if (lane == 0) bulk_wait_read<1>();
      __syncwarp();
    }
    const char* s = src + j * chunk;
    for (int off = lane * 64; off < chunk; off += 32 * 64) {  // 4 loads in flight per lane
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = ld_nc_v4(s + off + 16 * u);
#pragma unroll
      for (int u = 0; u < 4; ++u) *reinterpret_cast<uint4*>(b + off + 16 * u) = v[u];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> async proxy
    __syncwarp();
    if (lane == 0) {
      bulk_store_1d(dst + j * chunk, b, static_cast<uint32_t>(chunk));
      bulk_commit();
    }
  }
  if (lane == 0) bulk_wait_all();
}

// kTma: lane 0 of each warp; `stages` buffers of `chunk` bytes, each with its mbarrier.
__global__ void link_tma_kernel(const char* __restrict__ src, char* __restrict__ dst, int64_t chunks, int chunk,
                                int stages) {
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * stages;
  char* buf = smem + 8 * warps * stages + 128;  // the barriers first, buffers 128-byte aligned after
  buf = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buf) + 127) & ~uintptr_t(127)) +
        static_cast<int64_t>(warp) * stages * chunk;
  if (lane != 0) return;
  const int64_t W = static_cast<int64_t>(gridDim.x) * warps;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * warps + warp;
  const int64_t mine = first < chunks ? (chunks - first + W - 1) / W : 0;
  for (int s = 0; s < stages; ++s) mbar_init(&bars[s], 1);
  mbar_init_fence();
  const auto load = [&](int64_t it) {
    const int s = static_cast<int>(it % stages);
    mbar_arrive_expect_tx(&bars[s], static_cast<uint32_t>(chunk));
    bulk_load_1d(buf + s * chunk, src + (first + it * W) * chunk, static_cast<uint32_t>(chunk), &bars[s]);
  };
  for (int64_t it = 0; it < mine && it < stages; ++it) load(it);
  for (int64_t it = 0; it < mine; ++it) {
    const int s = static_cast<int>(it % stages);
    mbar_wait(&bars[s], static_cast<uint32_t>((it / stages) & 1));
    bulk_store_1d(dst + (first + it * W) * chunk, buf + s * chunk, static_cast<uint32_t>(chunk));
    bulk_commit();
    // refill the previous chunk's buffer once its store has read it (one store left reading)
    if (it >= 1 && it - 1 + stages < mine) {
      bulk_wait_read<1>();
      load(it - 1 + stages);
    }
  }
  bulk_wait_all();
}

// launch_link_handshake: the transport kernels' signal path with nothing before it.
__global__ void link_handshake_kernel(uint64_t* own_flag, uint64_t* peer_flag, uint64_t* state, uint64_t timeout_ns) {
  pdl_enter();
  __syncthreads();
  if (threadIdx.x != 0) return;
  fence_acq_rel_sys();
  if (gridDim.x > 1) {
    if (atomic_add_acq_rel_gpu(&state[1], 1) + 1 != gridDim.x) return;
    state[1] = 0;  // the next launch's tickets start after this kernel completed (stream order)
  }
  const uint64_t e = state[0] + 1;
  state[0] = e;
  st_release_sys(peer_flag, e);
  const uint64_t t0 = globaltimer_ns();
  while (ld_acquire_sys(own_flag) < e) {
    if (globaltimer_ns() - t0 > timeout_ns) {
      state[2] += 1;
      break;
    }
  }
}

__device__ __forceinline__ uint32_t pattern(int rank, int64_t i) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ (static_cast<uint32_t>(rank) << 28);
  h ^= h >> 15;
  h *= 0x85EBCA77u;
  return h ^ (h >> 13);
}

__global__ void fill_kernel(uint32_t* p, int64_t n, int rank) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = pattern(rank, i);
}

__global__ void check_kernel(const uint32_t* p, int64_t n, int rank, unsigned long long* bad) {
  unsigned long long local = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    local += p[i] != pattern(rank, i);
  if (local) atomicAdd(bad, local);
}

__global__ void peer_base_kernel(ncclWindow_t win, int peer, void** out) {
  *out = ncclGetPeerPointer(win, 0, peer);
}

}  // namespace

cudaError_t link_probe_peer_base(ncclWindow_t win, int peer, void** base) {
  void** d = nullptr;
  cudaError_t e = cudaMalloc(&d, sizeof(void*));
  if (e != cudaSuccess) return e;
  peer_base_kernel<<<1, 1>>>(win, peer, d);
  e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaMemcpy(base, d, sizeof(void*), cudaMemcpyDeviceToHost);
  cudaFree(d);
  return e;
}

int link_probe_smem_bytes(LinkPath path, const LinkProbeShape& shape) {
  if (path == LinkPath::kStaged) return shape.warps * 2 * shape.chunk_bytes;
  if (path == LinkPath::kTma) return 8 * shape.warps * shape.stages + 256 + shape.warps * shape.stages * shape.chunk_bytes;
  return 0;
}

cudaError_t launch_link_probe(LinkPath path, const LinkProbeShape& shape, const void* src, void* dst, int64_t bytes,
                              cudaStream_t stream) {
  const int threads = 32 * shape.warps;
  const int smem = link_probe_smem_bytes(path, shape);
  switch (path) {
    case LinkPath::kStore:
      link_copy_kernel<false><<<shape.blocks, threads, 0, stream>>>(static_cast<const uint4*>(src),
                                                                     static_cast<uint4*>(dst), bytes / 16);
      break;
    case LinkPath::kPull:
      link_copy_kernel<true><<<shape.blocks, threads, 0, stream>>>(static_cast<const uint4*>(src),
                                                                    static_cast<uint4*>(dst), bytes / 16);
      break;
    case LinkPath::kStaged: {
      cudaError_t e = cudaFuncSetAttribute(link_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      link_staged_kernel<<<shape.blocks, threads, smem, stream>>>(static_cast<const char*>(src), static_cast<char*>(dst),
                                                                  bytes / shape.chunk_bytes, shape.chunk_bytes);
      break;
    }
    case LinkPath::kTma: {
      cudaError_t e = cudaFuncSetAttribute(link_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      link_tma_kernel<<<shape.blocks, threads, smem, stream>>>(static_cast<const char*>(src), static_cast<char*>(dst),
                                                               bytes / shape.chunk_bytes, shape.chunk_bytes, shape.stages);
      break;
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_link_handshake(int ctas, int threads, bool pdl, uint64_t* own_flag, uint64_t* peer_flag,
                                  uint64_t* state, uint64_t timeout_ns, cudaStream_t stream) {
  return launch_pdl(link_handshake_kernel, dim3(ctas), dim3(threads), 0, stream, pdl, own_flag, peer_flag, state,
                    timeout_ns);
}

cudaError_t link_probe_fill(void* p, int64_t bytes, int rank, cudaStream_t stream) {
  fill_kernel<<<1024, 256, 0, stream>>>(static_cast<uint32_t*>(p), bytes / 4, rank);
  return cudaGetLastError();
}

cudaError_t link_probe_check(const void* p, int64_t bytes, int rank, unsigned long long* bad, cudaStream_t stream) {
  check_kernel<<<1024, 256, 0, stream>>>(static_cast<const uint32_t*>(p), bytes / 4, rank, bad);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace megamoe
