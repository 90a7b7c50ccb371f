// See kernel_timer.h.
#include "kernel_timer.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#if defined(MEGAMOE_HAVE_CUPTI)
#include <cupti.h>
#endif

namespace megamoe::tool {
namespace {

std::string g_why = "not tried";

#if defined(MEGAMOE_HAVE_CUPTI)
// The entry points, resolved from the library opened at run time (the declarations in cupti.h give
// their types; the tool does not link libcupti).
struct Cupti {
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
};
Cupti g_api;
std::mutex g_mutex;
std::vector<DeviceSpan> g_spans;  // filled by the completion callback

constexpr size_t kBufferBytes = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (g_api.next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      // start, end and name sit where every CUpti_ActivityKernel version since 4 keeps them.
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      g_spans.push_back(DeviceSpan{false, k->name ? k->name : "", k->start, k->end, 0});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      g_spans.push_back(DeviceSpan{true, "", m->start, m->end, m->bytes});
    }
  }
  std::free(buffer);
}

bool open_cupti() {
  const char* env = std::getenv("MEGAMOE_CUPTI_LIB");
  const char* names[] = {env, "libcupti.so.13", "libcupti.so"};
  void* lib = nullptr;
  std::string tried;
  for (const char* n : names) {
    if (n == nullptr || *n == '\0') continue;
    lib = dlopen(n, RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    tried += std::string(tried.empty() ? "" : ", ") + n;
  }
  if (lib == nullptr) {
    g_why = "libcupti not found (tried " + tried + "; set MEGAMOE_CUPTI_LIB to its path)";
    return false;
  }
  g_api.enable = reinterpret_cast<decltype(g_api.enable)>(dlsym(lib, "cuptiActivityEnable"));
  g_api.disable = reinterpret_cast<decltype(g_api.disable)>(dlsym(lib, "cuptiActivityDisable"));
  g_api.register_callbacks = reinterpret_cast<decltype(g_api.register_callbacks)>(dlsym(lib, "cuptiActivityRegisterCallbacks"));
  g_api.flush_all = reinterpret_cast<decltype(g_api.flush_all)>(dlsym(lib, "cuptiActivityFlushAll"));
  g_api.next_record = reinterpret_cast<decltype(g_api.next_record)>(dlsym(lib, "cuptiActivityGetNextRecord"));
  if (!g_api.enable || !g_api.disable || !g_api.register_callbacks || !g_api.flush_all || !g_api.next_record) {
    g_why = "libcupti lacks the activity API";
    return false;
  }
  if (g_api.register_callbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    g_why = "cuptiActivityRegisterCallbacks failed (another profiler attached?)";
    return false;
  }
  g_why.clear();
  return true;
}
#endif

}  // namespace

KernelTimer* KernelTimer::get() {
  static KernelTimer* timer = [] {
#if defined(MEGAMOE_HAVE_CUPTI)
    return open_cupti() ? new KernelTimer() : nullptr;
#else
    g_why = "built without cupti.h";
    return static_cast<KernelTimer*>(nullptr);
#endif
  }();
  return timer;
}

const std::string& KernelTimer::why_unavailable() { return g_why; }

bool KernelTimer::start() {
#if defined(MEGAMOE_HAVE_CUPTI)
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_spans.clear();
  }
  return g_api.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) == CUPTI_SUCCESS &&
         g_api.enable(CUPTI_ACTIVITY_KIND_MEMSET) == CUPTI_SUCCESS;
#else
  return false;
#endif
}

std::vector<DeviceSpan> KernelTimer::stop() {
#if defined(MEGAMOE_HAVE_CUPTI)
  const bool ok = g_api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) == CUPTI_SUCCESS;
  g_api.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  g_api.disable(CUPTI_ACTIVITY_KIND_MEMSET);
  std::vector<DeviceSpan> out;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    out.swap(g_spans);
  }
  if (!ok) return {};
  std::sort(out.begin(), out.end(), [](const DeviceSpan& a, const DeviceSpan& b) { return a.start_ns < b.start_ns; });
  return out;
#else
  return {};
#endif
}

}  // namespace megamoe::tool
