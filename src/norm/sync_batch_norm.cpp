// SyncBatchNorm: BatchNorm over every rank of a group (see include/gradsync/sync_batch_norm.h).
#include "gradsync/sync_batch_norm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <optional>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/runtime.h"
#include "norm/batch_statistics.h"
#include "norm/sync_batch_norm_path.h"
#include "norm/sync_batch_norm_function.h"

namespace gradsync {

std::shared_ptr<Collectives> world_group(const std::shared_ptr<World>& world) {
  if (!world) throw ConfigError("SyncBatchNorm needs a World (gradsync::init()); got none");
  return std::shared_ptr<Collectives>(world, &world->comm());  // shares the World's lifetime
}

namespace {

// The options of `module` when it is one of libtorch's BatchNorms.
std::optional<torch::nn::BatchNormOptions> batch_norm_options(const torch::nn::Module& module) {
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module)) return bn->options;
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module)) return bn->options;
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module)) return bn->options;
  return std::nullopt;
}

torch::nn::BatchNormOptions options_of(const torch::nn::Module& module) {
  auto options = batch_norm_options(module);
  if (!options) {
    throw ConfigError(fmt::format("SyncBatchNorm can take over a torch::nn::BatchNorm1d/2d/3d, not {}", module.name()));
  }
  return *options;
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, std::shared_ptr<Collectives> group)
    : options(options), group_(std::move(group)) {
  if (!group_) throw ConfigError("SyncBatchNorm needs a group of ranks; got none");
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, const std::shared_ptr<World>& world)
    : SyncBatchNormImpl(options, world_group(world)) {}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::Module& batch_norm, std::shared_ptr<Collectives> group)
    : options(options_of(batch_norm)), group_(std::move(group)), adopt_(&batch_norm) {
  if (!group_) throw ConfigError("SyncBatchNorm needs a group of ranks; got none");
  reset();
  adopt_ = nullptr;  // a later reset() (clone()) makes fresh tensors, never the BatchNorm's
  train(batch_norm.is_training());
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  auto own = [this](const char* name, bool parameter) {
    const auto all = parameter ? adopt_->named_parameters(false) : adopt_->named_buffers(false);
    return all.contains(name) ? all[name] : torch::Tensor();
  };
  const bool affine = options.affine(), tracked = options.track_running_stats();
  auto param = [&](const char* name, double value) {
    auto t = adopt_ ? own(name, true) : affine ? torch::full({c}, value) : torch::Tensor();
    return register_parameter(name, t, t.defined() && (adopt_ ? t.requires_grad() : true));
  };
  auto buffer = [&](const char* name, torch::Tensor fresh) {
    return register_buffer(name, adopt_ ? own(name, false) : tracked ? fresh : torch::Tensor());
  };
  weight = param("weight", 1.0);
  bias = param("bias", 0.0);
  running_mean = buffer("running_mean", torch::zeros({c}));
  running_var = buffer("running_var", torch::ones({c}));
  num_batches_tracked = buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::check_input(const torch::Tensor& input) const {
  if (input.dim() < 2 || input.size(1) != options.num_features()) {
    throw ConfigError(fmt::format(
        "SyncBatchNorm({}): expected an input of 2 or more dimensions with {} channels in dimension 1, got shape {}",
        options.num_features(), options.num_features(), input.sizes()));
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "gradsync::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=" << (options.momentum() ? std::to_string(*options.momentum()) : "None")
         << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats()
         << ", ranks=" << group_->size() << ")";
}

// BatchNorm's rule: the momentum, or with none a cumulative average over the batches seen so far.
double SyncBatchNormImpl::average_factor() {
  if (!options.track_running_stats() || !num_batches_tracked.defined()) return options.momentum().value_or(0.0);
  num_batches_tracked += 1;
  if (!options.momentum()) return 1.0 / num_batches_tracked.item<double>();
  return *options.momentum();
}

// Once per module: ranks whose channel counts differ would gather tensors of different sizes.
void SyncBatchNormImpl::check_channels_agree() {
  if (channels_checked_) return;
  const auto all = group_->allgather_strings(std::to_string(options.num_features()));
  for (const auto& c : all) {
    if (c != all.front()) {
      throw DistributedError(fmt::format(
          "SyncBatchNorm: the ranks' channel counts differ (rank 0..{}: {}); every rank needs the same model",
          all.size() - 1, fmt::join(all, ", ")));
    }
  }
  channels_checked_ = true;
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  check_input(input);
  const bool batch_stats = is_training() || !options.track_running_stats();
  if (!batch_stats || !is_training()) {  // eval: the running statistics, or this rank's own batch; no collective
    return torch::batch_norm(input, weight, bias, running_mean, running_var, batch_stats, 0.0, options.eps(),
                             /*cudnn_enabled=*/false);
  }
  check_channels_agree();
  const auto stats = norm::gather_statistics(*group_, input);
  if (stats.count <= 1) {
    throw ConfigError(fmt::format(
        "SyncBatchNorm({}): training needs more than 1 value per channel over the group's {} ranks, got {} "
        "(per rank: {})", options.num_features(), group_->size(), stats.count, fmt::join(stats.per_rank, ", ")));
  }
  const double factor = average_factor();
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;  // the unbiased variance, as BatchNorm's; the same bits on every rank
    const double n = static_cast<double>(stats.count);
    running_mean.copy_(running_mean.to(torch::kDouble) * (1 - factor) + stats.mean * factor);
    running_var.copy_(running_var.to(torch::kDouble) * (1 - factor) + stats.var * (n / (n - 1)) * factor);
  }
  const auto dtype = input.element_size() < 4 ? torch::kFloat : input.scalar_type();  // 16-bit: float32 inside
  const auto invstd = (stats.var + options.eps()).rsqrt();
  return norm::normalise(input, weight, bias, stats.mean.to(dtype), invstd.to(dtype), stats.count, group_);
}

namespace {

struct Swap {
  torch::nn::SequentialImpl* parent;
  size_t index;  // in the Sequential, which is also its position among the parent's children
  std::string name;
  std::shared_ptr<torch::nn::Module> batch_norm;
};

// Every BatchNorm under `module`; ConfigError for one that is not a Sequential's element.
void find_batch_norms(torch::nn::Module& module, const std::string& path, std::vector<Swap>& out) {
  auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&module);
  size_t index = 0;
  for (const auto& child : module.named_children()) {
    const auto child_path = path.empty() ? child.key() : path + "." + child.key();
    if (batch_norm_options(*child.value())) {
      if (!sequential) {
        throw ConfigError(fmt::format(
            "convert_sync_batchnorm: '{}' is a BatchNorm held by {} (not a torch::nn::Sequential), whose forward calls "
            "it directly, so it cannot be swapped from outside; declare it as gradsync::SyncBatchNorm there",
            child_path, module.name()));
      }
      out.push_back({sequential, index, child.key(), child.value()});
    } else {
      find_batch_norms(*child.value(), child_path, out);
    }
    ++index;
  }
}

}  // namespace

int64_t convert_sync_batchnorm(torch::nn::Module& module, std::shared_ptr<Collectives> group) {
  if (!group) throw ConfigError("convert_sync_batchnorm needs a group of ranks; got none");
  if (batch_norm_options(module)) {
    throw ConfigError("convert_sync_batchnorm: the module itself is a BatchNorm and cannot be replaced in place; "
                      "construct a gradsync::SyncBatchNorm with its options instead");
  }
  std::vector<Swap> swaps;
  find_batch_norms(module, "", swaps);  // every check first: an error leaves the model as it was
  for (const auto& s : swaps) {
    SyncBatchNorm sync(std::make_shared<SyncBatchNormImpl>(*s.batch_norm, group));
    // Both lists: the Sequential's (what its forward runs) and its registered children (names, state dict).
    *(s.parent->begin() + static_cast<std::ptrdiff_t>(s.index)) = torch::nn::AnyModule(sync);
    s.parent->replace_module(s.name, sync.ptr());
  }
  return static_cast<int64_t>(swaps.size());
}

int64_t convert_sync_batchnorm(torch::nn::Module& module, const std::shared_ptr<World>& world) {
  return convert_sync_batchnorm(module, world_group(world));
}

namespace norm {

std::string sync_batch_norm_path(const torch::nn::Module& module) {
  for (const auto& m : module.named_modules()) {
    if (dynamic_cast<const SyncBatchNormImpl*>(m.value().get())) return m.key().empty() ? "(the module itself)" : m.key();
  }
  return "";
}

}  // namespace norm
}  // namespace gradsync
