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

// Copies `state` into the module's parameters and buffers. Strict: every missing, unexpected or mis-shaped key is
// listed in one ConfigError; nothing is modified unless all keys match.
void load_into(torch::nn::Module& module, const StateDict& state);

}  // namespace gradsync
