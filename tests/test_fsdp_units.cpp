// FSDP units on any module (src/shard/wrap_policy.h, Note [Unit slots]): units found recursively by type, by
// qualified name and by size; a unit that is an element of a Sequential runs in its slot with the model's own
// forward, one that is not is refused by forward(x); frozen parameters belong to no unit; the slots are the user's
// again once the engine is gone. A user's TORCH_MODULE (a Sequential of its own blocks inside, a typed head
// outside) trains under every sharding strategy exactly like one process on the global batch.
#include <gtest/gtest.h>

#include "data/models.h"
#include "gradsync/error.h"
#include "gradsync/fsdp.h"
#include "gradsync/state_dict.h"
#include "gradsync/zero.h"
#include "shard/wrap_policy.h"
#include "support/subprocess.h"
#include "support/test_models.h"
#include "support/worker.h"

namespace t = gradsync::test;
namespace sh = gradsync::test::sharding;
namespace nn = torch::nn;
namespace F = torch::nn::functional;
using Names = std::vector<std::string>;

namespace {

Names unit_names(const std::vector<gradsync::UnitPlan>& units) {
  Names names;
  for (const auto& u : units) names.push_back(u.name + (u.has_slot() ? "" : "*"));  // * : no slot
  return names;
}

Names plan(const torch::nn::Module& m, const std::string& policy) {
  return unit_names(gradsync::plan_units(m, gradsync::parse_wrap_policy(policy)));
}

// A user's own module: a typed stem and head around a Sequential of its own blocks (what FSDP can run as units).
struct GatedImpl : nn::Module {
  explicit GatedImpl(int64_t h) : fc(register_module("fc", nn::Linear(h, 2 * h))) {}
  torch::Tensor forward(const torch::Tensor& x) { return F::glu(fc(x), 1) + x; }
  nn::Linear fc;
};
TORCH_MODULE(Gated);

struct EncoderImpl : nn::Module {
  EncoderImpl(int64_t in, int64_t h, int64_t blocks, int64_t out)
      : stem(register_module("stem", nn::Linear(in, h))), layers(register_module("layers", nn::Sequential())),
        head(register_module("head", nn::Linear(h, out))) {
    for (int64_t i = 0; i < blocks; ++i) layers->push_back(Gated(h));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(layers->forward(torch::tanh(stem(x)))); }
  nn::Linear stem;
  nn::Sequential layers;
  nn::Linear head;
};
TORCH_MODULE(Encoder);

}  // namespace

TEST(UnitPlan, ResBlocksAreUnitsInTheirSlotsAndTheRestIsTheRoot) {
  auto res = gradsync::cli::make_model("res:4-6-3-2");
  EXPECT_EQ(plan(*res, "children"), (Names{"blocks.0", "blocks.1", "blocks.2", "(root)*"}));
  EXPECT_EQ(plan(*res, "type:Block"), (Names{"blocks.0", "blocks.1", "blocks.2", "(root)*"}));
  EXPECT_EQ(plan(*res, "list:blocks.2,blocks.0"), (Names{"blocks.0", "blocks.2", "(root)*"}));
  // 6*6+6 + 2*6 = 54 parameters a block: two blocks reach 100
  EXPECT_EQ(plan(*res, "params:100"), (Names{"blocks.0..1", "blocks.2", "(root)*"}));
  // Linear layers are members their parents call directly: units without a slot (forward_with only).
  EXPECT_EQ(plan(*res, "type:Linear"), (Names{"inp*", "blocks.0.fc*", "blocks.1.fc*", "blocks.2.fc*", "out*",
                                              "(root)*"}));
  const auto units = gradsync::plan_units(*res, gradsync::WrapPolicy::types({"Block"}));
  EXPECT_EQ(units[1].param_names, (Names{"blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc.weight",
                                         "blocks.1.fc.bias"}));
  EXPECT_EQ(units.back().param_names, (Names{"inp.weight", "inp.bias", "out.weight", "out.bias"}));
  auto cnn = gradsync::cli::make_model("cnn:2-3-10");
  EXPECT_EQ(plan(*cnn, "type:Conv2d"), (Names{"1", "4", "(root)*"}));
  EXPECT_EQ(plan(*cnn, "children"), (Names{"1", "4", "8"}));
}

TEST(UnitPlan, FrozenParametersBelongToNoUnit) {
  auto res = gradsync::cli::make_model("res:4-6-2-2");
  for (const auto& p : res->named_parameters()) {
    if (p.key().rfind("blocks.0.", 0) == 0 || p.key() == "out.bias") p.value().set_requires_grad(false);
  }
  const auto units = gradsync::plan_units(*res, gradsync::WrapPolicy::children());
  EXPECT_EQ(unit_names(units), (Names{"blocks.1", "(root)*"}));  // blocks.0 has nothing left to train
  EXPECT_EQ(units.back().param_names, (Names{"inp.weight", "inp.bias", "out.weight"}));
}

TEST(UnitPlan, BadPoliciesNameTheModuleAndWhatIsAllowed) {
  auto res = gradsync::cli::make_model("res:4-6-2-2");
  auto message = [&](const std::string& policy) {
    try {
      gradsync::plan_units(*res, gradsync::parse_wrap_policy(policy));
    } catch (const gradsync::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("list:blocks.7").find("no submodule 'blocks.7'"), std::string::npos) << message("list:blocks.7");
  EXPECT_NE(message("list:blocks,blocks.1").find("unit 'blocks.1' lies inside unit 'blocks'"), std::string::npos);
  EXPECT_NE(message("list:blocks.0,blocks.0").find("named twice"), std::string::npos);
  EXPECT_NE(message("type:Conv2d").find("no submodule of that type; its types are"), std::string::npos);
  EXPECT_THROW(gradsync::parse_wrap_policy("type:"), gradsync::ConfigError);
  EXPECT_EQ(gradsync::parse_wrap_policy("type:Block,Linear").to_string(), "type:Block,Linear");
}

// A world of one: forward(x) runs the units in their slots; forward(x) refuses units without one; once the engine
// is gone, the module's own forward runs its original elements again.
TEST(FsdpUnits, SlotsRunUnitsAndAreTheUsersAgainAfterwards) {
  auto world = gradsync::init({std::chrono::seconds(10), gradsync::LaunchEnv{}, std::nullopt});
  torch::manual_seed(3);
  Encoder model(5, 6, 3, 2);
  const auto x = torch::randn({4, 5});
  const auto expected = model->forward(x).detach();
  {
    gradsync::FullyShardedDataParallel fsdp(model, world, gradsync::FsdpOptions().wrap(gradsync::WrapPolicy::children()));
    Names names;
    for (const auto& u : fsdp.units()) names.push_back(u.name);
    EXPECT_EQ(names, (Names{"layers.0", "layers.1", "layers.2", "(root)"}));
    EXPECT_TRUE(torch::allclose(fsdp.forward(x), expected));
    EXPECT_THROW(model->forward(x), gradsync::Error);  // a unit outside the engine's forward
  }
  EXPECT_TRUE(torch::equal(model->forward(x), expected));
  {
    gradsync::FullyShardedDataParallel listed(model, world, gradsync::FsdpOptions().wrap(
                                                                  gradsync::WrapPolicy::list({"stem", "head"})));
    const auto nested = [&] {
      listed.forward_with([&] { return listed.unit("stem", [&] { return listed.unit("head", [&] { return x; }); }); });
    };
    EXPECT_THROW(nested(), gradsync::ConfigError);  // units do not nest
  }
  const auto linear = gradsync::FsdpOptions().wrap(gradsync::WrapPolicy::types({"Linear"}));
  gradsync::FullyShardedDataParallel typed(model, world, linear);
  EXPECT_THROW(typed.forward(x), gradsync::ConfigError);  // stem, head and the blocks' fc have no slot
}

namespace {

constexpr int64_t kBatch = 6;  // per rank

// Three steps of SGD with momentum on `engine` (each rank its own slice of a global batch that changes every step),
// through the user's own module and forward.
template <typename EngineType>
void train(EngineType& engine, int rank, int ranks) {
  torch::optim::SGD optimizer(engine.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t s = 0; s < 3; ++s) {
    auto [x, y] = sh::global_batch(s, ranks * kBatch, 5, 2);
    engine.zero_grad();
    F::cross_entropy(engine.forward(x.narrow(0, rank * kBatch, kBatch)), y.narrow(0, rank * kBatch, kBatch))
        .backward();
    optimizer.step();
  }
}

}  // namespace

// args: full_shard | shard_grad_op | no_shard
GRADSYNC_WORKER(fsdp_user_module) {
  auto world = sh::join();
  torch::manual_seed(11);
  Encoder model(5, 6, 3, 2);
  torch::manual_seed(11);
  Encoder reference(5, 6, 3, 2);
  const auto strategy = args.at(0) == "full_shard"      ? gradsync::ShardingStrategy::FullShard
                        : args.at(0) == "shard_grad_op" ? gradsync::ShardingStrategy::ShardGradOp
                                                        : gradsync::ShardingStrategy::NoShard;
  const auto per_layer = gradsync::FsdpOptions().strategy(strategy).wrap(gradsync::WrapPolicy::children());
  gradsync::FullyShardedDataParallel fsdp(model, world, per_layer);
  WORKER_CHECK(fsdp.units().size() == 4, "{} units", fsdp.units().size());
  train(fsdp, world->rank(), world->size());
  const auto got = fsdp.state_dict();
  // One process on the global batch: the same steps with the mean over all ranks' samples.
  torch::optim::SGD optimizer(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t s = 0; s < 3; ++s) {
    auto [x, y] = sh::global_batch(s, world->size() * kBatch, 5, 2);
    optimizer.zero_grad();
    F::cross_entropy(reference->forward(x), y).backward();
    optimizer.step();
  }
  const double d = sh::max_relative_difference(got, gradsync::state_dict(*reference));
  WORKER_CHECK(d <= 1e-5, "{} on rank {}: differs from one process by {}", args.at(0), world->rank(), d);
  return 0;
}

TEST(FsdpUnits, AUsersModuleTrainsLikeOneProcessUnderEveryStrategy) {
  t::CommandOptions options;
  options.timeout = std::chrono::seconds(90);
  for (const char* strategy : {"full_shard", "shard_grad_op", "no_shard"}) {
    auto results = t::run_ranks(3, t::worker_argv("fsdp_user_module", {strategy}), options);
    for (const auto& r : results) EXPECT_TRUE(r.ok()) << strategy << ": " << r.describe();
  }
}

namespace {

// Adam over the engine's shards (parameters()) or over its pieces of the original parameters, two groups.
std::unique_ptr<torch::optim::Adam> adam_over(gradsync::Engine& engine, bool pieces) {
  const auto options = torch::optim::AdamOptions(0.01).weight_decay(0.1);
  if (!pieces) return std::make_unique<torch::optim::Adam>(engine.parameters(), options);
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : engine.named_parameters()) {
    (p.key().find("weight") != std::string::npos ? decay : no_decay).push_back(p.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamOptions>(options));
  auto without = std::make_unique<torch::optim::AdamOptions>(options);
  without->weight_decay(0);
  groups.emplace_back(no_decay, std::move(without));
  return std::make_unique<torch::optim::Adam>(std::move(groups), options);
}

void steps(gradsync::Engine& engine, torch::optim::Optimizer& optimizer, int rank, int ranks, int64_t from,
           int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    auto [x, y] = sh::global_batch(s, ranks * kBatch, 5, 2);
    optimizer.zero_grad();  // libtorch's own zero_grad on the gradients the engine bound (shards' or pieces')
    engine.zero_grad();
    F::cross_entropy(engine.forward(x.narrow(0, rank * kBatch, kBatch)), y.narrow(0, rank * kBatch, kBatch))
        .backward();
    optimizer.step();
  }
}

std::unique_ptr<gradsync::Engine> engine_of(const std::string& kind, const Encoder& model,
                                            const std::shared_ptr<gradsync::World>& world) {
  if (kind == "zero1") return std::make_unique<gradsync::Zero1DataParallel>(model, world);
  return std::make_unique<gradsync::FullyShardedDataParallel>(model, world);
}

}  // namespace

// args: fsdp | zero1, shards | pieces. Three steps, the full optimizer state (through a file) and the model into a
// new engine over another initial model, two more steps: bit for bit five uninterrupted steps.
GRADSYNC_WORKER(full_optim_state_round_trip) {
  auto world = sh::join();
  const int r = world->rank(), n = world->size();
  const bool pieces = args.at(1) == "pieces";
  torch::manual_seed(5);
  Encoder first(5, 6, 2, 2);
  auto engine = engine_of(args.at(0), first, world);
  auto optimizer = adam_over(*engine, pieces);
  steps(*engine, *optimizer, r, n, 0, 3);
  const auto path = args.at(2) + "/optim.pt";
  const auto optim = engine->full_optim_state_dict(*optimizer, /*rank0_only=*/true);
  if (r == 0) gradsync::save_torch_file(optim, path);
  const auto model_state = engine->state_dict();
  steps(*engine, *optimizer, r, n, 3, 5);
  const auto uninterrupted = engine->state_dict();
  WORKER_CHECK(r != 0 || optim.toGenericDict().at("state").toGenericDict().size() == 8, "state of {} parameters",
               optim.toGenericDict().at("state").toGenericDict().size());
  world->comm().barrier();  // the file is written

  torch::manual_seed(99);
  Encoder second(5, 6, 2, 2);
  auto resumed = engine_of(args.at(0), second, world);
  auto resumed_optimizer = adam_over(*resumed, pieces);
  resumed->load_state_dict(model_state);
  resumed->load_full_optim_state_dict(*resumed_optimizer, gradsync::read_torch_file(path));
  steps(*resumed, *resumed_optimizer, r, n, 3, 5);
  const double d = sh::max_relative_difference(resumed->state_dict(), uninterrupted);
  WORKER_CHECK(d == 0, "{} {} on rank {}: resumed differs from uninterrupted by {}", args.at(0), args.at(1), r, d);
  return 0;
}

TEST(FullOptimState, ResumingFromItEqualsTrainingOnBitForBit) {
  t::CommandOptions options;
  options.timeout = std::chrono::seconds(90);
  for (const auto& [kind, layout] : std::vector<std::pair<std::string, std::string>>{
           {"fsdp", "shards"}, {"fsdp", "pieces"}, {"zero1", "shards"}, {"zero1", "pieces"}}) {
    const auto dir = t::make_temp_dir("gradsync-optim-state");
    auto results = t::run_ranks(3, t::worker_argv("full_optim_state_round_trip", {kind, layout, dir}), options);
    for (const auto& res : results) EXPECT_TRUE(res.ok()) << kind << " " << layout << ": " << res.describe();
  }
}
