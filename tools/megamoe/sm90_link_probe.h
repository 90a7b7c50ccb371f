// NVLink store paths between two GPUs, measured (`megamoe bench-link`): which way of moving bytes to
// a peer's symmetric window gets closest to the link. The transport kernels use plain 16-byte stores
// through LSA pointers; this tells what TMA bulk stores and pulls would give instead.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>

namespace megamoe {
namespace kernels {

enum class LinkPath : int32_t {
  kStore = 0,     // 16-byte loads of the local source, 16-byte st.global to the peer (4 in flight per thread)
  kStaged = 1,    // each warp loads a chunk into registers, writes it to shared memory, one lane sends it
                  // with a TMA bulk store (cp.async.bulk.global.shared::cta), two chunks in flight
                  // (what a kernel that computes the bytes, e.g. quantises, would do)
  kTma = 2,       // bulk load (global -> shared, mbarrier) then bulk store (shared -> peer), one lane per
                  // warp, `stages` chunks in flight: no registers hold the data
  kPull = 3,      // 16-byte loads from the peer's window, stores to the local destination
};

struct LinkProbeShape {
  int blocks;       // CTAs
  int warps;        // warps per CTA
  int chunk_bytes;  // kStaged / kTma: bytes per bulk copy, a multiple of 16
  int stages;       // kTma: chunks in flight per warp (kStaged: 2)
};

// Dynamic shared memory a launch of `path` needs (0 for the register paths).
int link_probe_smem_bytes(LinkPath path, const LinkProbeShape& shape);

// Copies `bytes` (a multiple of chunk_bytes for the bulk paths, of 16 otherwise) from src to dst, one
// of them on a peer GPU (dst for kStore / kStaged / kTma, src for kPull). Asynchronous on `stream`.
cudaError_t launch_link_probe(LinkPath path, const LinkProbeShape& shape, const void* src, void* dst, int64_t bytes,
                              cudaStream_t stream);

// One cross-GPU round trip per launch, no payload (what a transport kernel's signal costs when it
// moves no bytes): every CTA of `ctas` x `threads` fences at system scope and takes a ticket (a
// single CTA skips the ticket); the last one bumps the launch epoch in state[0], stores it into the
// peer's flag (st.release.sys through its LSA pointer) and polls its own flag (ld.acquire.sys) until
// the peer's equal epoch arrives, at most `timeout_ns` (then state[2] += 1). state: device uint64[3]
// {epoch, ticket, timeouts}, zero along with *own_flag before the first launch; the peer runs the same
// launches. `pdl`: launched with programmatic stream serialisation (the transport's small launches).
cudaError_t launch_link_handshake(int ctas, int threads, bool pdl, uint64_t* own_flag, uint64_t* peer_flag,
                                  uint64_t* state, uint64_t timeout_ns, cudaStream_t stream);

// The LSA address of byte 0 of `peer`'s copy of window `win` (ncclGetPeerPointer, run on the device
// of the calling thread; synchronous).
cudaError_t link_probe_peer_base(ncclWindow_t win, int peer, void** base);

// Pattern of rank `rank`'s source: word i = hash(rank, i). Written / counted on `stream`; the
// mismatch count lands in *bad (device memory, added to).
cudaError_t link_probe_fill(void* p, int64_t bytes, int rank, cudaStream_t stream);
cudaError_t link_probe_check(const void* p, int64_t bytes, int rank, unsigned long long* bad, cudaStream_t stream);

}  // namespace kernels
}  // namespace megamoe
