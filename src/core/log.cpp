#include "core/log.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

namespace megamoe {
namespace {

// Read MEGAMOE_LOG directly: env_knobs() itself logs, so it cannot be used here.
int level() {
  static const int lvl = [] {
    const char* v = std::getenv("MEGAMOE_LOG");
    if (v && v[0] >= '0' && v[0] <= '2' && v[1] == '\0') return v[0] - '0';
    return 1;
  }();
  return lvl;
}

void vlog(const char* tag, const char* fmt, va_list ap) {
  char buf[2048];
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  std::fprintf(stderr, "[megamoe %s] %s\n", tag, buf);
}

}  // namespace

void log_warn(const char* fmt, ...) {
  if (level() < 1) return;
  va_list ap;
  va_start(ap, fmt);
  vlog("warning", fmt, ap);
  va_end(ap);
}

void log_info(const char* fmt, ...) {
  if (level() < 1) return;
  va_list ap;
  va_start(ap, fmt);
  vlog("info", fmt, ap);
  va_end(ap);
}

void log_debug(const char* fmt, ...) {
  if (level() < 2) return;
  va_list ap;
  va_start(ap, fmt);
  vlog("debug", fmt, ap);
  va_end(ap);
}

}  // namespace megamoe
