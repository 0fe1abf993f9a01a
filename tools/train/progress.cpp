// The progress line of `gradsync train` (see progress.h).
#include "train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>
#include <torch/torch.h>

#include "gradsync/stats.h"

namespace gradsync::cli {
namespace {

constexpr int64_t kLinesPerRun = 20;
constexpr int kRanksListed = 8;  // more ranks: their least and largest peak

std::string mebibytes(int64_t bytes) { return fmt::format("{:.0f}", static_cast<double>(bytes) / (1 << 20)); }

std::string peaks_text(const std::vector<int64_t>& peaks) {
  if (peaks.empty()) return "";
  if (peaks.size() <= kRanksListed) {
    std::string text;
    for (const auto p : peaks) text += (text.empty() ? "" : "|") + mebibytes(p);
    return fmt::format("  peak RSS {} MiB", text);
  }
  const auto [least, most] = std::minmax_element(peaks.begin(), peaks.end());
  return fmt::format("  peak RSS {}-{} MiB (rank {} most)", mebibytes(*least), mebibytes(*most),
                     most - peaks.begin());
}

std::string duration_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, s / 60 % 60);
}

}  // namespace

bool progress_on_terminal() { return isatty(STDERR_FILENO) || std::getenv("GRADSYNC_PROGRESS") != nullptr; }

int64_t progress_cadence(int64_t every, int64_t total) {
  if (every > 0) return every;
  return std::max<int64_t>(1, (total + kLinesPerRun - 1) / kLinesPerRun);
}

std::string progress_line(const StepRecord& r, int64_t total, double rate, bool tokens, double eta_seconds,
                          const std::vector<int64_t>& peak_bytes) {
  return fmt::format("step {}/{}  epoch {}  loss {:.4f}  {:.0f} {}/s  step {:.1f} ms  ETA {}{}", r.step + 1, total,
                     r.epoch, r.loss, rate, tokens ? "tokens" : "samples", r.seconds * 1e3,
                     duration_text(eta_seconds), peaks_text(peak_bytes));
}

Progress::Progress(Options options, std::shared_ptr<World> world)
    : options_(options),
      world_(std::move(world)),
      cadence_(progress_cadence(options.every, options.total)),
      printing_(options.enabled && (!world_ || world_->is_main())) {}

std::vector<int64_t> Progress::gather_peaks() {
  const double own = static_cast<double>(process_peak_resident_bytes());
  if (!world_ || world_->size() == 1) return {static_cast<int64_t>(own)};
  // float64 holds byte counts exactly (below 2^53) and every transport reduces and gathers it.
  auto mine = torch::full({1}, own, torch::kDouble);
  auto all = torch::empty({world_->size()}, torch::kDouble);
  world_->comm().allgather_flat(mine, all);
  std::vector<int64_t> peaks;
  for (int64_t i = 0; i < all.numel(); ++i) peaks.push_back(static_cast<int64_t>(all[i].item<double>()));
  return peaks;
}

void Progress::update(const StepRecord& r) {
  if (!options_.enabled) return;
  seconds_ += r.seconds;
  items_ += options_.tokens ? r.tokens : r.samples;
  ++steps_;
  const bool last = r.step + 1 == options_.total;
  const bool on_cadence = (r.step + 1) % cadence_ == 0 || last;
  // Every rank (a collective); also after the run's first step, so that the terminal line shows memory early.
  if (on_cadence || steps_ == 1) peaks_ = gather_peaks();
  if (!printing_ || (!options_.terminal && !on_cadence)) return;
  const double rate = seconds_ > 0 ? static_cast<double>(items_) / seconds_ : 0;
  const double eta = seconds_ / static_cast<double>(steps_) * static_cast<double>(options_.total - r.step - 1);
  const auto line = progress_line(r, options_.total, rate, options_.tokens, eta, peaks_);
  if (options_.terminal) {
    fmt::print(stderr, "\r{}\x1b[K", line);  // rewritten in place; the escape clears a longer previous line
    open_line_ = true;
  } else {
    fmt::print(stderr, "gradsync train: {}\n", line);
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (!open_line_) return;
  fmt::print(stderr, "\n");
  std::fflush(stderr);
  open_line_ = false;
}

}  // namespace gradsync::cli
