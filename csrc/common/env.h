// The launchers' environment overrides (tests and benchmarking knobs such as
// KERNEL_FUN_KDA_BWD_PAIR_SCANS): one parser, so every knob accepts the same spellings. Host code.
#pragma once

#include <cstdlib>

namespace kernel_fun {

// The value of environment variable `name` when it is a whole decimal integer, else `absent`
// (unset, empty, or anything else: "1x", "one").
inline int env_int(const char* name, int absent) {
  const char* v = std::getenv(name);
  if (!v || !*v) return absent;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return *end == '\0' ? static_cast<int>(x) : absent;
}

}  // namespace kernel_fun
