#include "kt/cuda_host.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

namespace kt {

namespace {

// CUresult (CUstream, CUhostFn, void*)
using LaunchHostFunc = int (*)(void* stream, HostFn fn, void* data);
// CUresult (CUstream, CUdeviceptr, cuuint32_t, unsigned int flags)
using StreamValue32 = int (*)(void* stream, uint64_t address, uint32_t value, unsigned flags);
// CUresult (CUdeviceptr*, void*, unsigned int flags)
using HostGetDevicePointer = int (*)(uint64_t* device, void* host, unsigned flags);

constexpr unsigned kWaitValueEq = 0x1;      // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned kWriteValueDefault = 0;  // CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence first

struct Driver {
  LaunchHostFunc launch = nullptr;
  StreamValue32 write_value = nullptr;
  StreamValue32 wait_value = nullptr;
  HostGetDevicePointer device_pointer = nullptr;
  std::string status;
  StreamSignal signal = StreamSignal::kNone;
  std::string signal_status;
};

// The mode in use: the driver's choice, or host functions after a failed probe.
std::mutex signal_mutex;
std::atomic<StreamSignal> fallback{StreamSignal::kNone};
std::string fallback_status;

template <class Fn>
Fn symbol(void* lib, const char* versioned, const char* plain) {
  void* p = dlsym(lib, versioned);  // the _v2 entry points lift the v1 device-attribute requirement
  return reinterpret_cast<Fn>(p ? p : dlsym(lib, plain));
}

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept open for the process
    if (!lib) {
      const char* e = dlerror();
      r.status = std::string("no CUDA driver: ") + (e ? e : "libcuda.so.1 not found");
      r.signal_status = "none (" + r.status + "): the engine is called directly";
      return r;
    }
    r.launch = reinterpret_cast<LaunchHostFunc>(dlsym(lib, "cuLaunchHostFunc"));
    if (!r.launch) r.status = "libcuda.so.1 has no cuLaunchHostFunc (driver older than CUDA 10)";
    r.write_value = symbol<StreamValue32>(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32");
    r.wait_value = symbol<StreamValue32>(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32");
    r.device_pointer =
        symbol<HostGetDevicePointer>(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer");
    const char* env = std::getenv("KT_SGLANG_STREAM_SIGNAL");
    const std::string asked = env ? env : "";
    if (!asked.empty() && asked != "host" && asked != "memops")
      r.signal_status = "KT_SGLANG_STREAM_SIGNAL=" + asked + " is neither 'host' nor 'memops'; ";
    const bool memops = r.write_value && r.wait_value && r.device_pointer;
    if (memops && asked != "host") {
      r.signal = StreamSignal::kMemoryOps;
      r.signal_status += "memops (cuStreamWriteValue32 / cuStreamWaitValue32 on pinned flags)";
    } else if (r.launch) {
      r.signal = StreamSignal::kHostFunctions;
      r.signal_status += memops ? "host-functions (KT_SGLANG_STREAM_SIGNAL=host)"
                                : "host-functions (the driver has no stream memory operations)";
    } else {
      r.signal_status += "none (" + r.status + ")";
    }
    return r;
  }();
  return d;
}

void check_result(int rc, const char* call) {
  if (rc != 0) throw std::runtime_error(std::string(call) + " failed with CUresult " + std::to_string(rc));
}

}  // namespace

bool cuda_host_launch_available() {
  return driver().launch != nullptr;
}

std::string cuda_host_launch_status() {
  return driver().status;
}

void launch_host_func(uintptr_t stream, HostFn fn, void* data) {
  const Driver& d = driver();
  if (!d.launch) {
    fn(data);
    return;
  }
  check_result(d.launch(reinterpret_cast<void*>(stream), fn, data), "cuLaunchHostFunc");
}

StreamSignal stream_signal() {
  const StreamSignal f = fallback.load(std::memory_order_acquire);
  return f != StreamSignal::kNone ? f : driver().signal;
}

std::string stream_signal_status() {
  std::lock_guard<std::mutex> lock(signal_mutex);
  return fallback.load() != StreamSignal::kNone ? fallback_status : driver().signal_status;
}

void stream_signal_fall_back(const std::string& why) {
  std::lock_guard<std::mutex> lock(signal_mutex);
  if (driver().signal != StreamSignal::kMemoryOps || fallback.load() != StreamSignal::kNone) return;
  fallback_status = "host-functions (stream memory operations failed: " + why + ")";
  fallback.store(StreamSignal::kHostFunctions, std::memory_order_release);
}

uint64_t host_device_pointer(const void* host) {
  const Driver& d = driver();
  if (!d.device_pointer) throw std::runtime_error("the CUDA driver has no cuMemHostGetDevicePointer");
  uint64_t device = 0;
  check_result(d.device_pointer(&device, const_cast<void*>(host), 0), "cuMemHostGetDevicePointer");
  return device;
}

void stream_write_value32(uintptr_t stream, uint64_t device_word, uint32_t value) {
  const Driver& d = driver();
  if (!d.write_value) throw std::runtime_error("the CUDA driver has no cuStreamWriteValue32");
  check_result(d.write_value(reinterpret_cast<void*>(stream), device_word, value, kWriteValueDefault),
               "cuStreamWriteValue32");
}

void stream_wait_value32(uintptr_t stream, uint64_t device_word, uint32_t value) {
  const Driver& d = driver();
  if (!d.wait_value) throw std::runtime_error("the CUDA driver has no cuStreamWaitValue32");
  check_result(d.wait_value(reinterpret_cast<void*>(stream), device_word, value, kWaitValueEq),
               "cuStreamWaitValue32");
}

}  // namespace kt
