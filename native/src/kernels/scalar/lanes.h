// One fp32 lane: the portable kernels' view of a decoder's scales (../epilogue.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "kt/float_types.h"

namespace kt::kernels::scalar {

struct Lanes {
  using F = float;
  static constexpr int kCount = 1;
  static F fp16(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return fp16_to_float(bits);
  }
  static F bf16(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return bf16_to_float(bits);
  }
  static F e8m0(const uint8_t* p) { return e8m0_to_float(*p); }
  static F e4m3(const uint8_t* p) { return e4m3_to_float(*p); }
  static F set1(float x) { return x; }
  static F mul(F a, F b) { return a * b; }
  static F zero() { return 0.0f; }
};

}  // namespace kt::kernels::scalar
