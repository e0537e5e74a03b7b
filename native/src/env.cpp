#include "kt/env.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kt {

int64_t env_integer(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* meaning) {
  const char* env = std::getenv(name);
  if (!env || !*env) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  if (*end != '\0' || errno == ERANGE || v < lo || v > hi)
    throw std::invalid_argument(std::string(name) + "='" + env + "' is not " + meaning + ": use " +
                                std::to_string(lo) + " to " + std::to_string(hi));
  return static_cast<int64_t>(v);
}

}  // namespace kt
