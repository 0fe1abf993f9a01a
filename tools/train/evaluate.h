// defines: `gradsync train --eval`: after every epoch, the model's accuracy on a held-out split (Fashion-MNIST's
// test set, or --eval-data), as PyTorch's MNIST example reports it; for token data also the loss per token (summed
// over every valid token of the split, divided by their count over all ranks) and --sample's generated text.
// Evaluation never touches the engine's state: every rank takes the full model (engine.state_dict(), a gather for
// sharded strategies) into its own copy, classifies every N-th block of the split and the counts are summed over
// ranks, so training runs exactly as without --eval.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "data/data.h"
#include "data/models.h"
#include "gradsync/engine.h"
#include "gradsync/runtime.h"
#include "train/train.h"

namespace gradsync::cli {

struct Accuracy {
  int64_t correct = 0;  // samples (token data: valid tokens) whose argmax is the target
  int64_t total = 0;
  double loss_sum = 0;  // token data: the summed cross-entropy of the valid tokens, in nats
  double percent() const { return total > 0 ? 100.0 * static_cast<double>(correct) / static_cast<double>(total) : 0; }
  double nats_per_token() const { return total > 0 ? loss_sum / static_cast<double>(total) : 0; }
  double bits_per_byte() const { return nats_per_token() / std::log(2.0); }  // a token is a byte
};

// The split --eval uses: --eval-data when given, else fashion-mnist:test for --data fashion-mnist[:train]; ""
// without --eval. ConfigError when --eval has no split to use.
std::string eval_data_spec(const TrainConfig& c);


// Collective (every rank calls it, after the same step): argmax of the model's output against the labels (ce:
// class indices; mse: the argmax of the one-hot target rows).
Accuracy evaluate(const TrainConfig& c, Engine& engine, const Dataset& test, const std::shared_ptr<World>& world);

// Collective. --sample N (gpt on text): rank 0 prints N bytes the trained model generates after a fixed prompt, with
// a fixed seed.
void print_sample(const TrainConfig& c, Engine& engine, const std::shared_ptr<World>& world);

}  // namespace gradsync::cli
