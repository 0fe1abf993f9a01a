// Fashion-MNIST from Debian's dataset-fashion-mnist: the gzipped IDX files (read with zlib), checked against
// their headers byte for byte. See data.h.
#include <fmt/format.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "data/data.h"
#include "gradsync/error.h"

namespace gradsync::cli {
namespace {

constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";
constexpr uint32_t kImagesMagic = 2051;
constexpr uint32_t kLabelsMagic = 2049;
constexpr uint32_t kMaxIdxItems = 10'000'000;  // guards the allocation against a corrupt header

struct GzCloser {
  void operator()(gzFile_s* f) const {
    if (f != nullptr) gzclose(f);
  }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

GzHandle open_idx(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw ConfigError(fmt::format(
        "Fashion-MNIST file '{}': {}. Install the data set with `apt-get install dataset-fashion-mnist` "
        "(or `make deps`), or point GRADSYNC_FASHION_MNIST_DIR at a directory holding "
        "{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte.gz",
        path, std::strerror(err)));
  }
  if (S_ISDIR(st.st_mode)) {
    throw ConfigError(fmt::format("Fashion-MNIST file '{}' is a directory, expected a gzipped IDX file", path));
  }
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    if (err == 0) {
      throw Error(fmt::format("cannot open Fashion-MNIST file '{}': zlib could not allocate its state", path));
    }
    throw ConfigError(fmt::format("cannot open Fashion-MNIST file '{}': {}", path, std::strerror(err)));
  }
  gzbuffer(f, 1 << 17);
  return GzHandle(f);
}

// Reads exactly `n` bytes; throws naming `what` if the stream ends early or is corrupt.
void read_exact(gzFile f, const std::string& path, void* dst, int64_t n, const char* what) {
  auto* out = static_cast<unsigned char*>(dst);
  int64_t done = 0;
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 24));
    const int got = gzread(f, out + done, chunk);
    if (got < 0) {
      int zerr = 0;
      const char* msg = gzerror(f, &zerr);
      throw ConfigError(fmt::format("Fashion-MNIST file '{}' is corrupt while reading the {}: {}", path, what,
                                    msg != nullptr ? msg : "zlib error"));
    }
    if (got == 0) {
      throw ConfigError(
          fmt::format("Fashion-MNIST file '{}' is truncated: the {} need {} bytes but only {} are present", path,
                      what, n, done));
    }
    done += got;
  }
}

uint32_t read_be32(gzFile f, const std::string& path, const char* what) {
  unsigned char b[4];
  read_exact(f, path, b, 4, what);
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

void expect_eof(gzFile f, const std::string& path, int64_t expected_bytes) {
  unsigned char extra;
  const int got = gzread(f, &extra, 1);
  if (got != 0) {
    throw ConfigError(fmt::format("Fashion-MNIST file '{}' has {} than the {} bytes its header declares", path,
                                  got > 0 ? "more data" : "a corrupt end, after reading", expected_bytes));
  }
}

void expect_magic(uint32_t magic, uint32_t expected, const std::string& path, const char* kind) {
  if (magic != expected) {
    throw ConfigError(fmt::format("Fashion-MNIST file '{}' has magic number {}, expected {} (an {} file)", path,
                                  magic, expected, kind));
  }
}

void expect_item_count(uint32_t count, const std::string& path, const char* items) {
  if (count == 0 || count > kMaxIdxItems) {
    throw ConfigError(
        fmt::format("Fashion-MNIST file '{}' declares {} {}, expected 1..{}", path, count, items, kMaxIdxItems));
  }
}

// float32 [n, 784] in [0, 1].
torch::Tensor read_idx_images(const std::string& path) {
  GzHandle h = open_idx(path);
  gzFile f = h.get();
  expect_magic(read_be32(f, path, "header"), kImagesMagic, path, "IDX3 image");
  const uint32_t count = read_be32(f, path, "header");
  const uint32_t rows = read_be32(f, path, "header");
  const uint32_t cols = read_be32(f, path, "header");
  if (rows != kFashionMnistSide || cols != kFashionMnistSide) {
    throw ConfigError(fmt::format("Fashion-MNIST file '{}' has {}x{} images, expected 28x28", path, rows, cols));
  }
  expect_item_count(count, path, "images");
  auto bytes = torch::empty({static_cast<int64_t>(count), kFashionMnistInputs}, torch::kUInt8);
  read_exact(f, path, bytes.data_ptr<uint8_t>(), bytes.numel(), "pixels");
  expect_eof(f, path, 16 + bytes.numel());
  return bytes.to(torch::kFloat32).div_(255.0f);
}

// int64 [n] in [0, 9].
torch::Tensor read_idx_labels(const std::string& path) {
  GzHandle h = open_idx(path);
  gzFile f = h.get();
  expect_magic(read_be32(f, path, "header"), kLabelsMagic, path, "IDX1 label");
  const uint32_t count = read_be32(f, path, "header");
  expect_item_count(count, path, "labels");
  auto bytes = torch::empty({static_cast<int64_t>(count)}, torch::kUInt8);
  read_exact(f, path, bytes.data_ptr<uint8_t>(), bytes.numel(), "labels");
  expect_eof(f, path, 8 + bytes.numel());
  const uint8_t* p = bytes.data_ptr<uint8_t>();
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    if (p[i] >= kFashionMnistClasses) {
      throw ConfigError(
          fmt::format("Fashion-MNIST file '{}': label {} at index {} is outside 0..9", path, int{p[i]}, i));
    }
  }
  return bytes.to(torch::kInt64);
}

}  // namespace

std::string fashion_mnist_dir() {
  const char* env = std::getenv("GRADSYNC_FASHION_MNIST_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return kDefaultFashionMnistDir;
}

Dataset load_fashion_mnist(const std::string& dir, const std::string& split, LossKind loss) {
  std::string prefix;
  if (split == "train") {
    prefix = "train";
  } else if (split == "test") {
    prefix = "t10k";
  } else {
    throw ConfigError(fmt::format("fashion-mnist split '{}' is unknown; expected train or test", split));
  }
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  const std::string images_path = base + prefix + "-images-idx3-ubyte.gz";
  const std::string labels_path = base + prefix + "-labels-idx1-ubyte.gz";
  torch::Tensor images = read_idx_images(images_path);
  torch::Tensor labels = read_idx_labels(labels_path);
  if (images.size(0) != labels.size(0)) {
    throw ConfigError(fmt::format("Fashion-MNIST: '{}' has {} images but '{}' has {} labels", images_path,
                                  images.size(0), labels_path, labels.size(0)));
  }
  if (loss == LossKind::MeanSquared) labels = one_hot_float(labels, kFashionMnistClasses);
  return Dataset{images, labels};
}

}  // namespace gradsync::cli
