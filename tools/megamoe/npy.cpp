#include "npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace megamoe::tool {

namespace {
constexpr int64_t kNpyAlign = 64;
constexpr int64_t kMagicAndLength = 10;  // "\x93NUMPY" + 2 version bytes + uint16 header length
}  // namespace

std::string npy_dict(const std::string& descr, const std::vector<int64_t>& shape) {
  std::string s = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";  // a 1-tuple needs its trailing comma
  s += "), }";
  return s;
}

std::string npy_header(const std::string& descr, const std::vector<int64_t>& shape) {
  std::string dict = npy_dict(descr, shape);
  // invariant: magic + length + dict + padding + '\n' is a multiple of 64 bytes.
  const int64_t unpadded = kMagicAndLength + static_cast<int64_t>(dict.size()) + 1;
  const int64_t total = (unpadded + kNpyAlign - 1) / kNpyAlign * kNpyAlign;
  dict.append(static_cast<size_t>(total - unpadded), ' ');
  dict += '\n';
  const uint16_t header_len = static_cast<uint16_t>(dict.size());
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(1);
  out += static_cast<char>(0);
  out += static_cast<char>(header_len & 0xff);
  out += static_cast<char>(header_len >> 8);
  out += dict;
  return out;
}

int64_t npy_itemsize(const std::string& descr) {
  if (descr == "<f4" || descr == "<i4") return 4;
  if (descr == "<u2") return 2;
  if (descr == "|u1") return 1;
  return 0;
}

int64_t npy_file_bytes(const std::vector<int64_t>& shape, int64_t itemsize) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return static_cast<int64_t>(npy_header("<f4", shape).size()) + n * itemsize;
}

Status write_npy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
                 const void* data, int64_t bytes) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t itemsize = npy_itemsize(descr);
  if (itemsize == 0) return invalid_argument("npy", "descr", descr, "must be one of <f4, <i4, <u2, |u1");
  if (n * itemsize != bytes)
    return invalid_argument("npy", "bytes", std::to_string(bytes),
                            "must equal prod(shape) * itemsize = " + std::to_string(n * itemsize) + " for " + path);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return Status(StatusCode::kIoError, "cannot write " + path + ": " + std::strerror(errno));
  const std::string header = npy_header(descr, shape);
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size();
  if (ok && bytes > 0) ok = std::fwrite(data, 1, static_cast<size_t>(bytes), f) == static_cast<size_t>(bytes);
  const int saved_errno = errno;
  if (std::fclose(f) != 0) ok = false;
  if (!ok) {
    return Status(StatusCode::kIoError,
                  "cannot write " + path + ": " + std::strerror(saved_errno ? saved_errno : EIO));
  }
  return Status::ok();
}

}  // namespace megamoe::tool
