// The engine's KT_SGLANG_* environment variables, validated where they are read.
#pragma once

#include <cstdint>

namespace kt {

// Integer variable `name` in [lo, hi], or `fallback` when it is unset or empty. Anything else
// throws std::invalid_argument naming the variable, its value and what it takes (`meaning`).
int64_t env_integer(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* meaning);

}  // namespace kt
