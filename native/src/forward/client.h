// A client of the forward plan (forward.h) beyond inference: fine-tuning adds the adapters' terms to
// the products (its epilogue) and keeps what its backward reads (its save hook). Inference has no
// client.
//
// A client's forward reads bf16 activations throughout (every method's A16 kernels), takes the batch
// as one chunk and keeps each row's down projection apart, summed per token in slot order by the
// combine step; its rows are the chunk's ExpertRows. The hooks run inside the plan's units, on any
// worker, each on rows or columns no other unit touches at the same time.
#pragma once

#include <cstdint>

#include "routing.h"

namespace kt {

class ForwardClient {
 public:
  virtual ~ForwardClient() = default;
  // The batch is routed (`tokens` tokens, `rows` its rows): size what the client keeps. No other
  // unit runs.
  virtual void routed(const ExpertRows& rows, int64_t tokens) = 0;
  // Units the client adds to the gather step, run beside the plan's: their count, and one of them.
  virtual int64_t gather_units() const = 0;
  virtual void gather_unit(int64_t unit) = 0;
  // After a gate/up kernel call, before the activation: rows [r0, r0 + m) of expert e, intermediate
  // channels [i0, i0 + blocks * width) as `blocks` blocks of `width` gate columns then `width` up
  // columns in c (row stride ldc). The client may add to them.
  virtual void gate_up_epilogue(int e, int64_t r0, int m, int64_t i0, int64_t blocks, int64_t width, float* c,
                                int64_t ldc) = 0;
  // Row r's h over intermediate channels [i0, i0 + n), bf16.
  virtual void keep_h(int64_t r, int64_t i0, const uint16_t* h, int64_t n) = 0;
  // Expert e's h is complete over every pool; its down projections start after this returns.
  virtual void expert_h_done(int e) = 0;
  // After a down kernel call of pool `pool`: rows [r0, r0 + m) of expert e, output channels
  // [c0, c0 + n) in c (row stride ldc). The client may add to them.
  virtual void down_epilogue(int pool, int e, int64_t r0, int m, int64_t c0, int64_t n, float* c,
                             int64_t ldc) = 0;
};

}  // namespace kt
