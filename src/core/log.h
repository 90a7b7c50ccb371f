// Minimal logging to stderr, gated by MEGAMOE_LOG (core/env.h). printf-style.
#pragma once

namespace megamoe {

void log_warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void log_info(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void log_debug(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace megamoe
