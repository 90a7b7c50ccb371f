// A reader of safetensors files: an 8-byte little-endian header length N, N bytes of JSON, then the
// raw tensors (little-endian, C order). The JSON maps each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end]} (byte offsets into the data that follows the header) and may hold
// "__metadata__", a map of strings.
//
// Every rule of the format is checked before any tensor is read, so a file whose header lies cannot
// make a reader touch a byte outside the file: the header length fits the file and the 100 MB limit,
// the JSON is one object of well-formed entries with known dtypes, each entry's byte size is its
// shape x dtype without overflow, begin <= end <= the data's size, no two tensors overlap, and no name
// appears twice. Errors name the file, the tensor and the rule.
//
// The file is memory-mapped read-only: reading one expert's tensors touches only their pages, so a
// multi-GB shard is never copied whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "megamoe/status.h"

namespace megamoe::io {

// The dtypes safetensors defines (names as written in headers).
enum class StDtype : int32_t {
  kBool, kU8, kI8, kF8E5M2, kF8E4M3, kF8E8M0, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64,
  kF4,     // e2m1, 4 bits per element (the shape counts elements)
  kF6E2M3, kF6E3M2,
};

const char* to_string(StDtype d);
// Bits per element.
int bit_size(StDtype d);
// Parses a header's dtype name ("F8_E4M3"); false when unknown.
bool parse_st_dtype(const std::string& name, StDtype* out);

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data section
  int64_t numel() const;
  uint64_t bytes() const { return end - begin; }
  std::string shape_string() const;  // "[4096, 7168]"
};

struct StHeader {
  uint64_t json_bytes = 0;   // N
  uint64_t data_offset = 0;  // 8 + N: where the data section starts in the file
  uint64_t data_bytes = 0;   // file size - data_offset
  std::vector<StTensor> tensors;  // sorted by begin
  std::map<std::string, std::string> metadata;
  // The tensor called `name`, or null.
  const StTensor* find(const std::string& name) const;

  std::unordered_map<std::string, size_t> index;  // name -> position in tensors
};

// The largest header the format allows (safetensors' own limit).
constexpr uint64_t kMaxHeaderBytes = 100000000;

// Parses and validates the header of a safetensors file of `file_size` bytes whose first
// `prefix_size` bytes are at `prefix` (at least 8 + N of them, or the file is reported truncated).
// `path` names the file in errors. Never reads past prefix + prefix_size.
Status parse_safetensors_header(const uint8_t* prefix, size_t prefix_size, uint64_t file_size, const std::string& path,
                                StHeader* out);

// One open, memory-mapped safetensors file.
class SafetensorsFile {
 public:
  static Status open(const std::string& path, std::unique_ptr<SafetensorsFile>* out);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const StHeader& header() const { return header_; }
  // The first byte of tensor t (one of header().tensors): t.bytes() bytes are readable there.
  const uint8_t* data(const StTensor& t) const { return base_ + header_.data_offset + t.begin; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  StHeader header_;
  const uint8_t* base_ = nullptr;
  size_t mapped_bytes_ = 0;
};

}  // namespace megamoe::io
