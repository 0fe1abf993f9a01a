// defines: encode_torch_file() and decode_torch_file(), the bytes of a torch.save zip file in the form Python's own
// torch.save writes (data.pkl, pickle protocol 2, tensors as torch._utils._rebuild_tensor_v2 of persistent
// storages in data/<key>). What gradsync writes loads with torch.load(f, weights_only=True), PyTorch's default
// from 2.6 on; what Python writes -- dicts, OrderedDicts (torch.save(model.state_dict())), nested checkpoints --
// gradsync reads.
#pragma once
#include <vector>

#include <torch/torch.h>

namespace gradsync {

// Dicts, lists, tuples, tensors (CPU copies, compact), ints, doubles, bools, strings and None. No type tags: the
// file is what Python would have written for the same plain values.
std::vector<char> encode_torch_file(const c10::IValue& value);

// A weights-only reader: the only classes a file may name are tensors' storages, torch._utils' tensor and
// parameter rebuilders, collections.OrderedDict and libtorch's list and type-tag helpers. Anything else (a
// pickled function, an arbitrary class) is a ConfigError naming it, and nothing in the file ever runs. OrderedDicts
// become dicts in their order. The zip's structure is checked first (a torn file is refused before parsing).
c10::IValue decode_torch_file(const std::vector<char>& bytes);

}  // namespace gradsync
