#include "kt/cuda_host.h"

#include <dlfcn.h>

#include <stdexcept>

namespace kt {

namespace {

using LaunchHostFunc = int (*)(void* stream, HostFn fn, void* data);  // CUresult (CUstream, CUhostFn, void*)

struct Driver {
  LaunchHostFunc launch = nullptr;
  std::string status;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept open for the process
    if (!lib) {
      const char* e = dlerror();
      r.status = std::string("no CUDA driver: ") + (e ? e : "libcuda.so.1 not found");
      return r;
    }
    r.launch = reinterpret_cast<LaunchHostFunc>(dlsym(lib, "cuLaunchHostFunc"));
    if (!r.launch) r.status = "libcuda.so.1 has no cuLaunchHostFunc (driver older than CUDA 10)";
    return r;
  }();
  return d;
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
  const int rc = d.launch(reinterpret_cast<void*>(stream), fn, data);
  if (rc != 0) throw std::runtime_error("cuLaunchHostFunc failed with CUresult " + std::to_string(rc));
}

}  // namespace kt
