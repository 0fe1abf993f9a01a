// SignalPipe (see signal_pipe.h).
#include "launch/signal_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace gradsync::cli {
namespace {

int g_signal_write_fd = -1;  // the handler's only state (one SignalPipe at a time)

void on_signal(int sig) {
  int saved = errno;
  unsigned char byte = static_cast<unsigned char>(sig);
  ssize_t ignored = write(g_signal_write_fd, &byte, 1);  // non-blocking: a full pipe loses nothing useful
  (void)ignored;
  errno = saved;
}

}  // namespace

SignalPipe::SignalPipe() {
  if (pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
  g_signal_write_fd = fds_[1];
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kHandled); ++i) sigaction(kHandled[i], &sa, &old_[i]);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, &old_pipe_);
}

SignalPipe::~SignalPipe() {
  for (size_t i = 0; i < std::size(kHandled); ++i) sigaction(kHandled[i], &old_[i], nullptr);
  sigaction(SIGPIPE, &old_pipe_, nullptr);
  g_signal_write_fd = -1;
  close(fds_[0]);
  close(fds_[1]);
}

std::vector<int> SignalPipe::drain() {
  std::vector<int> signals;
  unsigned char buf[64];
  ssize_t n;
  while ((n = read(fds_[0], buf, sizeof buf)) > 0) signals.insert(signals.end(), buf, buf + n);
  return signals;
}

}  // namespace gradsync::cli
