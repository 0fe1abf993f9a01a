// wait_until_accepting (see tcp_probe.h): non-blocking connects, each bounded by poll() to what is left of the deadline.
#include "runtime/tcp_probe.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace gradsync {
namespace {

using Clock = std::chrono::steady_clock;

// One connect to one address: "" when accepted, else why not.
std::string try_connect(const addrinfo& a, Clock::time_point deadline) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a.ai_protocol);
  if (fd < 0) return std::strerror(errno);
  std::string error;
  if (::connect(fd, a.ai_addr, a.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      error = std::strerror(errno);
    } else {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd p{fd, POLLOUT, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
      int so_error = 0;
      socklen_t len = sizeof(so_error);
      if (ready <= 0) {
        error = "no answer within the timeout";
      } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0 || so_error != 0) {
        error = std::strerror(so_error != 0 ? so_error : errno);
      }
    }
  }
  ::close(fd);
  return error;
}

}  // namespace

std::string wait_until_accepting(const std::string& host, int port, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  std::string error = "no answer within the timeout";
  while (Clock::now() < deadline) {
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
      error = ::gai_strerror(rc);
    } else {
      for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
        error = try_connect(*a, deadline);
        if (error.empty()) break;
      }
      ::freeaddrinfo(found);
      if (error.empty()) return "";
    }
    // A server still starting: try again soon, never past the deadline.
    std::this_thread::sleep_until(std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
  }
  return error;
}

}  // namespace gradsync
