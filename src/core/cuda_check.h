// Checked CUDA calls for host code that returns Status.
//
//   MEGAMOE_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream));   // returns kCudaError from the caller
//   MEGAMOE_CUDA_CHECK_LAUNCH();                            // after a <<<...>>> launch
//
// The message names the call, the file:line and the runtime's error string, e.g.
// "cudaMalloc(&p, bytes) failed at src/kernels/transport/ep_transport.cu:120: out of memory".
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "megamoe/status.h"

namespace megamoe {

inline Status cuda_status(cudaError_t err, const char* expr, const char* file, int line) {
  return Status(StatusCode::kCudaError, std::string(expr) + " failed at " + file + ":" + std::to_string(line) +
                                            ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Makes `device` current for the scope and restores the caller's device on exit (destructors and
// per-rank helpers run on threads whose current device is not theirs).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~CudaDeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = false;
};

// Synchronous zeroing / upload on a private non-blocking stream of the current device: waits for
// this copy only, never for other streams' work. (cudaMemset / cudaMemcpy use the legacy default
// stream, which waits for every blocking stream of the device, and cudaDeviceSynchronize for every
// stream: on a GPU shared by several ranks that is a peer's kernel, which may be waiting for this
// rank.)
inline cudaError_t private_stream_copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  cudaStream_t s = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess)
    err = src ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s) : cudaMemsetAsync(dst, 0, bytes, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (s) cudaStreamDestroy(s);
  return err;
}
inline cudaError_t zero_device_sync(void* dst, size_t bytes) { return private_stream_copy(dst, nullptr, bytes); }
inline cudaError_t upload_sync(void* dst, const void* src, size_t bytes) { return private_stream_copy(dst, src, bytes); }

}  // namespace megamoe

#define MEGAMOE_CUDA_CHECK(expr)                                                    \
  do {                                                                              \
    const cudaError_t _megamoe_err = (expr);                                        \
    if (_megamoe_err != cudaSuccess)                                                \
      return ::megamoe::cuda_status(_megamoe_err, #expr, __FILE__, __LINE__);       \
  } while (0)

// Checks the launch that just happened on this thread (configuration errors, not kernel faults).
#define MEGAMOE_CUDA_CHECK_LAUNCH() MEGAMOE_CUDA_CHECK(cudaGetLastError())

// A precondition that returns `status_expr` (a Status) when false.
#define MEGAMOE_CHECK_OR_RETURN(cond, status_expr) \
  do {                                             \
    if (!(cond)) return (status_expr);             \
  } while (0)
