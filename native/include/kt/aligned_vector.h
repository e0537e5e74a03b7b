// std::vector whose storage starts on a cache line. AMX tile rows (64 bytes) that straddle two
// lines load at under half the speed: a bf16 GEMM ran at 0.8 TFLOPS on buffers 16 bytes off a
// line and 2.1 TFLOPS aligned (glibc's malloc returns 16-byte aligned blocks).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace kt {

inline constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLine}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace kt
