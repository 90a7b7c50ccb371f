// megamoe/knobs.h — the knob cache: tuned Knobs and measured mega/routed crossovers, per device and
// layer shape, persisted as JSON.
//
// Contract:
// - A KnobKey names one tuned case: the device (its CUDA name, e.g. "NVIDIA H200"), the three formats
//   and the shape (ep_size, hidden, intermediate, num_experts, top_k, max_tokens). max_tokens is the
//   geometry's max_tokens_per_rank, used as a bucket (see lookup()).
// - KnobCache::load() never fails hard: a missing, unreadable, wrong-version or corrupt file gives an
//   empty cache and a warning; an entry with an invalid field is skipped with a warning naming the
//   entry index and the field, and the rest of the file still loads. Warnings are logged (log_warn)
//   and, joined by "; ", returned through `warning`. No exception escapes.
// - lookup() applies the bucket rule on max_tokens among the entries whose other key fields match
//   exactly: the exact max_tokens, else the smallest bucket >= it, else the largest bucket < it.
// - save() writes atomically (temp file in the target's directory, fsync, rename), creating the
//   directory; on failure it returns kIoError naming the path and leaves no temp file behind.
// - process_knob_cache() is the cache at MEGAMOE_KNOB_CACHE (default
//   ${XDG_CACHE_HOME:-~/.cache}/megamoe/knobs.json), loaded once, lazily, thread-safely; empty when
//   MEGAMOE_KNOB_CACHE=off. A file that does not exist there is the normal untuned state: empty cache,
//   logged at debug level only. Any other load problem warns as load() does.
//
// File format (version 1). Enum names are the canonical names of megamoe/types.h (to_string /
// parse_*). Entries are written in key order; "knobs" fields and the fields after "knobs" may be
// omitted on read (defaults 0, "auto", 0, 0.0, {}, ""), and a reader ignores fields it does not know.
//   {
//     "version": 1,
//     "entries": [
//       {
//         "device": "NVIDIA H200",             // string
//         "weight_format": "fp8-block",        // WeightFormat name
//         "dispatch_format": "fp8-block",      // DispatchFormat name
//         "combine_dtype": "bf16",             // CombineDtype name
//         "ep_size": 8,                        // integer >= 1
//         "hidden": 7168,                      // integer >= 1
//         "intermediate": 2048,                // integer >= 1
//         "num_experts": 256,                  // integer >= 1
//         "top_k": 8,                          // integer >= 1
//         "max_tokens": 128,                   // integer >= 0 (bucket: max_tokens_per_rank)
//         "knobs": {"block_m": 64, "block_n": 128, "num_sms": 0, "combine_groups": 0,
//                   "gemm_cluster": 0, "gemm_tile_order": 0},  // knob_fields(); Knobs::validate();
//                                              // every knob optional, 0 = heuristic
//         "owner_reduce": "auto",              // OwnerReduce name: a measured choice for configs that
//                                              // leave it to auto (MoeConfig::owner_reduce)
//         "mega_max_tokens_per_rank": 256,     // integer >= -1; measured crossover: mega up to this
//                                              // many tokens per rank, routed above; 0 = none
//                                              // measured, -1 = routed measured faster at every bucket
//         "measured_us": 41.5,                 // number >= 0: the chosen configuration's time
//         "backend_us": {"routed": 41.5, "mega": 30.2},  // numbers >= 0: each backend's best time at
//                                              // this bucket (what the crossover was computed from)
//         "note": "megamoe tune 2025-01-01"    // string
//       }
//     ]
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe {

struct KnobKey {
  std::string device_name;
  WeightFormat weight_format = WeightFormat::kFp8Block;
  DispatchFormat dispatch_format = DispatchFormat::kFp8Block;
  CombineDtype combine_dtype = CombineDtype::kBf16;
  int64_t ep_size = 1;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t max_tokens = 0;  // the bucket: max_tokens_per_rank

  // "KnobKey(device=NVIDIA H200, weight_format=fp8-block, ..., max_tokens=128)"
  std::string to_string() const;
  bool operator==(const KnobKey& o) const;
  bool operator!=(const KnobKey& o) const { return !(*this == o); }
  // invariant: orders by every field but max_tokens first and max_tokens last, so the buckets of one
  // shape are contiguous and sorted (lookup() relies on it).
  bool operator<(const KnobKey& o) const;
  // Equal in every field except max_tokens.
  bool same_shape(const KnobKey& o) const;
};

// max_tokens = g.max_tokens_per_rank; ep_rank does not enter the key (all ranks share the tuning).
KnobKey make_knob_key(const std::string& device_name, const MoeGeometry& g, const MoeConfig& c);

// One field of Knobs as the knob cache names it. Every reader and writer of Knobs fields (the cache's
// load and save, apply_tuned_knobs, megamoe tune) goes through this table: a new knob is a Knobs
// field, its line here and its rule in Knobs::validate().
struct KnobField {
  const char* name;
  int32_t Knobs::*member;
};
const std::vector<KnobField>& knob_fields();

// mega_max_tokens_per_rank of an entry when routed was measured faster at every bucket.
constexpr int64_t kMegaNever = -1;

struct KnobEntry {
  Knobs knobs;
  OwnerReduce owner_reduce = OwnerReduce::kAuto;  // kAuto: no measured choice
  int64_t mega_max_tokens_per_rank = 0;  // measured mega/routed crossover, 0 = none, kMegaNever
  double measured_us = 0;
  std::map<std::string, double> backend_us;  // backend name -> its best time at this bucket
  std::string note;
};

class KnobCache {
 public:
  static constexpr int kVersion = 1;

  // Never fails hard: a missing, unreadable, wrong-version or corrupt file yields an empty cache and a
  // warning (returned in *warning and logged with log_warn), never a crash or exception. *warning is
  // cleared when the file loads cleanly.
  static KnobCache load(const std::string& path, std::string* warning = nullptr);
  // load() on a file's text already read; `source` names it in the warnings ("knob cache <source>").
  static KnobCache parse(const std::string& text, const std::string& source, std::string* warning = nullptr);
  // The file's text that save() writes (version 1, entries in key order); parse() reads it back to
  // the same entries with no warning.
  std::string to_json() const;

  // Bucket rule on max_tokens among entries whose other key fields match exactly: the exact
  // max_tokens, else the smallest bucket >= it, else the largest bucket < it.
  std::optional<KnobEntry> lookup(const KnobKey& key) const;
  // Inserts, or replaces the entry with the same key (max_tokens included).
  void put(const KnobKey& key, const KnobEntry& entry);
  // Atomic write: temp file in the same directory + fsync + rename; creates the directory. Returns
  // kIoError naming the path on failure.
  Status save(const std::string& path) const;
  size_t size() const { return entries_.size(); }
  // All entries in key order (for printing).
  std::vector<std::pair<KnobKey, KnobEntry>> entries() const;

 private:
  std::map<KnobKey, KnobEntry> entries_;
};

// The process-wide cache at MEGAMOE_KNOB_CACHE (loaded once, lazily; empty when "off"). The returned
// reference stays valid for the life of the process.
const KnobCache& process_knob_cache();
// Tests: forget the loaded cache so the next process_knob_cache() re-reads the file named by
// env_knobs() (call reload_env_knobs() first after changing the environment). Must not race with
// readers of the returned reference.
void reset_process_knob_cache();

// The config with tuned knobs filled in: each Knobs field left at 0 (heuristic) takes the value of
// the cache entry for (device_name, geometry, config) under the bucket rule; a field the caller set
// stays. owner_reduce left at kAuto takes the entry's measured choice (kOn only where the config
// allows it: not with in_kernel_fc2_reduce). Returns `config` unchanged when there is no entry.
// *note (optional) says what was applied.
MoeConfig apply_tuned_knobs(const MoeConfig& config, const MoeGeometry& geometry, const std::string& device_name,
                            const KnobCache& cache, std::string* note = nullptr);

// The mega/routed threshold `auto` uses for (geometry, config) and where it came from: the config's
// own value when it is not the default (an explicit setting wins), else the measured crossover of the
// cache entry for (device_name, geometry, config) under the bucket rule (kMegaNever -> 0: never
// mega), else the default. device_name empty: the cache is not consulted (no CUDA device).
struct MegaThreshold {
  int64_t value = 0;
  std::string source;  // "MoeConfig::mega_max_tokens_per_rank (default)", "knob cache entry ...", ...
  bool from_cache = false;
};
MegaThreshold mega_threshold_in_force(const MoeGeometry& geometry, const MoeConfig& config,
                                      const std::string& device_name, const KnobCache& cache);

}  // namespace megamoe
