// NCCL symmetric memory for the EP transport: the workspace allocator and the device communicator.
//
// symmetric_alloc() is the WorkspacePool allocator of the GPU backends. Collective: every rank of the
// communicator calls it with the same size, in the same order (WorkspacePool::acquire allocates
// outside its lock, so ranks driven by threads of one process can each take part). It does
// ncclMemAlloc, zeroes the memory (signals, error cell and counts must start at 0 on every rank before
// any peer writes; the registration that follows is collective, so no peer can write earlier), then
// ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC). The release function deregisters and frees
// inside a CollectiveReleaseScope (gpu_comm.h; collective: every rank, each from its own thread),
// else defers both to the communicator's destructor (NcclRankComm::defer_window): it never waits for
// a peer.
//
// ensure_device_comm() creates the communicator's ncclDevComm once (collective) and checks that every
// rank is reachable by load/store (LSA team == the whole group). A group spanning nodes is refused:
// the GIN (ncclGin::put + signals) path is designed for but not built yet (docs/TRANSPORT.md lists
// the store sites it would replace).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megamoe/status.h"

namespace megamoe {

class NcclRankComm;

Status symmetric_alloc(const std::shared_ptr<NcclRankComm>& comm, int64_t bytes, void** base,
                       std::function<void(void*)>* release);

// The window symmetric_alloc() registered for `base`, or null.
ncclWindow_t symmetric_window_of(const void* base);

// (*out)[r] = the device address of byte 0 of rank r's copy of `window` (r < num_ranks), through the
// LSA window (an LSA peer's window is one fixed mapping, so base + offset addresses any byte of it).
// Synchronous: warmup only.
Status window_peer_bases(ncclWindow_t window, int num_ranks, int device, std::vector<void*>* out);

Status ensure_device_comm(NcclRankComm* comm);

}  // namespace megamoe
