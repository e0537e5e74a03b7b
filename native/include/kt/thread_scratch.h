// Per-thread scratch memory of a kernel, reached through a plain pointer. In a shared library the
// address of a thread_local comes from __tls_get_addr, and GCC recomputed it inside the hot loops
// of the quantized AMX kernel and of the layer's phases (a call, after a vzeroupper) rather than
// keep it in a register: Qwen3 prefill ran x1.07 (INT4, 2048 tokens) to x1.2 (INT8, 512 tokens)
// faster through this pointer. A pointer returned by a function that is not inlined cannot be
// recomputed that way.
#pragma once

namespace kt {

// One object per type and thread: give each call site its own (local) struct type.
template <class T>
[[gnu::noinline]] T* thread_scratch() {
  thread_local T value;
  return &value;
}

}  // namespace kt
