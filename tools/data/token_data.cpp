// Token data sets for the gpt model: real text as bytes (fortunes, text:PATH) and token files written by Python
// (inputs and targets int64 [S, L], -100 where a position is not trained on). See data.h.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "data/data.h"
#include "data/dataset_spec.h"
#include "gradsync/error.h"

namespace gradsync::cli {
namespace {

constexpr int64_t kByteVocabulary = 256;
constexpr int64_t kHeldOutEvery = 10;  // document i is held out iff i % 10 == 9

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("text file '{}': cannot open: {}", path, std::strerror(errno)));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// The fortune files: the regular files directly in the directory whose names hold no '.', in byte order.
std::vector<std::string> fortune_files(const std::string& dir) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), &::closedir);
  if (!d) {
    throw ConfigError(fmt::format("data set fortunes: cannot read the directory '{}': {} (install Debian's fortunes "
                                  "package, or set GRADSYNC_FORTUNES_DIR)", dir, std::strerror(errno)));
  }
  std::vector<std::string> files;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string name = e->d_name;
    struct stat st {};
    const std::string path = dir + "/" + name;
    if (name.find('.') != std::string::npos || ::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    files.push_back(path);
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw ConfigError(fmt::format("data set fortunes: '{}' holds no fortune file", dir));
  return files;
}

// Sequences of T + 1 bytes cut from every document of the split, as inputs/targets [S, T] (see data.h).
Dataset sequences_of(const std::vector<std::string>& documents, bool held_out, int64_t context) {
  std::vector<int64_t> inputs, targets;
  int64_t index = 0;
  for (const auto& doc : documents) {
    const bool test = index++ % kHeldOutEvery == kHeldOutEvery - 1;
    if (test != held_out) continue;
    const auto n = static_cast<int64_t>(doc.size());
    for (int64_t start = 0; start + 1 < n; start += context) {
      const int64_t m = std::min(context + 1, n - start);
      for (int64_t i = 0; i < context; ++i) {
        const bool valid = i + 1 < m;
        inputs.push_back(valid ? static_cast<unsigned char>(doc[static_cast<size_t>(start + i)]) : 0);
        targets.push_back(valid ? static_cast<unsigned char>(doc[static_cast<size_t>(start + i + 1)]) : kIgnoreIndex);
      }
    }
  }
  const auto rows = static_cast<int64_t>(inputs.size()) / context;
  return Dataset{torch::tensor(inputs, torch::kLong).view({rows, context}),
                 torch::tensor(targets, torch::kLong).view({rows, context})};
}

// fortunes[:train|:test], text:PATH or text-test:PATH, for a model of vocabulary 256.
Dataset load_text_spec(const std::string& spec, int64_t vocab, int64_t context) {
  if (vocab != kByteVocabulary) {
    throw ConfigError(fmt::format("data set '{}' is text with bytes as tokens (a vocabulary of 256), but the model's "
                                  "vocabulary is {}; use gpt:256-...", spec, vocab));
  }
  std::vector<std::string> files;
  bool held_out = false;
  if (spec == "fortunes" || starts_with(spec, "fortunes:")) {
    const std::string split = spec == "fortunes" ? "train" : spec.substr(9);
    if (split != "train" && split != "test") {
      throw ConfigError(fmt::format("data set '{}': split '{}' is unknown; expected fortunes, fortunes:train or "
                                    "fortunes:test", spec, split));
    }
    held_out = split == "test";
    files = fortune_files(fortunes_dir());
  } else {
    held_out = starts_with(spec, "text-test:");
    files = {spec.substr(spec.find(':') + 1)};
  }
  std::vector<std::string> documents;
  for (const auto& f : files) {
    for (auto& d : split_documents(read_text_file(f))) documents.push_back(std::move(d));
  }
  auto data = sequences_of(documents, held_out, context);
  if (data.size() == 0) throw ConfigError(fmt::format("data set '{}' holds no sequence of two bytes or more", spec));
  return data;
}

[[noreturn]] void bad_tokens(const std::string& path, const std::string& why) {
  throw ConfigError(fmt::format("token file '{}': {}; expected torch.save({{'inputs': int64 [S, L], 'targets': "
                                "int64 [S, L]}}) with L <= the model's context, -100 where a target is not trained on",
                                path, why));
}

Dataset load_token_file(const std::string& path, int64_t vocab, int64_t context) {
  auto [x, y] = read_dataset_file_tensors(path);
  if (x.scalar_type() != torch::kLong || y.scalar_type() != torch::kLong) bad_tokens(path, "a tensor is not int64");
  if (x.dim() != 2 || x.sizes() != y.sizes() || x.size(0) == 0) {
    bad_tokens(path, fmt::format("'inputs' has shape {} and 'targets' {}", x.sizes(), y.sizes()));
  }
  if (x.size(1) > context || x.size(1) == 0) {
    bad_tokens(path, fmt::format("sequences of {} tokens, the model's context is {}", x.size(1), context));
  }
  if (x.lt(0).logical_or(x.ge(vocab)).any().item<bool>()) {
    bad_tokens(path, fmt::format("an input token is outside the vocabulary [0, {})", vocab));
  }
  if (y.ne(kIgnoreIndex).logical_and(y.lt(0).logical_or(y.ge(vocab))).any().item<bool>()) {
    bad_tokens(path, fmt::format("a target is neither -100 nor in the vocabulary [0, {})", vocab));
  }
  return Dataset{x.contiguous(), y.contiguous()};
}

// synthetic:N: N sequences of T random tokens, every position a target (what the bench times).
Dataset synthetic_tokens(const std::string& spec, int64_t vocab, int64_t context, uint64_t seed) {
  const std::string count = spec.substr(10);
  const bool digits = !count.empty() && count.size() < 12 && count.find_first_not_of("0123456789") == std::string::npos;
  const int64_t n = digits ? std::stoll(count) : 0;
  if (n <= 0) throw ConfigError(fmt::format("dataset spec '{}': '{}' is not a positive integer; {}", spec, count,
                                            kTokenDatasetSpecs));
  auto generator = at::detail::createCPUGenerator(seed);
  auto inputs = torch::randint(vocab, {n, context}, generator);
  return Dataset{inputs, torch::randint(vocab, {n, context}, generator)};
}

}  // namespace

std::vector<std::string> split_documents(const std::string& text) {
  std::vector<std::string> documents;
  std::string current;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    const size_t end = nl == std::string::npos ? text.size() : nl;
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line == "%") {
      documents.push_back(std::move(current));
      current.clear();
    } else {
      current += line + "\n";
    }
  }
  documents.push_back(std::move(current));
  documents.erase(std::remove_if(documents.begin(), documents.end(), [](const auto& d) { return d.size() < 2; }),
                  documents.end());
  return documents;
}

std::string fortunes_dir() {
  const char* dir = std::getenv("GRADSYNC_FORTUNES_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/usr/share/games/fortunes";
}

bool is_text_spec(const std::string& spec) {
  return spec == "fortunes" || starts_with(spec, "fortunes:") || starts_with(spec, "text:") ||
         starts_with(spec, "text-test:");
}

Dataset load_token_dataset(const std::string& spec, int64_t vocab, int64_t context, uint64_t seed) {
  if (spec.empty()) throw ConfigError(fmt::format("dataset spec is empty; {}", kTokenDatasetSpecs));
  if (starts_with(spec, "synthetic:")) return synthetic_tokens(spec, vocab, context, seed);
  return is_text_spec(spec) ? load_text_spec(spec, vocab, context) : load_token_file(spec, vocab, context);
}

}  // namespace gradsync::cli
