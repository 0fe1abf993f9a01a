// defines: the optimizer `gradsync train` steps (--optimizer sgd|adam, --lr, --momentum, --weight-decay,
// --no-decay-1d) over what the engine trains: its parameters, or this rank's shards of them.
#pragma once
#include <memory>

#include <torch/torch.h>

#include "data/models.h"
#include "gradsync/engine.h"
#include "train/train.h"

namespace gradsync::cli {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, Engine& engine, const Model& model);

}  // namespace gradsync::cli
