// Rank registration and consistency check over a c10d store (see rendezvous.h).
//
// Protocol: each process takes an arrival number with an atomic add on "arrivals" and publishes
// "rank world_size host pid" under "arrival/<n>". It reads arrivals 0..max(world_size, n+1)-1 as they appear. Every process therefore reads the first world_size arrivals, and a late
// extra process also reads its own: if the ranks among them are not exactly 0..N-1 (pigeonhole: a duplicate)
// or a world size differs, every reader sees it and fails with the same message.
#include "runtime/rendezvous.h"

#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

RendezvousInfo parse_arrival(const std::vector<uint8_t>& raw) {
  std::istringstream in(std::string(raw.begin(), raw.end()));
  RendezvousInfo info;
  in >> info.rank >> info.world_size >> info.host >> info.pid >> info.machine;
  return info;
}

std::string who(const RendezvousInfo& a) { return fmt::format("pid {} on {}", a.pid, a.host); }

std::vector<RendezvousInfo> read_arrivals(c10d::Store& store, int64_t begin, int64_t end,
                                          std::chrono::milliseconds timeout) {
  std::vector<RendezvousInfo> out;
  for (int64_t i = begin; i < end; ++i) {
    std::string key = fmt::format("arrival/{}", i);
    // The arrival number is taken before the entry is written: allow that short gap.
    store.wait({key}, timeout);
    out.push_back(parse_arrival(store.get(key)));
  }
  return out;
}

[[noreturn]] void fail_missing(const std::vector<RendezvousInfo>& present, const RendezvousInfo& me,
                               std::chrono::milliseconds timeout) {
  std::vector<bool> seen(static_cast<size_t>(me.world_size), false);
  for (const auto& a : present) {
    if (a.rank >= 0 && a.rank < me.world_size) seen[static_cast<size_t>(a.rank)] = true;
  }
  std::vector<std::string> missing;  // runs of ranks as "3" or "29-299": a thousand ranks stay one line
  for (int r = 0; r < me.world_size; ++r) {
    if (seen[static_cast<size_t>(r)]) continue;
    int last = r;
    while (last + 1 < me.world_size && !seen[static_cast<size_t>(last + 1)]) ++last;
    missing.push_back(last == r ? std::to_string(r) : fmt::format("{}-{}", r, last));
    r = last;
  }
  throw DistributedError(fmt::format(
      "rendezvous timed out after {} ms on rank {}: {} of {} processes arrived; missing rank(s) {}", timeout.count(),
      me.rank, present.size(), me.world_size, fmt::join(missing, ", ")));
}

void check_arrivals(const std::vector<RendezvousInfo>& arrivals, const RendezvousInfo& me) {
  for (const auto& a : arrivals) {
    if (a.world_size != me.world_size) {
      throw DistributedError(fmt::format(
          "rendezvous failed: ranks disagree on WORLD_SIZE: rank {} ({}) has WORLD_SIZE={}, rank {} ({}) has "
          "WORLD_SIZE={}; every rank must be started with the same WORLD_SIZE",
          me.rank, who(me), me.world_size, a.rank, who(a), a.world_size));
    }
  }
  std::map<int, std::vector<const RendezvousInfo*>> by_rank;
  for (const auto& a : arrivals) by_rank[a.rank].push_back(&a);
  for (const auto& [rank, list] : by_rank) {
    if (list.size() > 1) {
      std::vector<std::string> owners;
      for (const auto* a : list) owners.push_back(who(*a));
      throw DistributedError(fmt::format(
          "rendezvous failed: rank {} registered twice ({}); each process needs a distinct RANK in 0..{}", rank,
          fmt::join(owners, " and "), me.world_size - 1));
    }
  }
}

// The first world_size arrivals (checked: exactly ranks 0..N-1), indexed by rank.
std::vector<RendezvousInfo> by_rank(const std::vector<RendezvousInfo>& seen, int world_size) {
  std::vector<RendezvousInfo> out(static_cast<size_t>(world_size));
  for (size_t i = 0; i < out.size(); ++i) {
    if (seen[i].rank >= 0 && seen[i].rank < world_size) out[static_cast<size_t>(seen[i].rank)] = seen[i];
  }
  return out;
}

}  // namespace

std::vector<RendezvousInfo> rendezvous(c10d::Store& store, const RendezvousInfo& me,
                                       std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const int64_t my_index = store.add("arrivals", 1) - 1;
  store.set(fmt::format("arrival/{}", my_index),
            bytes_of(fmt::format("{} {} {} {} {}", me.rank, me.world_size, me.host, me.pid, me.machine)));

  // Entries are checked as they arrive, so a duplicate or a disagreeing world size fails at once instead of
  // waiting for a rank that will never come.
  const int64_t needed = std::max<int64_t>(me.world_size, my_index + 1);
  std::vector<RendezvousInfo> seen;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    const int64_t arrived = store.add("arrivals", 0);
    const int64_t readable = std::min(arrived, needed);
    if (readable > static_cast<int64_t>(seen.size())) {
      auto fresh = read_arrivals(store, static_cast<int64_t>(seen.size()), readable, timeout);
      seen.insert(seen.end(), fresh.begin(), fresh.end());
      check_arrivals(seen, me);
    }
    if (static_cast<int64_t>(seen.size()) >= needed) return by_rank(seen, me.world_size);
    if (Clock::now() >= deadline) fail_missing(seen, me, timeout);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace gradsync
