// Crash-safe file writes (see atomic_file.h).
#include "common/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

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

std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Owns the temp file until it is renamed: every early exit closes and removes it. A fresh random name per try:
// an existing entry under it (a planted symlink, a leftover) is never opened.
class TempFile {
 public:
  explicit TempFile(const std::string& target) {
    std::random_device random;
    for (int attempt = 0; attempt < 16 && fd_ < 0; ++attempt) {
      path_ = fmt::format("{}.tmp.{}.{:08x}{:08x}", target, ::getpid(), random(), random());
      fd_ = create_exclusive(path_);
      if (fd_ < 0 && errno != EEXIST) fail_errno("creating", path_, errno);
    }
    if (fd_ < 0) fail_errno("creating", path_, EEXIST);
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

}  // namespace

// Best effort: the rename has happened, so the path already holds the new file; a file system that cannot fsync a
// directory (EINVAL) must not turn a complete save into a reported failure.
void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

int create_exclusive(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
}

namespace {

// "<pid>.<random>" of a temp name's tail: the writer's pid, or 0 when `rest` is not that.
long temp_writer_pid(const std::string& rest) {
  const auto dot = rest.find('.');
  if (dot == std::string::npos || dot == 0 || rest.find_first_not_of("0123456789") != dot) return 0;
  const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
  return pid > 0 && pid <= 0x7fffffff ? pid : 0;
}

bool writer_runs(long pid) {
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;  // EPERM: runs, not ours
}

// Removes the entries of `dir` whose name is <base>.tmp.<pid>.<random> with `base` accepted by `wanted` and a pid
// that no longer runs.
template <typename Wanted>
int remove_stale_in(const std::string& directory, Wanted&& wanted) {
  DIR* dir = ::opendir(directory.c_str());
  if (!dir) return 0;
  int removed = 0;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    const auto tmp = name.rfind(".tmp.");
    if (tmp == std::string::npos || tmp == 0 || !wanted(name.substr(0, tmp))) continue;
    const long pid = temp_writer_pid(name.substr(tmp + 5));
    if (pid == 0 || writer_runs(pid)) continue;
    removed += ::unlinkat(::dirfd(dir), name.c_str(), 0) == 0;  // a symlink itself, never its target
  }
  ::closedir(dir);
  return removed;
}

}  // namespace

int remove_stale_temp_files(const std::string& path) {
  const std::string base = base_name(path);
  return remove_stale_in(directory_of(path), [&](const std::string& name) { return name == base; });
}

int remove_stale_temp_files_in(const std::string& directory) {
  return remove_stale_in(directory, [](const std::string&) { return true; });
}

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  remove_stale_temp_files(path);
  {
    TempFile temp(path);
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
