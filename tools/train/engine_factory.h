// defines: the one place `gradsync train` turns its --strategy and sharding flags into an engine (engine.h); the
// training loop itself only ever sees the Engine interface.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "data/models.h"
#include "gradsync/engine.h"
#include "gradsync/runtime.h"

namespace gradsync::cli {

struct TrainConfig;

// Checks --wrap, --param-dtype, --reduce-dtype, --accumulate-grads, --replicas against the strategy (and the world
// size, when known: > 0) and what a sharded strategy cannot do (ConfigError naming the flag). Called by validate()
// for every strategy, before any rank starts.
void validate_sharding_flags(const TrainConfig& config, int world_size);

// --comm-hook's choices: "none" (DDP's default path), then the hooks of gradsync/comm_hook.h.
const std::vector<std::string>& comm_hook_names();

// The engine for config.strategy over `model` (world is null for --strategy local).
std::unique_ptr<Engine> make_engine(const TrainConfig& config, const Model& model,
                                    const std::shared_ptr<World>& world);

// Hybrid strategies: R, the replica groups the engine builds (--replicas, or one per host); 0 for the others.
int replicas_of(const TrainConfig& config, const std::shared_ptr<World>& world);

// For the summary: "fsdp-full: 3 unit(s) (0, 2, 4), largest unit with its gradient 1.2 KiB".
std::string describe_engine(const TrainConfig& config, Engine& engine);

}  // namespace gradsync::cli
