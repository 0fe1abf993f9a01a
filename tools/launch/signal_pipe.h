// defines: SignalPipe, the self-pipe through which signals reach the launcher's poll() loop.
#pragma once
#include <signal.h>

#include <iterator>
#include <vector>

namespace gradsync::cli {

// While it exists, SIGINT/SIGTERM/SIGHUP/SIGCHLD are written (as one byte each) into a pipe the poll loop
// watches, so the loop wakes up for them and handles them outside signal context; SIGPIPE is ignored (a
// closed stdout must not kill the launcher and, through PDEATHSIG, the ranks). The destructor restores the
// previous dispositions. The handler's state is one global: at most one SignalPipe at a time.
class SignalPipe {
 public:
  static constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

  SignalPipe();  // throws std::system_error
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return fds_[0]; }
  std::vector<int> drain();  // the signals received since the last drain, in order

 private:
  int fds_[2] = {-1, -1};
  struct sigaction old_[std::size(kHandled)] {};
  struct sigaction old_pipe_ {};
};

}  // namespace gradsync::cli
