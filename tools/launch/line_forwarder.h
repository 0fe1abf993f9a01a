// defines: LineForwarder, which copies one rank's stdout or stderr pipe to the launcher's own, a whole
// line at a time with a "[rank<r>]: " prefix, and write_all(), the write that output goes through.
#pragma once
#include <cstddef>
#include <string>

namespace gradsync::cli {

// Writes everything, retrying on EINTR and waiting if the destination is non-blocking. Output to a closed
// stdout (EPIPE) is dropped: losing output must not kill the ranks.
void write_all(int fd, const char* data, size_t size);
void write_all(int fd, const std::string& s);

// Lines of different ranks never interleave mid-line: only complete lines are written (a "line" longer
// than 64 KiB is written anyway, so a rank that never prints a newline cannot make the launcher buffer
// without bound).
class LineForwarder {
 public:
  // Takes ownership of `src` (made non-blocking); `prefix` may be empty (no prefix, no added newlines).
  LineForwarder(int src, int dst, std::string prefix);
  LineForwarder(LineForwarder&& o) noexcept;
  LineForwarder(const LineForwarder&) = delete;
  LineForwarder& operator=(const LineForwarder&) = delete;
  ~LineForwarder() { close_source(); }

  int fd() const { return src_; }
  bool open() const { return src_ >= 0; }

  // Reads what is available now; closes the source at EOF.
  void read_available();
  // A partial last line still gets its prefix; the added newline keeps the next output on its own line.
  void flush_partial();
  void close_source();

 private:
  void forward_lines();

  int src_;
  int dst_;
  std::string prefix_;
  std::string pending_;
};

}  // namespace gradsync::cli
