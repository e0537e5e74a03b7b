// The machine's read bandwidth, measured the way the engine reads weights: pinned threads streaming
// disjoint slices of one buffer far larger than the caches.
#pragma once

#include <cstddef>
#include <vector>

namespace kt {

// GB/s (1e9 bytes per second), best of `repeats` passes over `bytes` with one thread per cpu.
double measure_read_bandwidth(size_t bytes, const std::vector<int>& cpus, int repeats);

}  // namespace kt
