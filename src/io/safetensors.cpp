#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace megamoe::io {
namespace {

struct DtypeInfo {
  StDtype dtype;
  const char* name;
  int bits;
};

constexpr DtypeInfo kDtypes[] = {
    {StDtype::kBool, "BOOL", 8},       {StDtype::kU8, "U8", 8},         {StDtype::kI8, "I8", 8},
    {StDtype::kF8E5M2, "F8_E5M2", 8},  {StDtype::kF8E4M3, "F8_E4M3", 8}, {StDtype::kF8E8M0, "F8_E8M0", 8},
    {StDtype::kI16, "I16", 16},        {StDtype::kU16, "U16", 16},       {StDtype::kF16, "F16", 16},
    {StDtype::kBF16, "BF16", 16},      {StDtype::kI32, "I32", 32},       {StDtype::kU32, "U32", 32},
    {StDtype::kF32, "F32", 32},        {StDtype::kF64, "F64", 64},       {StDtype::kI64, "I64", 64},
    {StDtype::kU64, "U64", 64},        {StDtype::kF4, "F4", 4},          {StDtype::kF6E2M3, "F6_E2M3", 6},
    {StDtype::kF6E3M2, "F6_E3M2", 6},
};

std::string known_dtypes() {
  std::string s;
  for (const DtypeInfo& d : kDtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

Status bad(const std::string& path, const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "invalid safetensors file " + path + ": " + what);
}

// A JSON value that must be a non-negative integer (not a float, not negative).
bool as_uint(const nlohmann::json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;  // nlohmann: non-negative integers only
  *out = v.get<uint64_t>();
  return true;
}

std::string clip(const std::string& s) { return s.size() > 200 ? s.substr(0, 200) + "..." : s; }

}  // namespace

const char* to_string(StDtype d) {
  for (const DtypeInfo& i : kDtypes)
    if (i.dtype == d) return i.name;
  return "unknown";
}

int bit_size(StDtype d) {
  for (const DtypeInfo& i : kDtypes)
    if (i.dtype == d) return i.bits;
  return 0;
}

bool parse_st_dtype(const std::string& name, StDtype* out) {
  for (const DtypeInfo& i : kDtypes) {
    if (name == i.name) {
      *out = i.dtype;
      return true;
    }
  }
  return false;
}

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded when the header was parsed
  return n;
}

std::string StTensor::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const StTensor* StHeader::find(const std::string& name) const {
  const auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

Status parse_safetensors_header(const uint8_t* prefix, size_t prefix_size, uint64_t file_size, const std::string& path,
                                StHeader* out) {
  if (file_size < 8 || prefix_size < 8)
    return bad(path, "truncated: " + std::to_string(file_size) +
                         " bytes, a safetensors file starts with an 8-byte little-endian header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes)
    return bad(path, "header length=" + std::to_string(n) + ", must be at most " + std::to_string(kMaxHeaderBytes) +
                         " bytes (not a safetensors file, or a corrupt one)");
  if (n > file_size - 8)
    return bad(path, "header length=" + std::to_string(n) + " runs past the end of the file (" +
                         std::to_string(file_size) + " bytes): truncated");
  if (n > prefix_size - 8)
    return bad(path, "header length=" + std::to_string(n) + ", only " + std::to_string(prefix_size - 8) +
                         " header bytes could be read: truncated");
  if (n == 0 || prefix[8] != '{') return bad(path, "the header must be a JSON object (starts with '{')");

  // Top-level keys seen twice: JSON allows them, safetensors names each tensor once.
  std::set<std::string> seen;
  std::string duplicate;
  const nlohmann::json::parser_callback_t on_event = [&](int depth, nlohmann::json::parse_event_t event,
                                                         nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string() && duplicate.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) duplicate = key;
    }
    return true;
  };
  const char* text = reinterpret_cast<const char*>(prefix + 8);
  const nlohmann::json j = nlohmann::json::parse(text, text + n, on_event, /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad(path, "the header is not valid JSON (or not UTF-8)");
  if (!j.is_object()) return bad(path, "the header must be a JSON object");
  if (!duplicate.empty()) return bad(path, "tensor " + clip(duplicate) + " is named twice in the header");

  StHeader h;
  h.json_bytes = n;
  h.data_offset = 8 + n;
  h.data_bytes = file_size - h.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return bad(path, "__metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return bad(path, "__metadata__." + clip(m.key()) + " must be a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor " + clip(name);
    if (!v.is_object()) return bad(path, where + ": must be an object with dtype, shape and data_offsets");
    StTensor t;
    t.name = name;
    const auto dtype = v.find("dtype");
    if (dtype == v.end() || !dtype->is_string()) return bad(path, where + ": dtype missing or not a string");
    if (!parse_st_dtype(dtype->get<std::string>(), &t.dtype))
      return bad(path, where + ": dtype=" + clip(dtype->get<std::string>()) + ", must be one of " + known_dtypes());
    const auto shape = v.find("shape");
    if (shape == v.end() || !shape->is_array()) return bad(path, where + ": shape missing or not an array");
    // numel * bits must not overflow: every product stays below 2^63 / 64.
    constexpr uint64_t kMaxElems = (uint64_t{1} << 56);
    uint64_t numel = 1;
    for (const nlohmann::json& d : *shape) {
      uint64_t dim = 0;
      if (!as_uint(d, &dim)) return bad(path, where + ": shape=" + clip(shape->dump()) + ", dims must be integers >= 0");
      if (dim > kMaxElems || (dim != 0 && numel > kMaxElems / dim))
        return bad(path, where + ": shape=" + clip(shape->dump()) + " has more than 2^56 elements");
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto offsets = v.find("data_offsets");
    if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 || !as_uint((*offsets)[0], &t.begin) ||
        !as_uint((*offsets)[1], &t.end))
      return bad(path, where + ": data_offsets must be [begin, end], two integers >= 0");
    const uint64_t bits = numel * static_cast<uint64_t>(bit_size(t.dtype));
    if (bits % 8 != 0)
      return bad(path, where + ": shape=" + t.shape_string() + " of " + to_string(t.dtype) +
                           " is not a whole number of bytes");
    const std::string span = ": data_offsets=[" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
    if (t.end < t.begin) return bad(path, where + span + ", must have begin <= end");
    if (t.end - t.begin != bits / 8)
      return bad(path, where + span + " hold " + std::to_string(t.end - t.begin) + " bytes, must be shape " +
                           t.shape_string() + " x " + to_string(t.dtype) + " = " + std::to_string(bits / 8) + " bytes");
    if (t.end > h.data_bytes)
      return bad(path, where + span + " run past the end of the data (" + std::to_string(h.data_bytes) +
                           " bytes after the header): truncated, or the header lies");
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const StTensor& a, const StTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Non-empty tensors must not share a byte (sorted by begin: each must start at or after the
  // furthest end so far).
  uint64_t furthest = 0;
  const StTensor* furthest_tensor = nullptr;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const StTensor& t = h.tensors[i];
    if (t.bytes() == 0) continue;
    if (furthest_tensor && t.begin < furthest)
      return bad(path, "tensor " + clip(t.name) + " (bytes [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                           ")) overlaps tensor " + clip(furthest_tensor->name) + " (bytes [" +
                           std::to_string(furthest_tensor->begin) + ", " + std::to_string(furthest_tensor->end) +
                           ")): the header lies");
    if (t.end > furthest) {
      furthest = t.end;
      furthest_tensor = &t;
    }
  }
  for (size_t i = 0; i < h.tensors.size(); ++i) h.index[h.tensors[i].name] = i;
  *out = std::move(h);
  return Status::ok();
}

Status SafetensorsFile::open(const std::string& path, std::unique_ptr<SafetensorsFile>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status(StatusCode::kIoError, "cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status(StatusCode::kIoError, "cannot stat " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status(StatusCode::kIoError, "cannot read " + path + ": not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  if (size > 0) {
    void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return Status(StatusCode::kIoError, "cannot map " + path + " (" + std::to_string(size) + " bytes): " +
                                              std::strerror(err));
    }
    f->base_ = static_cast<const uint8_t*>(p);
    f->mapped_bytes_ = size;
  }
  ::close(fd);  // the mapping keeps the file
  MEGAMOE_RETURN_IF_ERROR(parse_safetensors_header(f->base_, f->mapped_bytes_, size, path, &f->header_));
  *out = std::move(f);
  return Status::ok();
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) munmap(const_cast<uint8_t*>(base_), mapped_bytes_);
}

}  // namespace megamoe::io
