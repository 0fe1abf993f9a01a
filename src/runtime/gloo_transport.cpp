// The Gloo transport (transport.h): c10d's ProcessGroupGloo as libtorch 1.13 ships it.
#include <cstdlib>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "gradsync/error.h"
#include "runtime/transport.h"

namespace gradsync {
namespace {

bool is_loopback(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const LaunchEnv& env) {
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(iface);
  }
  // A local job keeps its Gloo listeners on loopback; a multi-host job needs a routable address.
  if (is_loopback(env.master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// A c10d work plus what must happen locally once it is done (reduce-scatter's local sum).
class GlooWork : public TransportWork {
 public:
  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::function<void()> then = {})
      : work_(std::move(work)), then_(std::move(then)) {}
  void wait(std::chrono::milliseconds) override {  // Gloo enforces the group's own timeout
    work_->wait();
    if (then_) then_();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
};

class GlooTransport : public Transport {
 public:
  GlooTransport(c10::intrusive_ptr<c10d::ProcessGroupGloo> group, int size) : group_(std::move(group)), size_(size) {}
  Backend backend() const override { return Backend::Gloo; }

  std::shared_ptr<TransportWork> allreduce_sum(torch::Tensor tensor) override {
    std::vector<at::Tensor> list{tensor};
    return std::make_shared<GlooWork>(group_->allreduce(list, c10d::AllreduceOptions{}));
  }

  std::shared_ptr<TransportWork> broadcast(torch::Tensor tensor, int root) override {
    std::vector<at::Tensor> list{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    return std::make_shared<GlooWork>(group_->broadcast(list, options));
  }

  std::shared_ptr<TransportWork> allgather(torch::Tensor input, torch::Tensor output) override {
    // Gloo 1.13 has no _allgather_base: narrow views of one flat buffer as the output list gather in place.
    const int64_t n = input.numel();
    std::vector<std::vector<at::Tensor>> outputs(1);
    auto flat_out = output.view({-1});
    for (int r = 0; r < size_; ++r) outputs[0].push_back(flat_out.narrow(0, r * n, n));
    std::vector<at::Tensor> inputs{input.reshape({-1})};
    return std::make_shared<GlooWork>(group_->allgather(outputs, inputs));
  }

  std::shared_ptr<TransportWork> reduce_scatter_sum(torch::Tensor input, torch::Tensor output) override {
    // Gloo 1.13 has no reduce_scatter: alltoall puts chunk r of every rank's input on rank r as [size, n]; the
    // sum over dim 0 is the reduction. Same bytes per rank as a ring reduce-scatter, plus a local sum.
    const int64_t n = output.numel();
    auto source = input.reshape({-1});
    auto received = torch::empty_like(source);
    std::vector<int64_t> equal_splits;  // empty: n elements to and from every rank
    auto work = group_->alltoall_base(received, source, equal_splits, equal_splits);
    return std::make_shared<GlooWork>(std::move(work), [received, output, n, size = size_]() mutable {
      output.view({-1}).copy_(received.view({size, n}).sum(0));
    });
  }

  std::shared_ptr<TransportWork> barrier() override {
    return std::make_shared<GlooWork>(group_->barrier(c10d::BarrierOptions{}));
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  int size_;
};

}  // namespace

std::shared_ptr<Transport> make_gloo_transport(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                                               std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(gloo_device(env));
  auto pg_store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("gradsync/{}/pg", env.restart_count), store);
  try {
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, env.rank, env.world_size, options);
    return std::make_shared<GlooTransport>(std::move(group), env.world_size);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("rank {} of {}: cannot connect the Gloo process group: {}", env.rank,
                                       env.world_size, e.what()));
  }
}

}  // namespace gradsync
