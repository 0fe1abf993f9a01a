// LineForwarder and write_all (see line_forwarder.h).
#include "launch/line_forwarder.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace gradsync::cli {
namespace {

constexpr size_t kReadChunk = 65536;
constexpr size_t kMaxLine = 65536;  // see LineForwarder in line_forwarder.h

}  // namespace

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    if (n <= 0) return;
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_all(int fd, const std::string& s) { write_all(fd, s.data(), s.size()); }

LineForwarder::LineForwarder(int src, int dst, std::string prefix)
    : src_(src), dst_(dst), prefix_(std::move(prefix)) {
  // The poll loop reads whatever is there and goes back to poll(): a read must never block it.
  fcntl(src_, F_SETFL, O_NONBLOCK);
}

LineForwarder::LineForwarder(LineForwarder&& o) noexcept
    : src_(std::exchange(o.src_, -1)), dst_(o.dst_), prefix_(std::move(o.prefix_)), pending_(std::move(o.pending_)) {}

void LineForwarder::read_available() {
  char buf[kReadChunk];
  while (src_ >= 0) {
    ssize_t n = read(src_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
      close_source();
      return;
    }
    pending_.append(buf, static_cast<size_t>(n));
    forward_lines();
  }
}

void LineForwarder::flush_partial() {
  if (pending_.empty()) return;
  write_all(dst_, prefix_ + pending_ + (prefix_.empty() ? "" : "\n"));
  pending_.clear();
}

void LineForwarder::close_source() {
  if (src_ >= 0) close(src_);
  src_ = -1;
  flush_partial();
}

void LineForwarder::forward_lines() {
  std::string out;
  size_t start = 0;
  for (size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1) {
    out += prefix_;
    out.append(pending_, start, nl + 1 - start);
  }
  pending_.erase(0, start);
  if (pending_.size() >= kMaxLine) {
    out += prefix_ + pending_ + (prefix_.empty() ? "" : "\n");
    pending_.clear();
  }
  write_all(dst_, out);
}

}  // namespace gradsync::cli
