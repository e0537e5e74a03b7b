// The CUDA driver calls the engine makes, without building against CUDA: resolved at run time from
// libcuda.so.1. Two ways to order engine work on a stream:
// - stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32 on words in pinned host
//   memory): the stream writes a flag the engine's signal thread sees, and waits for the flag the
//   engine writes back; no host thread holds the stream, and CUDA graphs capture both;
// - host functions (cuLaunchHostFunc), run by the driver's callback thread: the fallback where the
//   driver lacks the memory operations.
// Without a driver, a host function runs at once (the caller's order is then the stream order).
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

// How a stream hands work to the engine and waits for it, chosen once per process: "memops" where
// the driver has the stream memory operations (and KT_SGLANG_STREAM_SIGNAL is not "host"),
// "host-functions" where it has only cuLaunchHostFunc, "none" without a driver.
enum class StreamSignal { kNone, kHostFunctions, kMemoryOps };
StreamSignal stream_signal();
// The mode's name and why it was chosen, for doctor.
std::string stream_signal_status();
// Host functions from now on, where memops was chosen: the caller's probe of the memory operations
// on the device failed (`why`). Call before any stream-ordered submit.
void stream_signal_fall_back(const std::string& why);

// The device address of pinned host memory (cuMemHostGetDevicePointer; needs a current context).
uint64_t host_device_pointer(const void* host);
// On `stream`: *device_word = value once the work before it is done (with a memory fence first).
void stream_write_value32(uintptr_t stream, uint64_t device_word, uint32_t value);
// On `stream`: the work after it waits until *device_word == value.
void stream_wait_value32(uintptr_t stream, uint64_t device_word, uint32_t value);

}  // namespace kt
