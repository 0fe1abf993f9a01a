// Test-split accuracy for `gradsync train --eval` (see evaluate.h).
#include "train/evaluate.h"

#include <algorithm>

#include <fmt/format.h>

#include "data/gpt_model.h"
#include "data/models.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/state_dict.h"
#include "train/model_data.h"
#include "train/train_step.h"

namespace gradsync::cli {

std::string eval_data_spec(const TrainConfig& c) {
  if (!c.eval_data.empty()) return c.eval_data;
  if (!c.eval) return "";
  if (c.data == "fashion-mnist" || c.data == "fashion-mnist:train") return "fashion-mnist:test";
  if (c.data == "fortunes" || c.data == "fortunes:train") return "fortunes:test";
  if (c.data.rfind("text:", 0) == 0) return "text-test:" + c.data.substr(5);
  throw ConfigError(fmt::format("--eval needs a held-out split: --data {} has none; give --eval-data SPEC "
                                "(fashion-mnist:test, fortunes:test, text-test:PATH, synthetic:N or a torch.save "
                                "file)", c.data));
}

namespace {

// A copy of the trained model from its whole state (engine.state_dict(), a collective for the sharded engines).
Model trained_copy(const TrainConfig& c, const StateDict& state) {
  auto model = build_model(c);
  load_into(*model, state);
  model->eval();
  return model;
}

// One block of the split: its correct predictions, and for tokens the summed loss of its valid tokens.
void score(const TrainConfig& c, const Model& model, const Dataset& test, int64_t start, int64_t rows, Accuracy& a) {
  const auto output = model.forward(test.inputs.narrow(0, start, rows));
  auto labels = test.targets.narrow(0, start, rows);
  if (test.tokens()) {
    a.loss_sum += token_loss(output.to(torch::kDouble), labels, /*mean=*/false).item<double>();
    const auto targets = labels.reshape({-1}), valid = targets.ne(kIgnoreIndex);
    a.correct += output.reshape({-1, output.size(-1)}).argmax(1).eq(targets).logical_and(valid).sum().item<int64_t>();
    a.total += valid.sum().item<int64_t>();
    return;
  }
  if (parse_loss_kind(c.loss) == LossKind::MeanSquared) labels = labels.argmax(1);
  a.correct += output.argmax(1).eq(labels).sum().item<int64_t>();
  a.total += rows;
}

}  // namespace

Accuracy evaluate(const TrainConfig& c, Engine& engine, const Dataset& test, const std::shared_ptr<World>& world) {
  const auto model = trained_copy(c, engine.state_dict(/*rank0_only=*/false));  // every rank: a gather when sharded
  torch::NoGradGuard no_grad;
  const int64_t ranks = world ? world->size() : 1, rank = world ? world->rank() : 0;
  const int64_t block = test.tokens() ? 64 : 1000;  // sequences hold T positions of V logits each
  Accuracy mine;
  for (int64_t start = rank * block; start < test.size(); start += ranks * block) {
    score(c, model, test, start, std::min(block, test.size() - start), mine);
  }
  if (ranks == 1) return mine;
  auto sums = torch::tensor({static_cast<double>(mine.correct), static_cast<double>(mine.total), mine.loss_sum},
                            torch::kDouble);
  world->comm().allreduce(sums, Reduction::Sum);
  return {std::llround(sums[0].item<double>()), std::llround(sums[1].item<double>()), sums[2].item<double>()};
}

void print_sample(const TrainConfig& c, Engine& engine, const std::shared_ptr<World>& world) {
  if (c.sample <= 0) return;
  const auto state = engine.state_dict(/*rank0_only=*/true);  // every rank calls it; only rank 0 gets the model
  if (world && !world->is_main()) return;
  const auto model = trained_copy(c, state);
  auto* gpt = dynamic_cast<gpt::GptImpl*>(&*model);
  if (gpt == nullptr) throw ConfigError(fmt::format("--sample needs a gpt model, not {}", c.model));
  const std::string prompt = "The ";
  auto tokens = gpt::generate(*gpt, std::vector<int64_t>(prompt.begin(), prompt.end()), c.sample, c.seed);
  std::string text(tokens.begin(), tokens.end());
  fmt::print("gradsync train: sample (seed {}): {}\n", c.seed, text);
}

}  // namespace gradsync::cli
