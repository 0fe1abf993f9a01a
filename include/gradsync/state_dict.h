// defines: StateDict (ordered name -> tensor, Python's state_dict order and keys) and Python-compatible files:
// what gradsync saves is the file Python's torch.save writes for a dict of tensors, so torch.load(f) and
// torch.load(f, weights_only=True) read it; what Python saves with torch.save(model.state_dict(), f) (an
// OrderedDict) or torch.save(dict(...), f), gradsync loads. Reading never runs code from a file: only tensors,
// dicts, lists, numbers and strings are accepted (weights-only).
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
// The same for any value of dicts, lists, tuples, tensors, numbers, strings and None (an engine's
// full_optim_state_dict()), in the form torch.save writes: Python's torch.load(path) and read_torch_file() read
// it; weights_only=True too, except that torch 1.13's weights-only reader knows no floats (a learning rate).
void save_torch_file(const c10::IValue& value, const std::string& path);

// Reads a file written by save_state_dict or by Python's torch.save(model.state_dict(), path) (zip format, a dict
// or OrderedDict of tensors), in the file's order. A Python DDP checkpoint's keys start with "module.": strip them
// with consume_prefix_in_state_dict_if_present(state, "module.").
StateDict load_state_dict(const std::string& path);

// The dict of tensors in a value read_torch_file() returned, in its order; ConfigError starting with `what`
// ("state file 'x.pt'") for anything else.
StateDict to_state_dict(const c10::IValue& value, const std::string& what);

// PyTorch's torch.nn.modules.utils.consume_prefix_in_state_dict_if_present: every key that starts with `prefix`
// loses it (DDP's "module.", FSDP's wrapper prefixes); other keys stay as they are. Returns how many keys changed.
size_t consume_prefix_in_state_dict_if_present(StateDict& state, const std::string& prefix);

// Reads any file torch.save (zip format) or save_state_dict wrote, weights-only (a class other than tensors' and
// OrderedDict's is refused, naming it). The zip's end records and central directory are checked first: a torn or
// foreign file is a ConfigError before any parsing. `kind` names the file in messages ("state file"), `hint` says
// how to make one.
c10::IValue read_torch_file(const std::string& path, const std::string& kind = "torch file",
                            const std::string& hint = "");
// The guarded reader read_torch_file uses, for bytes already read: ConfigError "truncated or not a torch.save
// zip file (N bytes)" before any parsing, ConfigError for a refused class or a malformed pickle.
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
