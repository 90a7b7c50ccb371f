// Device primitives for cross-GPU signalling over symmetric memory (sm_90a).
//
// Signals region (WorkspaceLayout::signals, uint64[R][kSignalSlots]), in rank d's copy:
//   [s][kSlotDispatch]  launches << 32, added to by source s's dispatch CTAs (each launch's shares sum
//                       to 2^32): at epoch << 32 s's dispatch rows of that epoch are in d's recv_*
//   [s][kSlotCombine]   epoch << 20 | bound, raised by owner s: s's partials of d's tokens whose
//                       recv row at s is below `bound` are in d's combine rows (kCombineAllRows: all)
//   [s][kSlotAbort]     non-zero once rank s gave up waiting (1 + stage); sticky: the group is dead
//   [d][kLocal*]        cells only d itself touches (launch epoch, block tickets)
// invariant: every cross-rank cell runs forwards only, modulo 2^64 (epochs and the values built from
// them wrap: the dispatch cell after 2^32 launches, the combine cell after 2^44), and every
// comparison with one is modular (cell_position), so no buffer is ever reset between launches, a
// launch's signals cannot be confused with the previous launch's, and nothing changes at a wrap.
// invariant: the launch epoch lives in the workspace (not in a kernel argument), so a CUDA graph replays
// with a fresh epoch each time; one kernel per forward bumps it (kLocalEpoch: the dispatch kernel's
// last CTA on the routed path, CTA 0 of the mega kernel).
//
// Bounded waits: wait_for_epoch() polls with ld.acquire.sys, checks the abort cells and %globaltimer,
// and on timeout records (rank, SM, stage, peer, expected, seen) in the error cell (first failure wins),
// raises the abort cell of this rank in every peer's copy (so they stop waiting promptly) and returns
// false. No trap: the host reads the error cell and turns it into a Status.
#pragma once

#include <cstdint>

#include "megamoe/workspace.h"

namespace megamoe {
namespace kernels {

// Where a cell that runs forwards modulo 2^64 stands against the window [lo, lo + span) of values
// a waiter accepts (lo and lo + span taken modulo 2^64 as well): kReady inside it; kAhead when it is
// past the window by less than half the range (a peer ran more launches than this rank: out of step);
// kBehind otherwise (the value is still to come). span must be below 2^63.
// Host and device: the one comparison every signal wait uses (the EP transport's, the fused kernel's).
enum class CellPosition : int { kBehind = 0, kReady = 1, kAhead = 2 };
MEGAMOE_HD CellPosition cell_position(uint64_t seen, uint64_t lo, uint64_t span) {
  const uint64_t d = seen - lo;  // modular
  if (d < span) return CellPosition::kReady;
  return d < (uint64_t(1) << 63) ? CellPosition::kAhead : CellPosition::kBehind;
}

}  // namespace kernels
}  // namespace megamoe

#if defined(__CUDACC__)
#include <nccl.h>
#include <nccl_device.h>

#include "kernels/common/sm90_clock.cuh"
#include "kernels/transport/sm90_launch.h"

namespace megamoe {
namespace kernels {

// Signal slots (SignalSlot) are in sm90_launch.h, so host code can read the cells too.

__device__ __forceinline__ int sm_id() {
  int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// *p = max(*p, v) at system scope, release: a cell that several publishers raise out of order
// never goes down.
__device__ __forceinline__ void red_max_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// *p += v at system scope, relaxed (after a fence.acq_rel.sys: a release pattern whose later RMWs of
// the same cell by other CTAs keep it in the value's release sequence).
__device__ __forceinline__ void red_add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_max_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Device-scope ticket: returns the old value (acq_rel, so the last taker sees every earlier block's
// writes that were fenced before their ticket).
__device__ __forceinline__ uint64_t atomic_add_acq_rel_gpu(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

// Release/acquire fence at system scope: this thread's earlier memory accesses, and by cumulativity
// every access that happens-before them (the CTA's stores before a bar.sync, an earlier kernel's in
// stream order), are ordered before its later ones for every observer, peers included. That is all
// the signal protocol needs; __threadfence_system() is fence.sc.sys, whose extra single total order
// it never uses and which costs more.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ncclGetPeerPointer out of line: a chain of loads from the window's tables, only taken before the
// peer bases are resolved (warmup); inlined at every peer_ptr it would bloat each kernel's code.
static __device__ __noinline__ char* nccl_peer_pointer(ncclWindow_t window, int64_t offset, int peer) {
  return static_cast<char*>(ncclGetPeerPointer(window, static_cast<size_t>(offset), peer));
}

// SignalCtx's device accessors (its fields: sm90_launch.h).
__device__ __forceinline__ uint64_t* SignalCtx::own_signals() const {
  return reinterpret_cast<uint64_t*>(own_base + signals_offset);
}
__device__ __forceinline__ uint64_t* SignalCtx::own_cell(int row, int slot) const {
  return own_signals() + row * WorkspaceLayout::kSignalSlots + slot;
}
__device__ __forceinline__ char* SignalCtx::peer_ptr(int peer, int64_t offset) const {
  if (peer == rank) return own_base + offset;
  if (peer_base[peer] != nullptr) return peer_base[peer] + offset;
  return nccl_peer_pointer(window, offset, peer);
}
__device__ __forceinline__ uint64_t* SignalCtx::peer_cell(int peer, int row, int slot) const {
  return reinterpret_cast<uint64_t*>(peer_ptr(peer, signals_offset)) + row * WorkspaceLayout::kSignalSlots + slot;
}
__device__ __forceinline__ uint64_t SignalCtx::local_epoch() const {
  return *reinterpret_cast<volatile uint64_t*>(own_cell(rank, kLocalEpoch));
}

// The first rank whose abort cell is raised in this rank's copy, or -1.
__device__ __forceinline__ int first_aborter(const SignalCtx& ctx) {
  for (int s = 0; s < ctx.num_ranks; ++s)
    if (ld_relaxed_sys(ctx.own_cell(s, kSlotAbort)) != 0) return s;
  return -1;
}

// Records the first failure of this rank (later ones are dropped).
__device__ __forceinline__ void record_wait_error(const SignalCtx& ctx, int32_t kind, int32_t stage, int32_t peer,
                                                  uint64_t expected, uint64_t seen) {
  if (atomicCAS(&ctx.error_cell->flag, 0, kind) == 0) {
    ctx.error_cell->rank = ctx.rank;
    ctx.error_cell->sm = sm_id();
    ctx.error_cell->stage = stage;
    ctx.error_cell->peer = peer;
    ctx.error_cell->expected = static_cast<int64_t>(expected);
    ctx.error_cell->seen = static_cast<int64_t>(seen);
    __threadfence_system();
  }
}

// Raises this rank's abort cell in every copy (its own included), so every waiter returns promptly.
__device__ __forceinline__ void raise_abort(const SignalCtx& ctx, int32_t stage) {
  fence_acq_rel_sys();
  for (int p = 0; p < ctx.num_ranks; ++p) st_relaxed_sys(ctx.peer_cell(p, ctx.rank, kSlotAbort), 1u + stage);
}

// Waits until the cell is inside [lo, hi) modulo 2^64 (cell_position with span = hi - lo). Returns
// true when it got there; false when a rank has aborted the group (recorded as kWaitPeerAbort;
// checked first, so a dead group stays dead even when a stale signal would let the wait pass), on
// timeout (recorded, abort raised), or when the cell is already past the window (kWaitDesync, abort
// raised). The error cell gets lo >> shift and seen >> shift (the epoch, for cells that carry more
// than the epoch in their low bits). sleep_ns > 0: sleep that long between polls from the start
// (waiters that may wait long while others work: less pressure on the cell's L2 slice).
// invariant: in a healthy group a cell never runs ahead of the waiter's epoch: a peer's next dispatch
// signal needs this rank's combine signal of this epoch, and its next combine signal needs this
// rank's next dispatch signal; so a cell past the window means the ranks ran different numbers of
// launches.
// One thread calls it.
static __device__ __noinline__ bool wait_for_range(const SignalCtx& ctx, const uint64_t* cell, uint64_t lo, uint64_t hi,
                                                   int32_t stage, int32_t peer, int shift, uint32_t sleep_ns) {
  const uint64_t span = hi - lo;  // modular: the window's width whatever the wrap
  uint64_t seen = ld_acquire_sys(cell);
  const int dead = first_aborter(ctx);
  if (dead >= 0) {
    record_wait_error(ctx, kWaitPeerAbort, stage, dead, lo >> shift, seen >> shift);
    return false;
  }
  const uint64_t start = globaltimer_ns();
  for (uint32_t iter = 1;; ++iter) {
    const CellPosition pos = cell_position(seen, lo, span);
    if (pos == CellPosition::kReady) return true;
    if (pos == CellPosition::kAhead) {
      record_wait_error(ctx, kWaitDesync, stage, peer, lo >> shift, seen >> shift);
      raise_abort(ctx, stage);
      return false;
    }
    if ((iter & 63u) == 0) {
      const int aborter = first_aborter(ctx);
      if (aborter >= 0) {
        record_wait_error(ctx, kWaitPeerAbort, stage, aborter, lo >> shift, seen >> shift);
        return false;
      }
      if (globaltimer_ns() - start > static_cast<uint64_t>(ctx.timeout_ns)) {
        record_wait_error(ctx, kWaitTimeout, stage, peer, lo >> shift, seen >> shift);
        raise_abort(ctx, stage);
        return false;
      }
      if (iter > 4096) __nanosleep(256);
    }
    if (sleep_ns > 0) __nanosleep(sleep_ns);
    seen = ld_acquire_sys(cell);
  }
}

// Waits (bounded, as wait_for_range) until a cell this rank's own CTAs raise reaches `target`
// (a plain count, reset between launches: not a cross-rank epoch); a timeout is recorded with this
// rank as the peer.
static __device__ __noinline__ bool wait_local_at_least(const SignalCtx& ctx, const uint64_t* cell, uint64_t target,
                                                        int32_t stage) {
  const uint64_t start = globaltimer_ns();
  for (uint32_t iter = 1;; ++iter) {
    const uint64_t seen = ld_acquire_gpu(cell);
    if (seen >= target) return true;
    if ((iter & 63u) == 0) {
      if (first_aborter(ctx) >= 0) return false;
      if (globaltimer_ns() - start > static_cast<uint64_t>(ctx.timeout_ns)) {
        record_wait_error(ctx, kWaitTimeout, stage, ctx.rank, target, seen);
        raise_abort(ctx, stage);
        return false;
      }
    }
    __nanosleep(64);
  }
}

// Waits until *cell == expected (see wait_for_range).
__device__ __forceinline__ bool wait_for_epoch(const SignalCtx& ctx, const uint64_t* cell, uint64_t expected,
                                               int32_t stage, int32_t peer) {
  return wait_for_range(ctx, cell, expected, expected + 1, stage, peer, 0, 0);
}

// Waits for cell [s][slot] == epoch (modulo 2^64) for every rank s. Returns false at the first failure.
__device__ __forceinline__ bool wait_all_ranks(const SignalCtx& ctx, int slot, uint64_t epoch, int32_t stage) {
  for (int s = 0; s < ctx.num_ranks; ++s)
    if (!wait_for_epoch(ctx, ctx.own_cell(s, slot), epoch, stage, s)) return false;
  return true;
}

// Waits for lo <= cell [s][slot] < hi for every source rank s (see wait_for_range; `shift` as there).
// Returns false at the first failure.
__device__ __forceinline__ bool wait_all_sources(const SignalCtx& ctx, int slot, uint64_t lo, uint64_t hi, int32_t stage,
                                                 int shift) {
  for (int s = 0; s < ctx.num_ranks; ++s)
    if (!wait_for_range(ctx, ctx.own_cell(s, slot), lo, hi, stage, s, shift, 0)) return false;
  return true;
}

// Publishes `epoch` in cell [rank][slot] of every rank's copy, with release semantics: one
// fence.acq_rel.sys, then relaxed stores (PTX's release pattern, a fence followed by a strong write).
// A st.release.sys per rank would fence before each store, and each fence after the first waits
// for the previous store to reach its (remote) rank: a serial NVLink round trip per rank (on 2
// H200s the rank whose first store is remote signals ~0.5 us later).
__device__ __forceinline__ void signal_all_ranks(const SignalCtx& ctx, int slot, uint64_t epoch) {
  fence_acq_rel_sys();
  for (int p = 0; p < ctx.num_ranks; ++p) st_relaxed_sys(ctx.peer_cell(p, ctx.rank, slot), epoch);
}

}  // namespace kernels
}  // namespace megamoe
#endif  // __CUDACC__
