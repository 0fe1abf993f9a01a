// Test-split accuracy for `gradsync train --eval` (see evaluate.h).
#include "train/evaluate.h"

#include <algorithm>

#include <fmt/format.h>

#include "data/models.h"
#include "gradsync/error.h"
#include "gradsync/state_dict.h"

namespace gradsync::cli {

std::string eval_data_spec(const TrainConfig& c) {
  if (!c.eval_data.empty()) return c.eval_data;
  if (!c.eval) return "";
  if (c.data == "fashion-mnist" || c.data == "fashion-mnist:train") return "fashion-mnist:test";
  throw ConfigError(fmt::format("--eval needs a held-out split: --data {} has none; give --eval-data SPEC "
                                "(fashion-mnist:test, synthetic:N or a torch.save file)", c.data));
}

Accuracy evaluate(const TrainConfig& c, Engine& engine, const Dataset& test, const std::shared_ptr<World>& world) {
  const auto state = engine.state_dict(/*rank0_only=*/false);  // every rank calls it: a gather when sharded
  auto model = make_model(c.model);
  load_into(*model, state);
  model->eval();
  torch::NoGradGuard no_grad;
  const int64_t ranks = world ? world->size() : 1, rank = world ? world->rank() : 0;
  constexpr int64_t kBlock = 1000;
  const auto loss = parse_loss_kind(c.loss);
  Accuracy mine;
  for (int64_t start = rank * kBlock; start < test.size(); start += ranks * kBlock) {
    const int64_t rows = std::min(kBlock, test.size() - start);
    const auto predicted = model.forward(test.inputs.narrow(0, start, rows)).argmax(1);
    auto labels = test.targets.narrow(0, start, rows);
    if (loss == LossKind::MeanSquared) labels = labels.argmax(1);
    mine.correct += predicted.eq(labels).sum().item<int64_t>();
    mine.total += rows;
  }
  if (ranks == 1) return mine;
  auto counts = torch::tensor({mine.correct, mine.total}, torch::kLong);
  world->comm().allreduce(counts, Reduction::Sum);
  return {counts[0].item<int64_t>(), counts[1].item<int64_t>()};
}

}  // namespace gradsync::cli
