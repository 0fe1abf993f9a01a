// Crash-safe file writes (see atomic_file.h).
#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "gradsync/error.h"

namespace gradsync {
namespace {

[[noreturn]] void fail_errno(const std::string& what, const std::string& path, int error) {
  throw Error(fmt::format("{} '{}' failed: {} (errno {})", what, path, std::strerror(error), error));
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Owns the temp file until it is renamed: every early exit closes and removes it.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {
    // O_TRUNC, not O_EXCL: a temp file a killed writer left under this name must not block every later save.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail_errno("creating", path_, errno);
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write_all(const char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = ::write(fd_, data, size);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail_errno("writing", path_, errno);
      data += n;
      size -= static_cast<size_t>(n);
    }
  }
  void sync_and_close() {
    if (::fsync(fd_) != 0) fail_errno("fsync of", path_, errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail_errno("closing", path_, errno);
  }
  void rename_to(const std::string& target) {
    if (::rename(path_.c_str(), target.c_str()) != 0) fail_errno("renaming into", target, errno);
    renamed_ = true;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool renamed_ = false;
};

// Best effort: the rename has happened, so the path already holds the new file; a file system that cannot fsync a
// directory (EINVAL) must not turn a complete save into a reported failure.
void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  {
    TempFile temp(fmt::format("{}.tmp.{}", path, ::getpid()));
    temp.write_all(bytes.data(), bytes.size());
    temp.sync_and_close();
    temp.rename_to(path);
  }
  fsync_directory(directory_of(path));
}

void make_directories(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) fail_errno("creating directory", prefix, errno);
  }
}

}  // namespace gradsync
