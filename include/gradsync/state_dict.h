// defines: StateDict (ordered name -> tensor, Python's state_dict order and keys) and Python-compatible files:
// what gradsync saves, Python's torch.load reads as a plain dict; what Python saves with
// torch.save(dict(model.state_dict()), f), gradsync loads.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace gradsync {

using StateDict = std::vector<std::pair<std::string, torch::Tensor>>;

// Parameters and buffers in Python's order: each module's own parameters, then its own buffers, then its
// children recursively, keys joined with '.'. Tensors are the module's own (not copies).
StateDict state_dict(const torch::nn::Module& module);

// Writes atomically (temp file, fsync, rename, directory fsync): the path holds the old or the new file,
// never a torn one. Throws Error naming the path and errno.
void save_state_dict(const StateDict& state, const std::string& path);

// Reads a file written by save_state_dict or by Python torch.save(dict(...)) (zip format, a plain dict of tensors).
StateDict load_state_dict(const std::string& path);

// Reads any file torch.save (zip format) or save_state_dict wrote and unpickles it. libtorch 1.13 reads a truncated
// zip past its end, so the zip's end records and central directory are checked first: a torn or foreign file is a
// ConfigError before any parsing. `kind` names the file in messages ("state file"), `hint` says how to make one.
c10::IValue read_torch_file(const std::string& path, const std::string& kind = "torch file",
                            const std::string& hint = "");
// The guarded unpickler read_torch_file uses, for bytes already read: ConfigError "truncated or not a torch.save
// zip file (N bytes)" before any parsing; libtorch's own errors propagate as it throws them.
c10::IValue unpickle_torch_zip(const std::vector<char>& bytes);

// "" when `given` has exactly the keys of `expected` with the same shapes; otherwise everything that is wrong:
// "missing keys: ...; unexpected keys: ...; wrong shapes: 0.bias (<given_label> [5], model [4])". The one strict
// check every loader uses.
std::string state_dict_mismatch(const StateDict& given, const StateDict& expected,
                                const std::string& given_label = "given");

// Copies `state` into the module's parameters and buffers. Strict (state_dict_mismatch, given_label "file"): every
// missing, unexpected or mis-shaped key is listed in one ConfigError; nothing is modified unless all keys match.
void load_into(torch::nn::Module& module, const StateDict& state);

}  // namespace gradsync
