// Host functions on a CUDA stream without building against CUDA: the driver's cuLaunchHostFunc is
// resolved at run time from libcuda.so.1. Without a driver, a host function runs at once (the
// caller's order is then the stream order).
#pragma once

#include <cstdint>
#include <string>

namespace kt {

using HostFn = void (*)(void* data);

// True when the driver library and cuLaunchHostFunc were found (looked up once).
bool cuda_host_launch_available();
// Why not, when not available ("" when available).
std::string cuda_host_launch_status();

// Enqueues fn(data) on `stream` (a CUstream / cudaStream_t handle; 0 is the legacy default stream),
// or calls it now without a driver. Throws std::runtime_error naming the driver error code.
void launch_host_func(uintptr_t stream, HostFn fn, void* data);

}  // namespace kt
