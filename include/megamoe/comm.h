// megamoe/comm.h — the expert-parallel group a layer belongs to.
//
// Contract: a Communicator is one rank's handle on a group of `size()` ranks. Layers built on handles
// of one group exchange tokens with each other; every rank must call the same collective operations
// (warmup(), forward()) in the same order, each from its own thread or process.
//
// Kinds:
// - host threads: R ranks inside this process, each driven by its own thread, exchanging through host
//   memory (the cpu backend's EP protocol; runs anywhere).
// - NCCL (GPU backends): one rank per GPU over an NCCL communicator whose ranks reach each other by
//   NVLink load/store (NCCL's LSA team); tokens move through NCCL symmetric memory. Two ways in:
//   create_nccl_group() (one process drives several GPUs, one thread per rank) and create_nccl_rank()
//   (one process per GPU, as inference engines launch; `megamoe launch -n N -- cmd` starts N of them).
//   Multi-node (NCCL GIN) is designed for but not built: a group whose ranks are not all LSA-reachable
//   is refused with a message saying so.
// - shared GPU (GPU backends; tests, benches, single-GPU development): R logical ranks on ONE GPU,
//   each driven by its own thread with its own buffers and streams, reaching its peers' buffers by
//   plain device pointers (no NCCL: it refuses two ranks on one device). See
//   create_shared_gpu_group().
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/status.h"

namespace megamoe {

enum class CommKind { kHostThreads = 0, kNccl, kSharedGpu };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual CommKind kind() const = 0;
  // Identifies the group: equal for all handles of one group, distinct between groups.
  virtual uint64_t group_id() const = 0;
  virtual std::string to_string() const = 0;
};

// R ranks as threads of this process over host memory. `ranks` receives one handle per rank, in rank
// order. Bounded waits inside the group use MEGAMOE_WAIT_TIMEOUT_MS (default 10000).
Status create_host_group(int size, std::vector<std::shared_ptr<Communicator>>* ranks);

// ---- Logical ranks sharing one GPU (GPU backends) ----

// `size` logical EP ranks (1..8) on CUDA device `device` (sm_90 or newer): (*ranks)[r] is rank r.
// What it is for: running the EP > 1 code paths of the GPU backends (dispatch to peers, the pool of
// received tokens, combine from peers, bounded waits and fault handling) on a machine with one GPU,
// so tests, benchmarks of correctness-relevant paths, and development need no second GPU.
// What it is not: a deployment mode. The ranks share one GPU's SMs and memory bandwidth, so it is
// never faster than one rank (EP1) on the same GPU; peer stores are local HBM stores, so it measures
// nothing about NVLink; and its timings do not model a multi-GPU system.
// Rules it imposes: drive each rank from its own thread (as with create_nccl_group); every kernel of
// a rank is sized to at most SMs / size CTAs by default (the backends apply it; a larger
// Knobs::num_sms is clamped to it), so that all ranks' kernels are resident at once and no rank's
// spinning wait holds the SMs its peer needs. Collective allocations are bounded by
// MEGAMOE_BARRIER_TIMEOUT_MS; releasing a rank's part never waits for its peers. The process must
// load its kernels eagerly (CUDA_MODULE_LOADING=EAGER before its first CUDA call; refused otherwise:
// a lazy load can wait for a peer's running kernel), and no rank may call a device-synchronising API
// (cudaFree, cudaDeviceSynchronize, a synchronous cudaMemcpy) while a peer's forward may be waiting
// for its launch.
// The group also needs the ranks' kernels to reach the GPU independently: CUDA feeds streams to the
// device through CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (default 8), and two streams on one
// queue run their kernels one after the other, so a rank's kernel queued behind a peer's waiting
// kernel cannot start until that wait gives up (a timeout, reported; with one queue every EP > 1
// forward times out). The group refuses CUDA_DEVICE_MAX_CONNECTIONS < size and creates one stream
// per rank, back to back (shared_gpu_stream()): run each rank's forwards on it, and set
// CUDA_DEVICE_MAX_CONNECTIONS=32 (CUDA's most) before the first CUDA call, as the project's GPU test
// binary and tool do. CUDA does not document how streams take queues, so a collision stays possible
// in a process with many live streams: it shows as that bounded timeout, never as a hang.
Status create_shared_gpu_group(int device, int size, std::vector<std::shared_ptr<Communicator>>* ranks);

// The stream (a cudaStream_t) of rank `rank` of a shared-GPU group (see above): non-blocking, owned by
// the group (never destroy it; it lives as long as any rank's handle). An error for any other
// communicator.
Status shared_gpu_stream(const Communicator& rank, void** stream);

// ---- NCCL groups (GPU backends; NCCL >= 2.28 with its device API) ----

// How one process joins a one-process-per-GPU group. from_env() reads what `megamoe launch` (or an
// inference engine) sets:
//   MEGAMOE_RANK, MEGAMOE_WORLD_SIZE   this process's rank and the group size (required)
//   MEGAMOE_LOCAL_RANK                 CUDA ordinal to use (default: MEGAMOE_RANK)
//   MEGAMOE_NCCL_ID_FILE               rank 0 writes NCCL's unique id to this path (atomically, by
//                                      rename); the other ranks wait for it (id_timeout_ms). Use a
//                                      fresh path per launch: a stale file from an earlier run would
//                                      be read as this run's id.
//   MEGAMOE_NCCL_ID                    alternatively, the unique id itself as 256 hex digits
//                                      (nccl_unique_id_hex()); takes precedence over the file.
// Integers are decimal digits only (no sign, space or suffix), at most kMaxRank; MEGAMOE_RANK must be
// below MEGAMOE_WORLD_SIZE. A refusal names the variable, its value (cut to 64 characters, bytes
// outside printable ASCII as \xNN) and the rule.
struct NcclBootstrap {
  static constexpr int kMaxRank = 1 << 20;
  static constexpr size_t kIdHexDigits = 256;  // 2 x NCCL_UNIQUE_ID_BYTES

  // The variables as given (empty = unset), in the order the list above names them.
  struct EnvValues {
    std::string rank, world_size, local_rank, id_file, id_hex;
  };

  int rank = -1;
  int world_size = 0;
  int device = -1;  // CUDA ordinal; -1 = rank
  std::string id_file;
  std::string id_hex;
  int64_t id_timeout_ms = 120000;

  static Status from_env(NcclBootstrap* out);  // from_values() of the process environment
  static Status from_values(const EnvValues& values, NcclBootstrap* out);
  std::string to_string() const;
};

// A fresh NCCL unique id as 256 hex digits (for launchers that pass it through MEGAMOE_NCCL_ID).
Status nccl_unique_id_hex(std::string* out);

// One process driving `devices.size()` GPUs (ncclCommInitAll): (*ranks)[r] is rank r on devices[r].
// Drive each rank from its own thread for collective calls (warmup, forward). Fails with a clear
// Status when NCCL is older than 2.28 at run time or a device is not sm_90 or newer.
Status create_nccl_group(const std::vector<int>& devices, std::vector<std::shared_ptr<Communicator>>* ranks);

// One process per GPU (ncclCommInitRank). Collective over the `world_size` processes.
Status create_nccl_rank(const NcclBootstrap& bootstrap, std::shared_ptr<Communicator>* out);

// A handle on an existing ncclComm_t (e.g. the engine's or torch's), which megamoe never destroys:
// the caller keeps it alive while layers use it. Rank and size come from the communicator; `device`
// must be its CUDA device. Refused: a null pointer (torch creates its communicator at the first
// collective on the group), a process with two different libnccl loaded (a communicator of one is
// meaningless to the other), and, before NCCL 2.31, a runtime NCCL other than the one megamoe was
// compiled against (the device communicator's layout is fixed at compile time). group_id() is unique
// within this process (a hash of the pointer), not agreed across processes.
Status adopt_nccl_comm(void* nccl_comm, int device, std::shared_ptr<Communicator>* out);

}  // namespace megamoe
