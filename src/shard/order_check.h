// defines: OrderCheck, the cross-rank check that every rank issues the same unit collectives in the same order.
//
// Collectives match by call order alone: if rank 0 all-gathers unit 2 while rank 1 all-gathers unit 1, Gloo pairs
// them anyway, and the job computes garbage, fails with a size error, or waits until the timeout. Before each of
// its collectives in the first step, FSDP all-gathers a 3-number description (what, which unit, how many
// elements) and compares: a difference fails on every rank at the same moment, naming what each rank was doing.
// The check costs one small all-gather per unit collective, so by default it runs during the first step only (the
// ranks' code paths are fixed after it in most models); Always keeps it on.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/collectives.h"
#include "gradsync/fsdp.h"

namespace gradsync {

class OrderCheck {
 public:
  enum class Op : int64_t { ForwardGather = 1, BackwardGather = 2, ReduceGrad = 3, EndOfBackward = 4 };

  OrderCheck(std::vector<std::string> unit_names, OrderChecking mode);
  bool active() const { return active_; }
  // Throws DistributedError on every rank when the ranks disagree about this collective.
  void expect(Collectives& comm, Op op, size_t unit, int64_t numel);
  // The end of a synchronised backward: checked like a collective (a rank that skipped a unit meets another
  // rank's unit collective here), then the check stops unless the mode is Always.
  void end_of_synced_backward(Collectives& comm);

 private:
  std::string describe(int64_t op, int64_t unit, int64_t numel) const;

  std::vector<std::string> unit_names_;
  OrderChecking mode_;
  bool active_;
  int64_t sequence_ = 0;
};

}  // namespace gradsync
