// defines: the Gloo-facing helpers that move bfloat16 through a backend that does not know it, and the rule
// behind MixedPrecision (the dtypes FSDP computes and reduces in, declared in fsdp.h).
//
// Note [Mixed precision on Gloo]
// The master copy of every parameter (the shard the optimizer updates) keeps the model's dtype, normally float32.
//  - param_dtype: the dtype of the gathered parameters, so forward and backward compute in it and the unsharded
//    gradient is in it. bfloat16 compute works on CPU.
//  - reduce_dtype: the dtype the gradient is reduced in (default: param_dtype). Gloo 1.13 rejects bfloat16 in every
//    collective ("Invalid scalar type"). An all-gather is a pure copy, so bfloat16 parameters travel bit-exactly
//    as float16 bit patterns. A reduction needs arithmetic, so a bfloat16 reduction is done like this: the
//    gradient is rounded to bfloat16 and multiplied by 1/N in bfloat16 (what a bfloat16 backend would send), sent
//    and summed in float32 (Gloo can), and the sum rounded to bfloat16 (what a bfloat16 backend would return);
//    it then becomes the master dtype for the optimizer. float16 and float32/64 reduce natively.
#pragma once
#include <optional>
#include <string>

#include <torch/torch.h>

#include "gradsync/fsdp.h"

namespace gradsync {

// The dtype a reduction in `dtype` travels and is summed in over Gloo (bfloat16 -> float32, others unchanged).
c10::ScalarType gloo_reduce_dtype(c10::ScalarType dtype);

// A view of `t` that Gloo can copy bit-exactly: bfloat16 reinterpreted as float16, others unchanged.
torch::Tensor gloo_copyable(const torch::Tensor& t);

}  // namespace gradsync
