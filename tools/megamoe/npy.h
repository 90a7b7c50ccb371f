// NumPy .npy (format version 1.0) writer for `megamoe check --dump`.
//
// Layout written: the 6-byte magic "\x93NUMPY", version bytes 1 0, a little-endian uint16 header length,
// then an ASCII dict "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" padded with spaces and
// a final '\n' so that the data starts on a 64-byte boundary, then the raw C-order little-endian data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/status.h"

namespace megamoe::tool {

// NumPy dtype strings for the element types the dump uses.
template <typename T> struct NpyDescr;
template <> struct NpyDescr<float> { static constexpr const char* value = "<f4"; };
template <> struct NpyDescr<int32_t> { static constexpr const char* value = "<i4"; };
template <> struct NpyDescr<uint8_t> { static constexpr const char* value = "|u1"; };
template <> struct NpyDescr<uint16_t> { static constexpr const char* value = "<u2"; };

// The header (magic through the padded dict) for an array of `descr` and `shape`.
std::string npy_header(const std::string& descr, const std::vector<int64_t>& shape);

// The header's dict alone, unpadded ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }").
std::string npy_dict(const std::string& descr, const std::vector<int64_t>& shape);

// Writes `bytes` bytes of data after the header. `bytes` must equal prod(shape) * itemsize; returns
// kInvalidArgument otherwise and kIoError naming the path when the file cannot be written.
Status write_npy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
                 const void* data, int64_t bytes);

template <typename T>
Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const T* data, int64_t count) {
  return write_npy(path, NpyDescr<T>::value, shape, data, count * static_cast<int64_t>(sizeof(T)));
}

// Bytes of a .npy file holding an array of this many bytes (header included), for size estimates.
int64_t npy_file_bytes(const std::vector<int64_t>& shape, int64_t itemsize);

// Item size of a descr ("<f4" -> 4); 0 for an unknown descr.
int64_t npy_itemsize(const std::string& descr);

}  // namespace megamoe::tool
