// Python-compatible torch.save files both ways (see torch_file.h). Writing uses libtorch's own Pickler without its
// type tags (the tags are what weights_only=True refuses). Reading uses a small pickle machine of our own: libtorch
// 1.13's unpickler turns every collections.OrderedDict into None, so torch.save(model.state_dict()) -- the file
// Python users actually have -- cannot be read with it.
#include "common/torch_file.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cstring>
#include <map>
#include <set>
#include <string>
#include <unordered_map>

#include "gradsync/error.h"

namespace gradsync {
namespace {

uint64_t little_endian(const std::vector<char>& b, size_t at, size_t width) {
  uint64_t v = 0;
  for (size_t i = 0; i < width; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  return v;
}

// libtorch 1.13 reads a truncated zip past the end of its buffer (and may then "load" it). Check the zip's end
// records and central-directory bounds first, so a torn or foreign file is refused before parsing.
bool zip_structure_ok(const std::vector<char>& b) {
  constexpr size_t kEocd = 22;
  if (b.size() < kEocd) return false;
  const size_t lowest = b.size() >= kEocd + 65535 ? b.size() - kEocd - 65535 : 0;
  for (size_t p = b.size() - kEocd + 1; p-- > lowest;) {
    if (little_endian(b, p, 4) != 0x06054b50) continue;
    if (p + kEocd + little_endian(b, p + 20, 2) != b.size()) return false;  // the record must end the file
    uint64_t cd_size = little_endian(b, p + 12, 4), cd_offset = little_endian(b, p + 16, 4);
    size_t cd_end_limit = p;
    if (p >= 20 && little_endian(b, p - 20, 4) == 0x07064b50) {  // zip64: the real figures are elsewhere
      const uint64_t z = little_endian(b, p - 20 + 8, 8);
      if (z + 56 > p - 20 || little_endian(b, static_cast<size_t>(z), 4) != 0x06064b50) return false;
      cd_size = little_endian(b, static_cast<size_t>(z) + 40, 8);
      cd_offset = little_endian(b, static_cast<size_t>(z) + 48, 8);
      cd_end_limit = static_cast<size_t>(z);
    }
    return cd_offset <= cd_end_limit && cd_size <= cd_end_limit - cd_offset;
  }
  return false;
}

// A tensor is written with its whole storage: views into a larger buffer (FSDP's flat parameters) are copied out
// so the file holds only what it names.
c10::IValue compact(const c10::IValue& v) {
  if (v.isTensor()) {
    auto t = v.toTensor().detach().to(torch::kCPU);
    const bool whole = t.is_contiguous() && t.storage_offset() == 0 &&
                       t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
    return whole ? t : t.clone(at::MemoryFormat::Contiguous);
  }
  if (v.isGenericDict()) {
    auto in = v.toGenericDict();
    c10::impl::GenericDict out(in.keyType(), in.valueType());
    for (const auto& e : in) out.insert(e.key(), compact(e.value()));
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const auto& e : in) out.push_back(compact(e));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& e : v.toTupleRef().elements()) items.push_back(compact(e));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return v;
}

// ---- reading ---------------------------------------------------------------------------------------------------

const std::map<std::string, at::ScalarType>& storage_types() {
  static const std::map<std::string, at::ScalarType> types{
      {"FloatStorage", at::kFloat},   {"DoubleStorage", at::kDouble}, {"HalfStorage", at::kHalf},
      {"BFloat16Storage", at::kBFloat16}, {"LongStorage", at::kLong}, {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort},   {"CharStorage", at::kChar},     {"ByteStorage", at::kByte},
      {"BoolStorage", at::kBool}};
  return types;
}

// The callables a file may REDUCE with, each a pure data constructor.
const std::set<std::string>& allowed_callables() {
  static const std::set<std::string> names{
      "collections.OrderedDict",           "torch._utils._rebuild_tensor_v2",
      "torch._utils._rebuild_parameter",   "torch._utils._rebuild_parameter_with_state",
      "torch.jit._pickle.restore_type_tag", "torch.jit._pickle.build_intlist",
      "torch.jit._pickle.build_doublelist", "torch.jit._pickle.build_boollist",
      "torch.jit._pickle.build_tensorlist"};
  return names;
}

class WeightsOnlyUnpickler {
 public:
  WeightsOnlyUnpickler(const std::vector<char>& pickle, caffe2::serialize::PyTorchStreamReader& archive)
      : in_(pickle), archive_(archive) {}
  c10::IValue run();

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ConfigError(fmt::format("its pickle (data.pkl) {} at byte {}", what, pos_));
  }
  const char* take(size_t n) {
    if (n > in_.size() - pos_) fail("ends early");
    const char* p = in_.data() + pos_;
    pos_ += n;
    return p;
  }
  uint64_t take_le(size_t n) {
    const char* p = take(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
    return v;
  }
  std::string take_line() {
    const size_t end = std::string(in_.data() + pos_, in_.size() - pos_).find('\n');
    if (end == std::string::npos) fail("has an unterminated name");
    std::string s(in_.data() + pos_, end);
    pos_ += end + 1;
    return s;
  }
  c10::IValue pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail("pops an empty stack");
    auto v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  std::vector<c10::IValue> pop_to_mark() {
    if (marks_.empty()) fail("has no mark to pop to");
    std::vector<c10::IValue> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  c10::IValue& top() {
    if (stack_.empty()) fail("uses an empty stack");
    return stack_.back();
  }
  bool step(char op);
  void containers(char op);
  void global();
  std::string global_name_of(const c10::IValue& v);
  void reduce();
  c10::IValue rebuild_tensor(const std::vector<c10::IValue>& args);
  void persistent_load();
  void set_items(c10::IValue& dict, const std::vector<c10::IValue>& items);

  const std::vector<char>& in_;
  caffe2::serialize::PyTorchStreamReader& archive_;
  size_t pos_ = 0;
  std::vector<c10::IValue> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, c10::IValue> memo_;
  std::map<const c10::ivalue::Tuple*, std::string> globals_;  // GLOBALs are one-element tuples known by identity
  std::map<std::string, at::Tensor> storages_;
};

c10::IValue WeightsOnlyUnpickler::run() {
  while (true) {
    if (!step(*take(1))) break;
  }
  if (stack_.size() != 1 || !marks_.empty()) fail("leaves a malformed stack");
  return stack_.back();
}

void WeightsOnlyUnpickler::set_items(c10::IValue& dict, const std::vector<c10::IValue>& items) {
  if (!dict.isGenericDict() || items.size() % 2 != 0) fail("sets items on something that is not a dict");
  auto d = dict.toGenericDict();
  for (size_t i = 0; i < items.size(); i += 2) d.insert_or_assign(items[i], items[i + 1]);
}

void WeightsOnlyUnpickler::containers(char op) {
  switch (op) {
    case ')': stack_.emplace_back(c10::ivalue::Tuple::create({})); break;
    case 't': stack_.emplace_back(c10::ivalue::Tuple::create(pop_to_mark())); break;
    case '\x85': case '\x86': case '\x87': {
      std::vector<c10::IValue> items(static_cast<size_t>(op - '\x84'));
      for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
      stack_.emplace_back(c10::ivalue::Tuple::create(std::move(items)));
      break;
    }
    case ']': stack_.emplace_back(c10::impl::GenericList(c10::AnyType::get())); break;
    case 'a': case 'e': {
      auto items = op == 'a' ? std::vector<c10::IValue>{pop()} : pop_to_mark();
      if (!top().isList()) fail("appends to something that is not a list");
      auto list = top().toList();
      for (auto& item : items) list.push_back(std::move(item));
      break;
    }
    case '}': stack_.emplace_back(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get())); break;
    case 's': case 'u': {
      std::vector<c10::IValue> items;
      if (op == 'u') {
        items = pop_to_mark();
      } else {
        auto value = pop();
        items = {pop(), std::move(value)};
      }
      set_items(top(), items);
      break;
    }
    default: fail(fmt::format("uses opcode 0x{:02x}, which a weights-only file never needs",
                              static_cast<unsigned>(static_cast<uint8_t>(op))));
  }
}

bool WeightsOnlyUnpickler::step(char op) {
  switch (op) {
    case '\x80': take(1); break;                                    // PROTO
    case '\x95': take(8); break;                                    // FRAME (protocol 4)
    case '.': return false;                                         // STOP
    case '(': marks_.push_back(stack_.size()); break;               // MARK
    case 'N': stack_.emplace_back(); break;
    case '\x88': stack_.emplace_back(true); break;
    case '\x89': stack_.emplace_back(false); break;
    case 'J': stack_.emplace_back(static_cast<int64_t>(static_cast<int32_t>(take_le(4)))); break;
    case 'K': stack_.emplace_back(static_cast<int64_t>(take_le(1))); break;
    case 'M': stack_.emplace_back(static_cast<int64_t>(take_le(2))); break;
    case '\x8a': {                                                  // LONG1: little-endian two's complement
      const size_t n = static_cast<size_t>(take_le(1));
      if (n > 8) fail("holds an integer wider than 64 bits");
      uint64_t v = n ? take_le(n) : 0;
      if (n && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
      stack_.emplace_back(static_cast<int64_t>(v));
      break;
    }
    case 'G': {                                                     // BINFLOAT: big-endian
      const char* p = take(8);
      char b[8];
      for (int i = 0; i < 8; ++i) b[i] = p[7 - i];
      double d;
      std::memcpy(&d, b, 8);
      stack_.emplace_back(d);
      break;
    }
    case 'X': case '\x8c': case '\x8d': {                           // BINUNICODE, SHORT_, 8
      const size_t n = static_cast<size_t>(take_le(op == 'X' ? 4 : op == '\x8c' ? 1 : 8));
      stack_.emplace_back(std::string(take(n), n));
      break;
    }
    case 'q': case 'r': case '\x94': {                              // BINPUT, LONG_BINPUT, MEMOIZE
      const uint64_t key = op == '\x94' ? memo_.size() : take_le(op == 'q' ? 1 : 4);
      memo_[key] = top();
      break;
    }
    case 'h': case 'j': {                                           // BINGET, LONG_BINGET
      auto it = memo_.find(take_le(op == 'h' ? 1 : 4));
      if (it == memo_.end()) fail("reads a memo entry it never wrote");
      stack_.push_back(it->second);
      break;
    }
    case 'c': global(); break;
    case 'R': reduce(); break;
    case 'Q': persistent_load(); break;
    case 'b': {                                                     // BUILD: an OrderedDict's _metadata
      pop();
      if (!top().isGenericDict() && !top().isTensor()) fail("sets the state of an object");
      break;
    }
    case '0': pop(); break;                                         // POP
    default: containers(op);
  }
  return true;
}

void WeightsOnlyUnpickler::global() {
  const std::string module = take_line();
  const std::string name = take_line();
  const std::string full = module + "." + name;
  const bool storage = module == "torch" && storage_types().count(name);
  if (!storage && !allowed_callables().count(full)) {
    throw ConfigError(fmt::format("refused: it names '{}', and a weights-only file may only hold tensors, dicts, "
                                  "lists, tuples, numbers and strings (nothing in it was run)", full));
  }
  auto marker = c10::ivalue::Tuple::create({c10::IValue(full)});
  globals_[marker.get()] = full;
  stack_.emplace_back(std::move(marker));
}

std::string WeightsOnlyUnpickler::global_name_of(const c10::IValue& v) {
  auto it = v.isTuple() ? globals_.find(v.toTuple().get()) : globals_.end();
  if (it == globals_.end()) fail("calls something that is not a class or function");
  return it->second;
}

void WeightsOnlyUnpickler::reduce() {
  auto args_value = pop();
  const std::string name = global_name_of(pop());
  if (!args_value.isTuple()) fail("calls " + name + " without an argument tuple");
  const auto args = args_value.toTupleRef().elements().vec();
  if (name == "collections.OrderedDict") {
    if (!args.empty()) fail("builds an OrderedDict from arguments");
    stack_.emplace_back(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
  } else if (name == "torch._utils._rebuild_tensor_v2") {
    stack_.push_back(rebuild_tensor(args));
  } else if (args.empty() || name.rfind("torch.", 0) != 0 || storage_types().count(name.substr(6))) {
    fail("calls " + name + " as a function");
  } else {  // _rebuild_parameter*, restore_type_tag, build_*list: the first argument is the value
    stack_.push_back(args[0]);
  }
}

c10::IValue WeightsOnlyUnpickler::rebuild_tensor(const std::vector<c10::IValue>& args) {
  if (args.size() < 4 || !args[0].isTensor() || !args[1].isInt() || !args[2].isTuple() || !args[3].isTuple()) {
    fail("rebuilds a tensor from malformed arguments");
  }
  const auto storage = args[0].toTensor();
  const int64_t offset = args[1].toInt();
  std::vector<int64_t> size, stride;
  for (const auto& s : args[2].toTupleRef().elements()) size.push_back(s.isInt() ? s.toInt() : -1);
  for (const auto& s : args[3].toTupleRef().elements()) stride.push_back(s.isInt() ? s.toInt() : -1);
  if (size.size() != stride.size()) fail("rebuilds a tensor whose size and stride differ in length");
  int64_t last = offset;  // the furthest element the view touches must lie inside the storage
  bool empty = false;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] < 0 || stride[i] < 0) fail("rebuilds a tensor with a negative size or stride");
    empty = empty || size[i] == 0;
    if (size[i] > 0) last += (size[i] - 1) * stride[i];
  }
  if (offset < 0 || (!empty && last >= storage.numel())) fail("rebuilds a tensor past the end of its storage");
  return empty ? torch::empty(size, storage.options()) : storage.as_strided(size, stride, offset);
}

void WeightsOnlyUnpickler::persistent_load() {
  auto pid = pop();
  if (!pid.isTuple() || pid.toTupleRef().elements().size() != 5) fail("has a persistent id that is not a storage");
  const std::vector<c10::IValue> e = pid.toTupleRef().elements().vec();  // (a copy: GCC's -Warray-bounds misreads
                                                                         // the inline small tuple)
  const std::string type = global_name_of(e[1]);
  const auto dtype = storage_types().find(type.substr(type.rfind('.') + 1));
  if (!e[0].isString() || e[0].toStringRef() != "storage" || !e[2].isString() || !e[4].isInt() ||
      dtype == storage_types().end()) {
    fail("has a malformed storage id");
  }
  const std::string key = e[2].toStringRef();
  auto cached = storages_.find(key);
  if (cached == storages_.end()) {
    const std::string record = "data/" + key;
    if (!archive_.hasRecord(record)) fail("names storage '" + key + "', which the archive does not hold");
    auto [data, bytes] = archive_.getRecord(record);
    const int64_t numel = e[4].toInt();
    const auto element = static_cast<int64_t>(c10::elementSize(dtype->second));
    if (numel < 0 || static_cast<uint64_t>(numel) * element != bytes) {
      fail(fmt::format("says storage '{}' holds {} elements but its record has {} bytes", key, numel, bytes));
    }
    auto t = torch::empty({numel}, torch::TensorOptions().dtype(dtype->second));
    if (bytes) std::memcpy(t.data_ptr(), data.get(), bytes);
    cached = storages_.emplace(key, t).first;
  }
  stack_.emplace_back(cached->second);
}

}  // namespace

std::vector<char> encode_torch_file(const c10::IValue& value) {
  const auto plain = compact(value);
  std::vector<char> pickle;
  std::vector<at::Tensor> tensors;
  torch::jit::Pickler pickler([&](const char* b, size_t n) { pickle.insert(pickle.end(), b, b + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              [&](const at::Tensor& t) {
                                tensors.push_back(t);
                                return std::to_string(tensors.size() - 1);
                              },
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain);
  pickler.stop();
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* b, size_t n) {
    out.insert(out.end(), static_cast<const char*>(b), static_cast<const char*>(b) + n);
    return n;
  });
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto data = torch::jit::getWriteableTensorData(tensors[i]);
    writer.writeRecord("data/" + std::to_string(i), data.data(), data.sizeInBytes());
  }
  writer.writeEndOfFile();
  return out;
}

c10::IValue decode_torch_file(const std::vector<char>& bytes) {
  if (!zip_structure_ok(bytes)) {
    throw ConfigError(fmt::format("truncated or not a torch.save zip file ({} bytes)", bytes.size()));
  }
  auto adapter = std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size()));
  caffe2::serialize::PyTorchStreamReader archive(adapter);
  if (!archive.hasRecord("data.pkl")) throw ConfigError("not a torch.save file (no data.pkl record)");
  auto [data, size] = archive.getRecord("data.pkl");
  std::vector<char> pickle(static_cast<const char*>(data.get()), static_cast<const char*>(data.get()) + size);
  return WeightsOnlyUnpickler(pickle, archive).run();
}

}  // namespace gradsync
