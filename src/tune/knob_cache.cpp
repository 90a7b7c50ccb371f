// The knob cache (megamoe/knobs.h): JSON load with per-entry validation, bucket lookup, atomic save.
#include "megamoe/knobs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/env.h"
#include "core/log.h"

namespace megamoe {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

auto shape_tie(const KnobKey& k) {
  return std::tie(k.device_name, k.weight_format, k.dispatch_format, k.combine_dtype, k.ep_size, k.hidden,
                  k.intermediate, k.num_experts, k.top_k);
}

// Collects warnings: each is logged at once and all are returned joined by "; ".
class Warnings {
 public:
  void add(const std::string& w) {
    log_warn("%s", w.c_str());
    if (!text_.empty()) text_ += "; ";
    text_ += w;
  }
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

std::string errno_text(int err) { return std::strerror(err); }

// A JSON value for a warning, cut short so a large bad value cannot flood the log.
std::string short_dump(const json& v) {
  constexpr size_t kMaxChars = 64;
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMaxChars) s = s.substr(0, kMaxChars) + "...";
  return s;
}

// Reads an integer field in [min_value, max_value]. Absent: *out keeps its value if `optional`, else
// an error. Non-integers (strings, 1.5, 128.0) and out-of-range values are errors.
bool read_int(const json& obj, const char* field, int64_t min_value, int64_t max_value, bool optional,
              int64_t* out, std::string* error) {
  auto it = obj.find(field);
  if (it == obj.end()) {
    if (optional) return true;
    *error = std::string(field) + " is missing";
    return false;
  }
  if (!it->is_number_integer()) {
    *error = std::string(field) + "=" + short_dump(*it) + ", must be an integer";
    return false;
  }
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(max_value)) {
    *error = std::string(field) + "=" + short_dump(*it) + ", must be <= " + std::to_string(max_value);
    return false;
  }
  const int64_t v = it->get<int64_t>();
  if (v < min_value || v > max_value) {
    *error = std::string(field) + "=" + short_dump(*it) + ", must be in [" + std::to_string(min_value) + ", " +
             std::to_string(max_value) + "]";
    return false;
  }
  *out = v;
  return true;
}

bool read_string(const json& obj, const char* field, bool optional, std::string* out, std::string* error) {
  auto it = obj.find(field);
  if (it == obj.end()) {
    if (optional) return true;
    *error = std::string(field) + " is missing";
    return false;
  }
  if (!it->is_string()) {
    *error = std::string(field) + "=" + short_dump(*it) + ", must be a string";
    return false;
  }
  *out = it->get<std::string>();
  return true;
}

// An enum field through its parse_* function; the error is the parser's message.
template <typename Enum>
bool read_enum(const json& obj, const char* field, Status (*parse)(const std::string&, Enum*), Enum* out,
               std::string* error) {
  std::string name;
  if (!read_string(obj, field, /*optional=*/false, &name, error)) return false;
  Status st = parse(name, out);
  if (!st.is_ok()) {
    *error = std::string(field) + "=\"" + name + "\": " + st.message();
    return false;
  }
  return true;
}

// One entry of "entries"; on failure *error names the field and the rule.
bool parse_entry(const json& e, KnobKey* key, KnobEntry* entry, std::string* error) {
  if (!e.is_object()) {
    *error = "entry is " + std::string(e.type_name()) + ", must be an object";
    return false;
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
  if (!read_string(e, "device", false, &key->device_name, error)) return false;
  if (!read_enum(e, "weight_format", &parse_weight_format, &key->weight_format, error)) return false;
  if (!read_enum(e, "dispatch_format", &parse_dispatch_format, &key->dispatch_format, error)) return false;
  if (!read_enum(e, "combine_dtype", &parse_combine_dtype, &key->combine_dtype, error)) return false;
  if (!read_int(e, "ep_size", 1, kMaxInt, false, &key->ep_size, error)) return false;
  if (!read_int(e, "hidden", 1, kMaxInt, false, &key->hidden, error)) return false;
  if (!read_int(e, "intermediate", 1, kMaxInt, false, &key->intermediate, error)) return false;
  if (!read_int(e, "num_experts", 1, kMaxInt, false, &key->num_experts, error)) return false;
  if (!read_int(e, "top_k", 1, kMaxInt, false, &key->top_k, error)) return false;
  if (!read_int(e, "max_tokens", 0, kMaxInt, false, &key->max_tokens, error)) return false;

  auto knobs_it = e.find("knobs");
  if (knobs_it == e.end()) {
    *error = "knobs is missing";
    return false;
  }
  if (!knobs_it->is_object()) {
    *error = "knobs=" + short_dump(*knobs_it) + ", must be an object";
    return false;
  }
  constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
  for (const KnobField& f : knob_fields()) {
    int64_t v = 0;
    std::string knob_error;
    if (!read_int(*knobs_it, f.name, 0, kMaxInt32, true, &v, &knob_error)) {
      *error = "knobs." + knob_error;
      return false;
    }
    entry->knobs.*f.member = static_cast<int32_t>(v);
  }
  Status knobs_status = entry->knobs.validate();
  if (!knobs_status.is_ok()) {
    *error = knobs_status.message();  // "invalid knobs: block_m=96, must be ..."
    return false;
  }

  if (e.contains("owner_reduce") && !read_enum(e, "owner_reduce", &parse_owner_reduce, &entry->owner_reduce, error))
    return false;
  if (!read_int(e, "mega_max_tokens_per_rank", kMegaNever, kMaxInt, true, &entry->mega_max_tokens_per_rank, error))
    return false;
  if (auto it = e.find("measured_us"); it != e.end()) {
    if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0) {
      *error = "measured_us=" + short_dump(*it) + ", must be a finite number >= 0";
      return false;
    }
    entry->measured_us = it->get<double>();
  }
  if (auto it = e.find("backend_us"); it != e.end()) {
    if (!it->is_object()) {
      *error = "backend_us=" + short_dump(*it) + ", must be an object of backend name -> number";
      return false;
    }
    for (auto b = it->begin(); b != it->end(); ++b) {
      Backend backend;
      if (!parse_backend(b.key(), &backend).is_ok() || !b->is_number() || !std::isfinite(b->get<double>()) ||
          b->get<double>() < 0) {
        *error = "backend_us." + b.key() + "=" + short_dump(*b) + ", must be a backend name with a finite number >= 0";
        return false;
      }
      entry->backend_us[b.key()] = b->get<double>();
    }
  }
  return read_string(e, "note", true, &entry->note, error);
}

// Reads the whole file; false with *error on a missing, non-regular or unreadable file.
bool read_file(const std::string& path, std::string* text, std::string* error) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) {
    *error = "does not exist";
    return false;
  }
  if (ec) {
    *error = "cannot stat: " + ec.message();
    return false;
  }
  if (st.type() != fs::file_type::regular) {
    *error = st.type() == fs::file_type::directory ? "is a directory, not a file" : "is not a regular file";
    return false;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot open: " + errno_text(errno);
    return false;
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) {
    *error = "read failed: " + errno_text(errno);
    return false;
  }
  *text = buf.str();
  return true;
}

// Writes all of `data` to fd; false on error (errno set).
bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

Status io_error(const std::string& path, const std::string& what) {
  return Status(StatusCode::kIoError, "cannot write knob cache: path=" + path + ", " + what);
}

}  // namespace

std::string KnobKey::to_string() const {
  std::ostringstream os;
  os << "KnobKey(device=" << device_name << ", weight_format=" << megamoe::to_string(weight_format)
     << ", dispatch_format=" << megamoe::to_string(dispatch_format)
     << ", combine_dtype=" << megamoe::to_string(combine_dtype) << ", ep_size=" << ep_size
     << ", hidden=" << hidden << ", intermediate=" << intermediate << ", num_experts=" << num_experts
     << ", top_k=" << top_k << ", max_tokens=" << max_tokens << ")";
  return os.str();
}

bool KnobKey::same_shape(const KnobKey& o) const { return shape_tie(*this) == shape_tie(o); }

bool KnobKey::operator==(const KnobKey& o) const { return same_shape(o) && max_tokens == o.max_tokens; }

bool KnobKey::operator<(const KnobKey& o) const {
  const auto a = shape_tie(*this), b = shape_tie(o);
  if (a != b) return a < b;
  return max_tokens < o.max_tokens;
}

KnobKey make_knob_key(const std::string& device_name, const MoeGeometry& g, const MoeConfig& c) {
  KnobKey k;
  k.device_name = device_name;
  k.weight_format = c.weight_format;
  k.dispatch_format = c.dispatch_format;
  k.combine_dtype = c.combine_dtype;
  k.ep_size = g.ep_size;
  k.hidden = g.hidden;
  k.intermediate = g.intermediate;
  k.num_experts = g.num_experts;
  k.top_k = g.top_k;
  k.max_tokens = g.max_tokens_per_rank;
  return k;
}

KnobCache KnobCache::load(const std::string& path, std::string* warning) {
  std::string text, error;
  try {
    if (read_file(path, &text, &error)) return parse(text, path, warning);
  } catch (const std::exception& e) {
    error = std::string("cannot be read: ") + e.what();
  }
  const std::string w = "knob cache " + path + " " + error + "; using no tuned knobs";
  log_warn("%s", w.c_str());
  if (warning) *warning = w;
  return KnobCache();
}

KnobCache KnobCache::parse(const std::string& text, const std::string& source, std::string* warning) {
  KnobCache cache;
  Warnings warnings;
  const std::string where = "knob cache " + source;
  try {
    json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded()) {
      warnings.add(where + " is not valid JSON; using no tuned knobs");
    } else if (!doc.is_object()) {
      warnings.add(where + ": top level is " + std::string(doc.type_name()) +
                   ", must be an object; using no tuned knobs");
    } else if (auto v = doc.find("version");
               v == doc.end() || !v->is_number_integer() || v->get<int64_t>() != kVersion) {
      warnings.add(where + ": version=" + (v == doc.end() ? std::string("<missing>") : short_dump(*v)) +
                   ", this build reads version " + std::to_string(kVersion) + "; using no tuned knobs");
    } else if (auto list = doc.find("entries"); list == doc.end() || !list->is_array()) {
      warnings.add(where + ": entries=" + (list == doc.end() ? std::string("<missing>") : short_dump(*list)) +
                   ", must be an array; using no tuned knobs");
    } else {
      std::map<KnobKey, size_t> index_of;  // key -> entry index that set it
      for (size_t i = 0; i < list->size(); ++i) {
        KnobKey key;
        KnobEntry entry;
        std::string entry_error;
        if (!parse_entry((*list)[i], &key, &entry, &entry_error)) {
          warnings.add(where + ": skipping entry " + std::to_string(i) + ": " + entry_error);
          continue;
        }
        auto [it, inserted] = index_of.emplace(key, i);
        if (!inserted) {
          warnings.add(where + ": entry " + std::to_string(i) + " repeats the key of entry " +
                       std::to_string(it->second) + "; the later one wins");
          it->second = i;
        }
        cache.entries_[key] = entry;
      }
    }
  } catch (const std::exception& e) {
    cache.entries_.clear();
    warnings.add(where + ": " + e.what() + "; using no tuned knobs");
  }
  if (warning) *warning = warnings.text();
  return cache;
}

std::optional<KnobEntry> KnobCache::lookup(const KnobKey& key) const {
  // invariant (KnobKey::operator<): entries of one shape are contiguous and sorted by max_tokens.
  auto it = entries_.lower_bound(key);
  if (it != entries_.end() && it->first.same_shape(key)) return it->second;  // exact, or smallest >=
  if (it != entries_.begin()) {
    --it;
    if (it->first.same_shape(key)) return it->second;  // largest < (all buckets are smaller)
  }
  return std::nullopt;
}

void KnobCache::put(const KnobKey& key, const KnobEntry& entry) { entries_[key] = entry; }

std::vector<std::pair<KnobKey, KnobEntry>> KnobCache::entries() const {
  return {entries_.begin(), entries_.end()};
}

std::string KnobCache::to_json() const {
  json list = json::array();
  for (const auto& [key, entry] : entries_) {
    json e = json::object();
    e["device"] = key.device_name;
    e["weight_format"] = megamoe::to_string(key.weight_format);
    e["dispatch_format"] = megamoe::to_string(key.dispatch_format);
    e["combine_dtype"] = megamoe::to_string(key.combine_dtype);
    e["ep_size"] = key.ep_size;
    e["hidden"] = key.hidden;
    e["intermediate"] = key.intermediate;
    e["num_experts"] = key.num_experts;
    e["top_k"] = key.top_k;
    e["max_tokens"] = key.max_tokens;
    json knobs = json::object();
    for (const KnobField& f : knob_fields()) knobs[f.name] = entry.knobs.*f.member;
    e["knobs"] = std::move(knobs);
    e["owner_reduce"] = megamoe::to_string(entry.owner_reduce);
    e["mega_max_tokens_per_rank"] = entry.mega_max_tokens_per_rank;
    e["measured_us"] = entry.measured_us;
    json backend_us = json::object();
    for (const auto& [name, us] : entry.backend_us) backend_us[name] = us;
    e["backend_us"] = std::move(backend_us);
    e["note"] = entry.note;
    list.push_back(std::move(e));
  }
  json doc = json::object();
  doc["version"] = kVersion;
  doc["entries"] = std::move(list);
  // Replace invalid UTF-8 in notes and device names rather than throw.
  return doc.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

Status KnobCache::save(const std::string& path) const {
  std::string text;
  try {
    text = to_json();
  } catch (const std::exception& e) {
    return io_error(path, std::string("cannot serialise: ") + e.what());
  }

  const fs::path target(path);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error(path, "cannot create directory " + dir.string() + ": " + ec.message());

  // Temp file beside the target so that rename() stays within one filesystem and is atomic.
  std::string tmp = (dir / ("." + target.filename().string() + ".tmp.XXXXXX")).string();
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) return io_error(path, "cannot create temp file in " + dir.string() + ": " + errno_text(errno));
  auto fail = [&](const std::string& what) {
    const std::string reason = what + ": " + errno_text(errno);
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return io_error(path, reason);
  };
  ::fchmod(fd, 0644);  // mkstemp creates 0600; the cache is not secret
  if (!write_all(fd, text)) return fail("write " + tmp);
  if (::fsync(fd) != 0) return fail("fsync " + tmp);
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) return fail("close " + tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename " + tmp);
  // Make the rename itself durable; a failure here leaves a complete file either way.
  if (int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY); dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return Status::ok();
}

namespace {

std::mutex g_process_mutex;
bool g_process_loaded = false;

KnobCache& process_cache_storage() {
  static KnobCache* cache = new KnobCache();  // never destroyed: references outlive static teardown
  return *cache;
}

}  // namespace

const KnobCache& process_knob_cache() {
  std::lock_guard<std::mutex> lock(g_process_mutex);
  KnobCache& cache = process_cache_storage();
  if (!g_process_loaded) {
    const EnvKnobs& env = env_knobs();
    std::error_code ec;
    if (env.knob_cache_off) {
      cache = KnobCache();
      log_debug("knob cache off (MEGAMOE_KNOB_CACHE=off)");
    } else if (fs::status(env.knob_cache_path, ec).type() == fs::file_type::not_found) {
      cache = KnobCache();
      log_debug("knob cache %s does not exist; using no tuned knobs", env.knob_cache_path.c_str());
    } else {
      cache = KnobCache::load(env.knob_cache_path);
      log_debug("knob cache %s: %zu entries", env.knob_cache_path.c_str(), cache.size());
    }
    g_process_loaded = true;
  }
  return cache;
}

void reset_process_knob_cache() {
  std::lock_guard<std::mutex> lock(g_process_mutex);
  process_cache_storage() = KnobCache();
  g_process_loaded = false;
}

MoeConfig apply_tuned_knobs(const MoeConfig& config, const MoeGeometry& geometry, const std::string& device_name,
                            const KnobCache& cache, std::string* note) {
  MoeConfig out = config;
  if (note) note->clear();
  const std::optional<KnobEntry> entry = cache.lookup(make_knob_key(device_name, geometry, config));
  if (!entry) return out;
  std::string applied;
  for (const KnobField& f : knob_fields()) {
    int32_t* field = &(out.knobs.*f.member);
    const int32_t tuned = entry->knobs.*f.member;
    if (*field != 0 || tuned == 0) continue;
    *field = tuned;
    applied += std::string(applied.empty() ? "" : ", ") + f.name + "=" + std::to_string(tuned);
  }
  const bool owner_ok = entry->owner_reduce == OwnerReduce::kOff || !config.in_kernel_fc2_reduce;
  if (config.owner_reduce == OwnerReduce::kAuto && entry->owner_reduce != OwnerReduce::kAuto && owner_ok) {
    out.owner_reduce = entry->owner_reduce;
    applied += std::string(applied.empty() ? "" : ", ") + "owner_reduce=" + megamoe::to_string(entry->owner_reduce);
  }
  if (note) *note = applied.empty() ? "" : "tuned knobs from the knob cache: " + applied;
  return out;
}

const std::vector<KnobField>& knob_fields() {
  static const std::vector<KnobField> fields = {
      {"block_m", &Knobs::block_m},
      {"block_n", &Knobs::block_n},
      {"num_sms", &Knobs::num_sms},
      {"combine_groups", &Knobs::combine_groups},
      {"gemm_cluster", &Knobs::gemm_cluster},
      {"gemm_tile_order", &Knobs::gemm_tile_order},
  };
  return fields;
}

MegaThreshold mega_threshold_in_force(const MoeGeometry& geometry, const MoeConfig& config,
                                      const std::string& device_name, const KnobCache& cache) {
  MegaThreshold t;
  t.value = config.mega_max_tokens_per_rank;
  if (config.mega_max_tokens_per_rank != kDefaultMegaMaxTokensPerRank) {
    t.source = "MoeConfig::mega_max_tokens_per_rank set by the caller";
    return t;
  }
  t.source = "MoeConfig::mega_max_tokens_per_rank default";
  if (device_name.empty()) {
    t.source += " (no CUDA device: the knob cache is not consulted)";
    return t;
  }
  const KnobKey key = make_knob_key(device_name, geometry, config);
  const std::optional<KnobEntry> entry = cache.lookup(key);
  if (!entry || entry->mega_max_tokens_per_rank == 0) {
    t.source += entry ? " (the knob cache's entry for this shape has no measured crossover)"
                      : " (no knob cache entry for this shape on " + device_name + ")";
    return t;
  }
  t.value = entry->mega_max_tokens_per_rank == kMegaNever ? 0 : entry->mega_max_tokens_per_rank;
  t.from_cache = true;
  t.source = "the knob cache's measured crossover for " + key.to_string() +
             (entry->mega_max_tokens_per_rank == kMegaNever ? " (routed measured faster at every bucket: never mega)" : "") +
             (entry->note.empty() ? "" : " [" + entry->note + "]");
  return t;
}

}  // namespace megamoe
