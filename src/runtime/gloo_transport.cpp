// The Gloo transport (transport.h): c10d's ProcessGroupGloo as libtorch 1.13 ships it.
#include <cstdlib>
#include <exception>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "gradsync/error.h"
#include "gradsync/trace.h"
#include "runtime/gloo_group.h"
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

// Gloo's worker thread completes the work's future when the bytes have moved; its callback notes the time.
void mark_on_completion(const c10::intrusive_ptr<c10d::Work>& work, std::shared_ptr<std::atomic<int64_t>> at) {
  work->getFuture()->addCallback([at = std::move(at)](c10::ivalue::Future&) {
    const int64_t now = Tracer::now_ns();
    for (int64_t seen = at->load(); seen < now && !at->compare_exchange_weak(seen, now);) {
    }
  });
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
  void watch_completion() override { mark_on_completion(work_, completed_ns_); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
};

// Several c10d works that make one operation (an allgather as one broadcast per rank).
class GlooWorks : public TransportWork {
 public:
  explicit GlooWorks(std::vector<c10::intrusive_ptr<c10d::Work>> works) : works_(std::move(works)) {}

  // Every work is waited for, even after one failed: the others write into the caller's output, which the caller
  // may free as soon as the error reaches it. The first failure is the one reported.
  void wait(std::chrono::milliseconds) override {  // Gloo enforces the group's own timeout
    std::exception_ptr first;
    for (auto& work : works_) {
      try {
        work->wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
  // The operation ends with its last work: each callback keeps the latest time.
  void watch_completion() override {
    for (auto& work : works_) mark_on_completion(work, completed_ns_);
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

// A process group of `size` ranks, of which this is `rank`, on the keys of `store` (a prefix of its own).
c10::intrusive_ptr<GlooGroup> connect_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& options) {
  return c10::make_intrusive<GlooGroup>(store, rank, size, options);
}

class GlooTransport : public Transport {
 public:
  GlooTransport(c10::intrusive_ptr<GlooGroup> group, int size, c10::intrusive_ptr<c10d::Store> store,
                c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options)
      : group_(std::move(group)), size_(size), store_(std::move(store)), options_(std::move(options)) {}
  Backend backend() const override { return Backend::Gloo; }

  // The members meet on keys of their own under the job's store; the other ranks never touch those keys. Only the
  // members' own connections are made: a sub-group costs its members, not the job.
  std::shared_ptr<Transport> split(const std::vector<int>& members, int index, const std::string& id, int /*color*/,
                                   int /*key*/, std::chrono::milliseconds /*timeout*/) override {
    auto store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("split/{}", id), store_);
    const int size = static_cast<int>(members.size());
    return std::make_shared<GlooTransport>(connect_group(store, index, size, options_), size, store, options_);
  }

  std::shared_ptr<TransportWork> allreduce_sum(torch::Tensor tensor) override {
    return std::make_shared<GlooWork>(group_->allreduce_sum(std::move(tensor)));
  }

  std::shared_ptr<TransportWork> broadcast(torch::Tensor tensor, int root) override {
    std::vector<at::Tensor> list{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    return std::make_shared<GlooWork>(group_->broadcast(list, options));
  }

  std::shared_ptr<TransportWork> allgather(torch::Tensor input, torch::Tensor output) override {
    const int64_t n = input.numel();
    auto flat_out = output.view({-1});
    const int64_t bytes = flat_out.numel() * flat_out.element_size();
    if (bytes >= kBroadcastGatherBytes) return gather_by_broadcasts(input, flat_out);
    // Gloo 1.13 has no _allgather_base: narrow views of one flat buffer as the output list gather in place.
    std::vector<std::vector<at::Tensor>> outputs(1);
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
      auto flat = output.view({-1});
      at::sum_out(flat, received.view({size, n}), /*dim=*/0);  // straight into the output: no temporary, no copy
    });
  }

  std::shared_ptr<TransportWork> barrier() override {
    return std::make_shared<GlooWork>(group_->barrier(c10d::BarrierOptions{}));
  }

 private:
  // Gloo's allgather stages what it gathers in a buffer of its own and copies it out; beyond the cache that costs
  // more than the bytes themselves. One broadcast per rank, from that rank's shard straight into its slice of the
  // output, moves the same bytes and measured 2.2 x faster here for 16.8 MB (2 ranks: 17.7 against 8.0 ms; 4 ranks:
  // 31 against 16.8 ms), the same at 4 MB. A gather only copies, so the result is the same bit for bit.
  static constexpr int64_t kBroadcastGatherBytes = 8 << 20;

  std::shared_ptr<TransportWork> gather_by_broadcasts(const torch::Tensor& input, torch::Tensor flat_out) {
    const int64_t n = input.numel();
    flat_out.narrow(0, group_->getRank() * n, n).copy_(input.reshape({-1}));
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int root = 0; root < size_; ++root) {
      std::vector<at::Tensor> slice{flat_out.narrow(0, root * n, n)};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      works.push_back(group_->broadcast(slice, options));
    }
    return std::make_shared<GlooWorks>(std::move(works));
  }

  c10::intrusive_ptr<GlooGroup> group_;
  int size_;
  c10::intrusive_ptr<c10d::Store> store_;  // this group's keys: its splits meet under them
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options_;
};

}  // namespace

std::shared_ptr<Transport> make_gloo_transport(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                                               std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(gloo_device(env));
  auto pg_store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("gradsync/{}/pg", env.restart_count), store);
  try {
    auto group = connect_group(pg_store, env.rank, env.world_size, options);
    return std::make_shared<GlooTransport>(std::move(group), env.world_size, pg_store, options);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("rank {} of {}: cannot connect the Gloo process group: {}", env.rank,
                                       env.world_size, e.what()));
  }
}

}  // namespace gradsync
