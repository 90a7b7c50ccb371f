// `megamoe tune` — see tune.h and docs/TOOL.md.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <optional>

#include "commands.h"
#include "core/device.h"
#include "core/env.h"
#include "megamoe/knobs.h"
#include "megamoe/layer.h"
#include "plot.h"
#include "tune_session.h"

#ifndef MEGAMOE_VERSION
#define MEGAMOE_VERSION "unknown"
#endif

namespace megamoe::tool {
namespace {

using Clock = std::chrono::steady_clock;
using tune::Candidate;

// What the flags ask for, checked before anything is built.
struct TunePlan {
  std::vector<int64_t> buckets;  // ascending, distinct
  std::vector<Backend> backends;
  std::vector<std::string> knob_names;  // empty: every knob
  tune::Search search = tune::Search::kStaged;
  double min_gain = 0.01;
  int64_t warmup = 2, iters = 10, reps = 3, verify_tokens = 8;
  uint64_t seed = 1;
  reference::Routing routing = reference::Routing::kUniform;
  std::string cache_path;
  std::string device;  // the knob cache's device name
  int num_sms = 132;
  std::string sms_note;  // how num_sms was found
  MoeGeometry geometry;  // max_tokens_per_rank = the largest bucket
  MoeConfig config;
};

// The backend whose layers run backend b's candidates.
Backend runs_on(const TuneHooks& hooks, Backend b) {
  const auto it = hooks.stand_in.find(b);
  return it == hooks.stand_in.end() ? b : it->second;
}

// Why backend b cannot be tuned here (empty: it can).
std::string unavailable(const TuneHooks& hooks, Backend b, const MoeGeometry& g, const MoeConfig& c) {
  const Backend on = runs_on(hooks, b);
  if (on == Backend::kCpu) return "";
  const Status gate = on == Backend::kMega ? mega_capability(g, c) : routed_capability(g, c);
  return gate ? "" : std::string("backend=") + to_string(b) + " is unavailable: " + gate.message();
}

std::string default_cache_path() {
  const EnvKnobs& env = env_knobs();
  if (env.knob_cache_off)
    throw ToolError(kExitUsage, "MEGAMOE_KNOB_CACHE=off and no --cache FILE: tune needs a file to write (give "
                                "--cache FILE, or set MEGAMOE_KNOB_CACHE to a path)");
  return env.knob_cache_path;
}

TunePlan plan_tune(const TuneOptions& o, const TuneHooks& hooks) {
  TunePlan p;
  for (int64_t t : parse_int_list_flag("--tokens", o.tokens, 1, 65535))
    if (std::find(p.buckets.begin(), p.buckets.end(), t) == p.buckets.end()) p.buckets.push_back(t);
  std::sort(p.buckets.begin(), p.buckets.end());
  for (const std::string& b : split_list(o.backends)) {
    const Backend backend = parse_backend_flag("--backend", b);
    if (backend != Backend::kRouted && backend != Backend::kMega)
      throw ToolError(kExitUsage, "invalid value for --backend: '" + b + "', must be routed or mega (routed,mega "
                                  "also measures the crossover); auto and cpu read no knobs");
    if (std::find(p.backends.begin(), p.backends.end(), backend) == p.backends.end()) p.backends.push_back(backend);
  }
  if (!o.knobs.empty()) p.knob_names = split_list(o.knobs);
  if (const Status st = tune::parse_search(o.search, &p.search); !st)
    throw ToolError(kExitUsage, "invalid value for --search: '" + o.search + "', must be staged or exhaustive");
  // Every --knobs name must be a knob of a requested backend (each backend tunes the ones it reads).
  for (const std::string& n : p.knob_names) {
    bool known = false;
    std::string error;
    for (Backend b : p.backends) {
      std::vector<const tune::KnobSpace*> s;
      const Status st = tune::spaces_for(b, {n}, &s);
      known = known || st.is_ok();
      if (!st) error = st.message();
    }
    if (!known) throw ToolError(kExitUsage, "invalid value for --knobs: " + error);
  }
  const bool on_cpu = runs_on(hooks, p.backends.front()) == Backend::kCpu;
  p.iters = o.iters.empty() ? (on_cpu ? 3 : 10) : parse_int_flag("--iters", o.iters, 1, 100000);
  p.warmup = o.warmup.empty() ? (on_cpu ? 1 : 2) : parse_int_flag("--warmup", o.warmup, 0, 100000);
  p.reps = parse_int_flag("--reps", o.reps, 1, 1000);
  p.verify_tokens = parse_int_flag("--verify-tokens", o.verify_tokens, 1, 65535);
  p.seed = static_cast<uint64_t>(parse_int_flag("--seed", o.seed, 0, INT64_MAX));
  p.routing = parse_routing_flag(o.routing);
  size_t used = 0;
  double gain = -1;
  try {
    gain = std::stod(o.min_gain, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != o.min_gain.size() || !(gain >= 0 && gain < 1))
    throw ToolError(kExitUsage, "invalid value for --min-gain: '" + o.min_gain +
                                    "', must be a fraction in [0, 1) (0.01: a candidate must be 1% faster than the "
                                    "best before it to replace it)");
  p.min_gain = gain;
  p.geometry = make_geometry(o.layer, p.buckets.back());
  p.config = make_config(o.layer, Backend::kAuto);
  if (const Status st = p.config.validate(p.geometry); !st) throw ToolError(kExitUsage, st.message());
  p.cache_path = o.cache.empty() ? default_cache_path() : o.cache;
  if (!o.plot.empty()) check_plot_path(o.plot, "--plot");
  const std::vector<CudaDeviceInfo> devices = cuda_devices();
  if (!devices.empty()) {
    p.device = devices.front().name;
    p.num_sms = devices.front().num_sms;
    p.sms_note = std::to_string(p.num_sms) + " SMs (" + p.device + ")";
  } else {
    p.device = "cpu";
    p.sms_note = "no CUDA device: num_sms candidates for 132 SMs (an H200)";
  }
  return p;
}

tune::TuneContext context(const TunePlan& p, Backend b, int64_t bucket) {
  tune::TuneContext ctx;
  ctx.geometry = p.geometry;
  ctx.geometry.max_tokens_per_rank = bucket;
  ctx.config = p.config;
  ctx.backend = b;
  ctx.num_sms = p.num_sms;
  return ctx;
}

std::vector<std::vector<const tune::KnobSpace*>> stages_of(const TunePlan& p, Backend b) {
  std::vector<const tune::KnobSpace*> spaces;
  std::vector<const tune::KnobSpace*> all;
  (void)tune::spaces_for(b, {}, &all);
  for (const tune::KnobSpace* k : all)  // --knobs: the named ones this backend reads
    if (p.knob_names.empty() || std::find(p.knob_names.begin(), p.knob_names.end(), k->name) != p.knob_names.end())
      spaces.push_back(k);
  return tune::search_stages(spaces, p.search);
}

std::string stage_name(const std::vector<const tune::KnobSpace*>& stage) {
  std::string s;
  for (const tune::KnobSpace* k : stage) s += (s.empty() ? "" : ", ") + k->name;
  return s;
}

// Candidate timings the whole run makes, with every stage's base the heuristic (for the ETA).
int64_t planned_timings(const TunePlan& p) {
  int64_t n = 0;
  for (int64_t t : p.buckets)
    for (Backend b : p.backends) {
      const auto stages = stages_of(p, b);
      if (stages.empty()) n += p.reps;
      for (const auto& stage : stages)
        n += static_cast<int64_t>(tune::stage_candidates(tune::heuristic(b), stage, context(p, b, t)).size()) * p.reps;
    }
  return n;
}

void print_plan_header(const TuneOptions& o, const TunePlan& p) {
  std::printf("megamoe tune: %s, hidden=%lld intermediate=%lld experts=%lld top_k=%lld, EP%lld; weight %s, dispatch "
              "%s, combine %s; device %s; %s\n",
              o.layer.preset.empty() ? "explicit dims" : ("preset " + o.layer.preset).c_str(),
              static_cast<long long>(p.geometry.hidden), static_cast<long long>(p.geometry.intermediate),
              static_cast<long long>(p.geometry.num_experts), static_cast<long long>(p.geometry.top_k),
              static_cast<long long>(p.geometry.ep_size), to_string(p.config.weight_format),
              to_string(p.config.dispatch_format), to_string(p.config.combine_dtype), p.device.c_str(),
              p.sms_note.c_str());
  std::printf("search %s, %lld rep(s) of %lld + %lld forwards per candidate, a candidate replaces the best before "
              "it when %.1f%% faster; knob cache %s\n",
              o.search.c_str(), static_cast<long long>(p.reps), static_cast<long long>(p.warmup),
              static_cast<long long>(p.iters), 100 * p.min_gain, p.cache_path.c_str());
}

int run_dry_run(const TuneOptions& o, const TunePlan& p, const TuneHooks& hooks) {
  print_plan_header(o, p);
  for (int64_t t : p.buckets)
    for (Backend b : p.backends) {
      const tune::TuneContext ctx = context(p, b, t);
      const std::string why = unavailable(hooks, b, ctx.geometry, ctx.config);
      std::printf("tokens %lld, %s%s\n", static_cast<long long>(t), to_string(b),
                  why.empty() ? "" : (": " + why + " (listed, not run)").c_str());
      const auto stages = stages_of(p, b);
      if (stages.empty()) std::printf("  no knobs: the heuristic, timed\n");
      for (size_t s = 0; s < stages.size(); ++s) {
        const std::vector<Candidate> cs = tune::stage_candidates(tune::heuristic(b), stages[s], ctx);
        std::printf("  stage %zu (%s): %zu candidate(s)%s\n", s + 1, stage_name(stages[s]).c_str(), cs.size(),
                    s == 0 ? "" : ", from the stages before's winner (listed from the heuristic)");
        for (const Candidate& c : cs) std::printf("    %s\n", c.label().c_str());
      }
    }
  std::printf("%lld candidate timings of %lld + %lld forwards (stages after the first: as listed)\n",
              static_cast<long long>(planned_timings(p)), static_cast<long long>(p.warmup),
              static_cast<long long>(p.iters));
  return kExitOk;
}

// A progress bar with the ETA on a terminal, a plain line every 2 s otherwise.
class Progress {
 public:
  explicit Progress(int64_t total) : total_(std::max<int64_t>(total, 1)), tty_(isatty(2) != 0), began_(Clock::now()) {}
  void step(const std::string& what) {
    ++done_;
    const Clock::time_point now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - began_).count();
    if (!tty_ && std::chrono::duration<double>(now - last_).count() < 2.0 && done_ < total_) return;
    last_ = now;
    const int64_t shown = std::min(done_, total_);
    const double eta = shown > 0 ? elapsed / static_cast<double>(shown) * static_cast<double>(total_ - shown) : 0;
    char line[320];
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(kWidth * shown / total_);
      std::snprintf(line, sizeof(line), "\r[tune] [%.*s%*s] %3lld%% %lld/%lld, %.0f s, ETA %.0f s  %-40.40s",
                    filled, "##############################", kWidth - filled, "",
                    static_cast<long long>(100 * shown / total_), static_cast<long long>(shown),
                    static_cast<long long>(total_), elapsed, eta, what.c_str());
    } else {
      std::snprintf(line, sizeof(line), "[tune] %lld/%lld candidate timings, %.0f s, ETA %.0f s: %s\n",
                    static_cast<long long>(shown), static_cast<long long>(total_), elapsed, eta, what.c_str());
    }
    std::fputs(line, stderr);
    std::fflush(stderr);
  }
  void finish() {
    if (tty_) std::fputs("\n", stderr);
  }

 private:
  int64_t total_, done_ = 0;
  bool tty_;
  Clock::time_point began_, last_;
};

// One backend's outcome at one bucket.
struct BackendReport {
  Backend backend = Backend::kRouted;
  std::string unavailable;  // non-empty: not run, and why
  tune::SearchResult search;
  Candidate accepted;
  double accepted_us = -1, heuristic_us = -1;
  VerifyResult verify;
  std::string rejected;  // a winner that failed its check, and why
};

struct BucketReport {
  int64_t tokens = 0;
  std::string status;  // tuned | cached
  std::vector<BackendReport> backends;
  KnobEntry entry;
};

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

// Tunes one backend at one bucket: the search, then the winner's check (a winner that fails gives
// way to the heuristic, which must pass).
// why_not: the agreed reason it cannot run (agreed_unavailable), empty where it can.
BackendReport tune_backend(const TunePlan& p, TuneShared* shared, Backend b, int64_t t, const std::string& why_not) {
  BackendReport rep;
  rep.backend = b;
  const tune::TuneContext ctx = context(p, b, t);
  rep.unavailable = why_not;
  if (!rep.unavailable.empty()) return rep;
  BucketLayers layers(shared, ctx.geometry, ctx.config, b);
  const Status st = tune::run_search(ctx, stages_of(p, b), p.min_gain,
                                     [&](const std::vector<Candidate>& cs, std::vector<double>* scores) {
                                       return layers.measure(cs, scores);
                                     },
                                     &rep.search);
  if (!st) throw ToolError(kExitUnavailable, "tokens " + std::to_string(t) + ", " + to_string(b) + ": " + st.message());
  rep.heuristic_us = rep.search.stages.empty() ? -1 : rep.search.stages.front().scores.front();
  rep.accepted = rep.search.best;
  rep.accepted_us = rep.search.best_us;
  Status vst = layers.verify(rep.accepted, &rep.verify);
  if (vst && !rep.verify.pass && rep.accepted != tune::heuristic(b)) {
    rep.rejected = rep.accepted.label() + ": " + rep.verify.detail + " (rel_l2 " + std::to_string(rep.verify.rel_l2) + ")";
    rep.accepted = tune::heuristic(b);
    rep.accepted_us = rep.heuristic_us;
    vst = layers.verify(rep.accepted, &rep.verify);
  }
  if (!vst) throw ToolError(kExitUnavailable, "tokens " + std::to_string(t) + ", checking " + to_string(b) + ": " + vst.message());
  if (!rep.verify.pass)
    throw ToolError(kExitCheckFailed, "tokens " + std::to_string(t) + ", " + to_string(b) +
                                          ": the heuristic's output fails the reference check (" + rep.verify.detail +
                                          ", rel_l2 " + std::to_string(rep.verify.rel_l2) + " > " +
                                          std::to_string(rep.verify.bound) + "): the layer itself is wrong");
  return rep;
}

// The cache entry of a tuned bucket: every backend's accepted knobs (a field two backends read takes
// routed's), routed's owner reduce, each backend's best time.
KnobEntry entry_of(const BucketReport& b) {
  KnobEntry e;
  std::string labels;
  for (const BackendReport& r : b.backends) {
    if (!r.unavailable.empty()) continue;
    for (const KnobField& f : knob_fields())
      if (e.knobs.*f.member == 0) e.knobs.*f.member = r.accepted.knobs.*f.member;
    if (r.backend == Backend::kRouted) e.owner_reduce = r.accepted.owner_reduce;
    e.backend_us[to_string(r.backend)] = r.accepted_us;
    if (e.measured_us == 0 || r.backend == Backend::kRouted) e.measured_us = r.accepted_us;
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %.1f us (heuristic %.1f)", r.accepted_us, r.heuristic_us);
    labels += std::string(labels.empty() ? "" : "; ") + to_string(r.backend) + " " + r.accepted.label() + buf;
  }
  e.note = "megamoe tune " + std::string(MEGAMOE_VERSION) + " " + today() + ": " + labels;
  return e;
}

std::optional<KnobEntry> exact_entry(const KnobCache& cache, const KnobKey& key) {
  for (const auto& [k, e] : cache.entries())
    if (k == key) return e;
  return std::nullopt;
}

// Whether `e` holds what this run would measure (every requested backend's time).
bool complete_entry(const KnobEntry& e, const std::vector<Backend>& backends) {
  for (Backend b : backends)
    if (!e.backend_us.count(to_string(b))) return false;
  return true;
}

// The cache at `path`: its entries (a file that does not exist: none). A file with problems is
// copied to path.bak first, since the entries that did not load are gone once the cache is written.
KnobCache load_cache(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return KnobCache();
  std::string warning;
  KnobCache cache = KnobCache::load(path, &warning);
  if (!warning.empty()) {
    const std::string bak = path + ".bak";
    std::filesystem::copy_file(path, bak, std::filesystem::copy_options::overwrite_existing, ec);
    std::fprintf(stderr, "[tune] the knob cache had problems (%s); %s; the %zu entries that loaded are kept\n",
                 warning.c_str(), ec ? ("it could not be copied to " + bak + ": " + ec.message()).c_str()
                                     : ("a copy of it is " + bak).c_str(),
                 cache.size());
  }
  return cache;
}

void save_cache(const KnobCache& cache, const std::string& path) {
  const Status st = cache.save(path);
  if (!st) throw ToolError(kExitIo, st.message());
}

const char* us_text(double us, char* buf, size_t n) {
  if (us < 0) return "-";
  std::snprintf(buf, n, "%.1f", us);
  return buf;
}

void print_report(const std::vector<BucketReport>& buckets) {
  std::printf("%7s %-7s %8s %12s %10s %7s  %-22s %s\n", "tokens", "backend", "status", "heuristic_us", "best_us",
              "gain", "check", "accepted");
  char a[32], b[32];
  for (const BucketReport& bucket : buckets) {
    if (bucket.status == "cached") {
      std::printf("%7lld %-7s %8s %12s %10.1f %7s  %-22s %s\n", static_cast<long long>(bucket.tokens), "-", "cached",
                  "-", bucket.entry.measured_us, "-", "-", bucket.entry.knobs.to_string().c_str());
      continue;
    }
    for (const BackendReport& r : bucket.backends) {
      if (!r.unavailable.empty()) {
        std::printf("%7lld %-7s %8s  not run: %s\n", static_cast<long long>(bucket.tokens), to_string(r.backend),
                    "-", r.unavailable.c_str());
        continue;
      }
      char check[64], gain[16];
      std::snprintf(check, sizeof(check), "rel_l2 %.2e %s", r.verify.rel_l2, r.verify.pass ? "ok" : "FAIL");
      std::snprintf(gain, sizeof(gain), "%.1f%%",
                    r.heuristic_us > 0 ? 100.0 * (r.heuristic_us - r.accepted_us) / r.heuristic_us : 0.0);
      std::printf("%7lld %-7s %8s %12s %10s %7s  %-22s %s%s\n", static_cast<long long>(bucket.tokens),
                  to_string(r.backend), bucket.status.c_str(), us_text(r.heuristic_us, a, sizeof(a)),
                  us_text(r.accepted_us, b, sizeof(b)), gain, check, r.accepted.label().c_str(),
                  r.rejected.empty() ? "" : ("  (rejected " + r.rejected + ")").c_str());
    }
  }
}

nlohmann::json candidate_json(const Candidate& c) {
  nlohmann::json knobs = nlohmann::json::object();
  for (const KnobField& f : knob_fields()) knobs[f.name] = c.knobs.*f.member;
  return {{"backend", to_string(c.backend)}, {"label", c.label()}, {"knobs", knobs},
          {"owner_reduce", to_string(c.owner_reduce)}};
}

nlohmann::json report_json(const TuneOptions& o, const TunePlan& p, const std::vector<BucketReport>& buckets,
                           int64_t crossover, const std::string& crossover_note) {
  nlohmann::json j;
  j["tool"] = "megamoe tune";
  j["version"] = MEGAMOE_VERSION;
  j["device"] = p.device;
  j["preset"] = o.layer.preset;
  j["geometry"] = {{"hidden", p.geometry.hidden}, {"intermediate", p.geometry.intermediate},
                   {"num_experts", p.geometry.num_experts}, {"top_k", p.geometry.top_k},
                   {"ep_size", p.geometry.ep_size}};
  j["config"] = {{"weight_format", to_string(p.config.weight_format)},
                 {"dispatch_format", to_string(p.config.dispatch_format)},
                 {"combine_dtype", to_string(p.config.combine_dtype)},
                 {"owner_reduce", to_string(p.config.owner_reduce)}};
  j["search"] = o.search;
  j["reps"] = p.reps;
  j["iters"] = p.iters;
  j["warmup"] = p.warmup;
  j["min_gain"] = p.min_gain;
  j["cache"] = p.cache_path;
  nlohmann::json out = nlohmann::json::array();
  for (const BucketReport& bucket : buckets) {
    nlohmann::json bj = {{"tokens", bucket.tokens}, {"status", bucket.status}};
    nlohmann::json backends = nlohmann::json::array();
    for (const BackendReport& r : bucket.backends) {
      nlohmann::json rj = {{"backend", to_string(r.backend)}};
      if (!r.unavailable.empty()) {
        rj["unavailable"] = r.unavailable;
        backends.push_back(rj);
        continue;
      }
      nlohmann::json stages = nlohmann::json::array();
      for (const tune::StageResult& s : r.search.stages) {
        nlohmann::json cs = nlohmann::json::array();
        for (size_t i = 0; i < s.candidates.size(); ++i) {
          nlohmann::json c = candidate_json(s.candidates[i]);
          c["us"] = s.scores[i];
          cs.push_back(c);
        }
        stages.push_back({{"candidates", cs}, {"winner", s.winner}});
      }
      rj["stages"] = stages;
      rj["heuristic_us"] = r.heuristic_us;
      rj["accepted"] = candidate_json(r.accepted);
      rj["accepted_us"] = r.accepted_us;
      rj["check"] = {{"rel_l2", r.verify.rel_l2}, {"bound", r.verify.bound}, {"pass", r.verify.pass},
                     {"tokens", r.verify.tokens}};
      if (!r.rejected.empty()) rj["rejected"] = r.rejected;
      backends.push_back(rj);
    }
    bj["backends"] = backends;
    bj["entry_knobs"] = candidate_json(Candidate{Backend::kRouted, bucket.entry.knobs, bucket.entry.owner_reduce})["knobs"];
    bj["backend_us"] = bucket.entry.backend_us;
    out.push_back(bj);
  }
  j["buckets"] = out;
  j["mega_max_tokens_per_rank"] = crossover;
  j["crossover"] = crossover_note;
  return j;
}

// The crossover over every bucket with both times (this run's and the cache's), recorded on every
// entry of the geometry; or why there is none.
std::string record_crossover(const TunePlan& p, std::vector<BucketReport>* buckets, KnobCache* cache, int64_t* out) {
  *out = 0;
  if (std::find(p.backends.begin(), p.backends.end(), Backend::kMega) == p.backends.end())
    return "not measured (--backend routed,mega measures it)";
  std::vector<tune::BucketTimes> times;
  std::string missing;
  for (const BucketReport& b : *buckets) {
    tune::BucketTimes t;
    t.tokens = b.tokens;
    if (auto it = b.entry.backend_us.find("routed"); it != b.entry.backend_us.end()) t.routed_us = it->second;
    if (auto it = b.entry.backend_us.find("mega"); it != b.entry.backend_us.end()) t.mega_us = it->second;
    if (t.routed_us < 0 || t.mega_us < 0) {
      for (const BackendReport& r : b.backends)
        if (!r.unavailable.empty()) missing = r.unavailable;
      if (missing.empty()) missing = "tokens " + std::to_string(b.tokens) + " lacks a backend's time";
      continue;
    }
    times.push_back(t);
  }
  if (!missing.empty())
    return "none measured: " + missing + "; mega_max_tokens_per_rank left as it was (auto keeps the threshold in force)";
  *out = tune::mega_crossover(times);
  // On every entry of the geometry (a layer finds the entry of its bucket under the bucket rule).
  const KnobKey shape = make_knob_key(p.device, p.geometry, p.config);
  for (auto [key, entry] : cache->entries()) {
    if (!key.same_shape(shape)) continue;
    entry.mega_max_tokens_per_rank = *out;
    cache->put(key, entry);
  }
  for (BucketReport& b : *buckets) b.entry.mega_max_tokens_per_rank = *out;
  return *out == kMegaNever ? "routed was faster at every bucket: auto never picks mega for this geometry"
                            : "mega up to " + std::to_string(*out) + " tokens per rank, routed above";
}

// The host memory at the peak: one bucket's groups (two where the owner reduce is searched: its
// layers keep a prepared copy each), the kept copy and the inputs.
void check_host_memory(const TuneOptions& o, const TunePlan& p, const TuneHooks& hooks) {
  const HostMemoryLimit limit = host_memory_limit(o.max_host_gb);
  const Backend on = runs_on(hooks, p.backends.front());
  const int64_t tokens = p.buckets.back() * 2;
  bool owner = p.knob_names.empty() || std::find(p.knob_names.begin(), p.knob_names.end(), "owner_reduce") !=
                                           p.knob_names.end();
  const MoeConfig c = p.config;
  auto estimate = [=](const MoeGeometry& g) {
    HostMemoryEstimate e = estimate_host_memory(g, c, on, tokens, /*dequantised_copy=*/false);
    if (owner) {
      const int64_t prepared = g.num_experts * prepared_bytes_per_expert(c.weight_format, g.hidden, g.intermediate);
      e.bytes += prepared;
      e.detail += " + a second group's prepared copy (owner reduce) " + format_bytes(prepared);
    }
    return e;
  };
  const HostMemoryEstimate mem = estimate(p.geometry);
  if (!fits_host_memory(mem, limit))
    require_host_memory(mem, limit, o.layer.preset.empty() ? "(explicit dims)" : o.layer.preset,
                        experts_hint(p.geometry, limit, estimate));
}

// What every launched process must agree on before the first collective step of the tuning: the
// plan from the flags and the device (not the cache path, which may differ).
std::string plan_text(const TunePlan& p) {
  std::string s = "buckets";
  for (int64_t t : p.buckets) s += " " + std::to_string(t);
  s += "; backends";
  for (Backend b : p.backends) s += std::string(" ") + to_string(b);
  s += "; knobs";
  for (const std::string& k : p.knob_names) s += " " + k;
  char numbers[160];
  std::snprintf(numbers, sizeof(numbers), "; search %d min_gain %.17g warmup %lld iters %lld reps %lld verify %lld seed %llu routing %d",
                static_cast<int>(p.search), p.min_gain, static_cast<long long>(p.warmup),
                static_cast<long long>(p.iters), static_cast<long long>(p.reps),
                static_cast<long long>(p.verify_tokens), static_cast<unsigned long long>(p.seed),
                static_cast<int>(p.routing));
  s += numbers;
  return s + "; device " + p.device + " sms " + std::to_string(p.num_sms) + "; " + p.geometry.to_string() + "; " +
         p.config.to_string();
}

// Per backend, why it cannot be tuned at bucket t (empty: it can), the same on every process: one
// that cannot run it anywhere runs it nowhere.
std::map<Backend, std::string> agreed_unavailable(const TunePlan& p, const TuneHooks& hooks,
                                                  const ProcessAgreement& processes, int64_t t) {
  std::map<Backend, std::string> out;
  for (Backend b : p.backends) {
    const tune::TuneContext ctx = context(p, b, t);
    std::string why = unavailable(hooks, b, ctx.geometry, ctx.config);
    bool anywhere = !why.empty();
    if (const Status st = processes.any(&anywhere); !st)
      throw ToolError(kExitUnavailable, "tokens " + std::to_string(t) + ", " + to_string(b) + ": " + st.message());
    if (anywhere && why.empty())
      why = std::string("backend=") + to_string(b) + " is unavailable in another launched process";
    out[b] = why;
  }
  return out;
}

int run_tune_plan(const TuneOptions& o, const TunePlan& p, const TuneHooks& hooks) {
  print_plan_header(o, p);
  check_host_memory(o, p, hooks);
  KnobCache cache = load_cache(p.cache_path);
  ProcessRanks pr;
  const bool on_gpu = runs_on(hooks, p.backends.front()) != Backend::kCpu;
  if (const Status st = process_ranks(p.geometry.ep_size, on_gpu, &pr); !st)
    throw ToolError(st.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitUnavailable, st.message());
  const bool writer = !pr.launched || pr.first() == 0;
  ProcessMax process_max(pr);
  TuneShared shared;
  if (hooks.max_over_processes) shared.processes.max = hooks.max_over_processes;
  else if (pr.launched) shared.processes.max = [&process_max](double* v) { return process_max(v); };
  if (const Status st = shared.processes.same(fingerprint(plan_text(p)), "the flags, the geometry or the device");
      !st)
    throw ToolError(kExitUsage, st.message());
  shared.hooks = &hooks;
  shared.ranks = &pr;
  shared.seed = p.seed;
  shared.warmup = p.warmup;
  shared.iters = p.iters;
  shared.reps = p.reps;
  shared.verify_tokens = p.verify_tokens;
  std::vector<reference::RankInputs> inputs(static_cast<size_t>(p.geometry.ep_size));
  const int threads = std::max<int>(1, reference::default_generate_threads() / static_cast<int>(p.geometry.ep_size));
  if (const Status st = run_on_ranks(p.geometry.ep_size, [&](int64_t r) {
        inputs[r] = reference::make_rank_inputs(p.geometry, p.seed, r, p.buckets.back() * shared.sets, p.routing, threads);
        return Status::ok();
      });
      !st)
    throw ToolError(kExitUnavailable, "generating the inputs: " + st.message());
  shared.inputs = &inputs;
  Progress progress(planned_timings(p));
  shared.on_timing = [&](const std::string& what) { progress.step(what); };

  std::vector<BucketReport> buckets;
  for (int64_t t : p.buckets) {
    BucketReport bucket;
    bucket.tokens = t;
    KnobKey key = make_knob_key(p.device, p.geometry, p.config);
    key.max_tokens = t;
    const std::map<Backend, std::string> why_not = agreed_unavailable(p, hooks, shared.processes, t);
    std::vector<Backend> available;
    for (Backend b : p.backends)
      if (why_not.at(b).empty()) available.push_back(b);
    // Resume: an entry of exactly this bucket holding every available backend's time is kept (launched:
    // where every process's cache holds one).
    const std::optional<KnobEntry> cached = exact_entry(cache, key);
    bool tune_it = o.force || !cached || available.empty() || !complete_entry(*cached, available);
    if (const Status st = shared.processes.any(&tune_it); !st)
      throw ToolError(kExitUnavailable, "tokens " + std::to_string(t) + ": " + st.message());
    if (!tune_it) {
      bucket.status = "cached";
      bucket.entry = *cached;
      std::fprintf(stderr, "[tune] tokens %lld: in the cache already (--force tunes it again)\n",
                   static_cast<long long>(t));
      buckets.push_back(bucket);
      continue;
    }
    bucket.status = "tuned";
    for (Backend b : p.backends) bucket.backends.push_back(tune_backend(p, &shared, b, t, why_not.at(b)));
    bucket.entry = entry_of(bucket);
    if (bucket.entry.backend_us.empty()) {  // no backend ran: nothing to record
      bucket.status = "not run";
      buckets.push_back(bucket);
      continue;
    }
    cache.put(key, bucket.entry);
    if (writer) save_cache(cache, p.cache_path);  // after every bucket: an interrupted run resumes here
    buckets.push_back(bucket);
  }
  progress.finish();
  int64_t crossover = 0;
  const std::string crossover_note = record_crossover(p, &buckets, &cache, &crossover);
  if (writer && crossover != 0) save_cache(cache, p.cache_path);
  print_report(buckets);
  std::printf("crossover: %s\n", crossover_note.c_str());
  if (writer) std::printf("knob cache: %s (%zu entries)\n", p.cache_path.c_str(), cache.size());
  const nlohmann::json doc = report_json(o, p, buckets, crossover, crossover_note);
  if (writer && !o.json.empty()) write_json_file(o.json, doc);
  if (writer && !o.plot.empty()) plot_json(doc, o.plot, "--plot");
  bool all_unavailable = true;
  for (const BucketReport& b : buckets) all_unavailable = all_unavailable && b.status == "not run";
  return all_unavailable ? kExitUnavailable : kExitOk;
}

}  // namespace

int run_tune(const TuneOptions& o, const TuneHooks& hooks) {
  const TunePlan p = plan_tune(o, hooks);
  if (o.dry_run) return run_dry_run(o, p, hooks);
  return run_tune_plan(o, p, hooks);
}

CommandRun add_tune_command(CLI::App* app) {
  auto o = std::make_shared<TuneOptions>();
  CLI::App* sub = app->add_subcommand(
      "tune", "measure the knobs of a backend per token bucket and write them to the knob cache; with "
              "--backend routed,mega also the crossover auto uses");
  sub->add_option("--preset", o->layer.preset, "model preset: " + preset_names() + " (or the explicit dims)")
      ->type_name("P");
  add_shape_options(sub, &o->layer);
  sub->add_option("--tokens", o->tokens, "token buckets (max_tokens_per_rank of the layers), comma-separated")
      ->type_name("T1[,T2...]")
      ->default_str(o->tokens);
  sub->add_option("--backend", o->backends, "routed, mega or routed,mega (the crossover too)")
      ->type_name("B[,B]")
      ->default_str(o->backends);
  sub->add_option("--knobs", o->knobs, "only these knobs (comma-separated; default: every knob the backend reads)")
      ->type_name("K[,K...]");
  sub->add_option("--search", o->search, "staged (each stage's knobs from the best before) or exhaustive")
      ->type_name("S")
      ->default_str(o->search);
  sub->add_option("--iters", o->iters, "timed forwards per candidate and rep (default 10, 3 on the cpu backend)")
      ->type_name("N");
  sub->add_option("--warmup", o->warmup, "untimed forwards after each knob change (default 2, 1 on the cpu backend)")
      ->type_name("N");
  sub->add_option("--reps", o->reps, "times every candidate of a stage is timed, interleaved")
      ->type_name("N")
      ->default_str(o->reps);
  sub->add_option("--min-gain", o->min_gain, "fraction by which a candidate must beat the best before it")
      ->type_name("F")
      ->default_str(o->min_gain);
  sub->add_option("--cache", o->cache, "the knob cache to write (default: MEGAMOE_KNOB_CACHE's file)")->type_name("FILE");
  sub->add_option("--seed", o->seed, "seed of the weights and inputs")->type_name("S")->default_str(o->seed);
  sub->add_option("--routing", o->routing, "uniform | single-expert | dropped")->type_name("R")->default_str(o->routing);
  sub->add_option("--verify-tokens", o->verify_tokens, "tokens per rank checked against the float64 reference")
      ->type_name("N")
      ->default_str(o->verify_tokens);
  sub->add_flag("--force", o->force, "tune buckets the cache holds already");
  sub->add_flag("--dry-run", o->dry_run, "list the candidates of every bucket and stage; build and time nothing");
  sub->add_option("--json", o->json, "write every candidate's time and the choices as JSON to F")->type_name("F");
  sub->add_option("--plot", o->plot, "plot each candidate's time per bucket, the winners marked, to F.png")
      ->type_name("F.png");
  add_max_host_gb_option(sub, &o->max_host_gb);
  add_layer_options(sub, &o->layer, /*with_pow2_scales=*/true);
  return [o] { return run_tune(*o); };
}

}  // namespace megamoe::tool
