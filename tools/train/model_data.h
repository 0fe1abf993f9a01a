// defines: what a `gradsync train` run trains: the model --model names in --dtype, the data --data names for it
// (token sequences for gpt, rows of numbers otherwise), the checks that the two fit, and --freeze.
#pragma once
#include <cstdint>
#include <string>

#include "data/data.h"
#include "data/models.h"
#include "train/train.h"

namespace gradsync::cli {

// Every floating parameter and buffer of `model` in `dtype` (integer buffers as they are, as Python's module.to()).
void to_dtype(torch::nn::Module& model, c10::ScalarType dtype);

// The model --model names, in --dtype (what every copy of the trained model is built as).
Model build_model(const TrainConfig& c);

// gpt trains on token data with ce, and only gpt does; --sample needs its bytes. ConfigError otherwise.
void check_model_data(const TrainConfig& c);

// The data `spec` names for the model: tokens for gpt, rows otherwise, float values in --dtype.
Dataset load_data(const TrainConfig& c, const std::string& spec, uint64_t seed);

// --sync-bn needs a model with BatchNorm (mlp-bn) and ranks to synchronise: ConfigError otherwise.
void check_sync_bn(const TrainConfig& c);

// --freeze: every prefix must name at least one parameter, and one parameter must stay trainable.
void freeze_parameters(const TrainConfig& c, const Model& model);

}  // namespace gradsync::cli
