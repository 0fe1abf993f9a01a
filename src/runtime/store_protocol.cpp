// c10d's TCPStore protocol (see store_protocol.h): parsing, the map, replies and wake-ups.
#include "runtime/store_protocol.h"

#include <algorithm>
#include <cstring>
#include <iterator>

namespace gradsync {
namespace {

using Op = StoreOp;
enum Watch : uint8_t { kUpdated, kCreated, kDeleted, kRegistered };
constexpr uint8_t kReady = 0, kNotReady = 1, kStopWaiting = 0, kWaitCanceled = 1;
constexpr uint32_t kValidationMagic = 0x3C85F7CE;  // the first request of a 2.x client: VALIDATE and this number

Op op_of(uint8_t query, bool v2) {
  static constexpr Op v1[] = {Op::kSet,   Op::kCompareSet, Op::kGet,     Op::kAdd,   Op::kCheck,
                              Op::kWait,  Op::kNumKeys,    Op::kWatch,   Op::kDelete};
  static constexpr Op v2_ops[] = {Op::kValidate, Op::kSet,      Op::kCompareSet, Op::kGet,        Op::kAdd,
                                  Op::kCheck,    Op::kWait,     Op::kNumKeys,    Op::kDelete,     Op::kAppend,
                                  Op::kMultiGet, Op::kMultiSet, Op::kCancelWait, Op::kPing};
  if (v2) return query < std::size(v2_ops) ? v2_ops[query] : Op::kUnsupported;  // queues, LIST_KEYS: not served
  return query < std::size(v1) ? v1[query] : Op::kUnsupported;
}

// Reads from `in` at `pos`, moving `pos` only past what was read. Nothing is allocated from a length before the
// bytes it announces have all arrived, and a length above its limit fails at once.
}  // namespace

struct StoreState::Reader {
  const std::vector<uint8_t>& in;
  size_t& pos;
  const StoreLimits& limits;
  Parse status = Parse::Done;

  bool ok() const { return status == Parse::Done; }
  template <typename T>
  T value() {
    T v{};
    if (!ok()) return v;
    if (in.size() - pos < sizeof(T)) {
      status = Parse::Incomplete;
      return v;
    }
    std::memcpy(&v, in.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::vector<uint8_t> bytes(size_t limit) {
    const auto size = value<uint64_t>();
    if (ok() && size > limit) status = Parse::Malformed;
    if (ok() && in.size() - pos < size) status = Parse::Incomplete;
    if (!ok()) return {};
    std::vector<uint8_t> out(in.begin() + static_cast<std::ptrdiff_t>(pos),
                             in.begin() + static_cast<std::ptrdiff_t>(pos + size));
    pos += size;
    return out;
  }
  // Every key is checked against the token the moment it has arrived, before anything that follows it is read.
  std::string key() {
    const auto raw = bytes(limits.max_key_bytes);
    std::string k(raw.begin(), raw.end());
    if (ok() && k.compare(0, limits.key_prefix.size(), limits.key_prefix) != 0) status = Parse::WrongToken;
    return k;
  }
  std::vector<std::string> keys() {
    std::vector<std::string> out;
    const auto n = value<uint64_t>();
    if (ok() && n > limits.max_keys) status = Parse::Malformed;
    for (uint64_t i = 0; ok() && i < n; ++i) out.push_back(key());
    return out;
  }
};

namespace {

std::string as_string(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

template <typename T>
std::string encode(T value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

std::string encode_bytes(const std::vector<uint8_t>& v) { return encode<uint64_t>(v.size()) + as_string(v); }

}  // namespace

Parse StoreState::feed(uint64_t connection, std::vector<uint8_t>& in) {
  size_t consumed = 0;
  Parse status = Parse::Done;
  while (consumed < in.size()) {
    size_t pos = consumed;
    status = handle_one(connection, in, pos);
    if (status != Parse::Done) break;
    consumed = pos;
  }
  in.erase(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(consumed));
  return status;
}

// A 2.x client opens with VALIDATE (query 0) and the magic number. To a 1.13 client query 0 is SET, followed by the
// key's length, whose first four bytes would then say more than a gigabyte: the two cannot be mistaken.
Parse StoreState::dialect_of(uint64_t connection, const std::vector<uint8_t>& in, size_t pos, bool& v2) {
  if (auto it = v2_.find(connection); it != v2_.end()) {
    v2 = it->second;
    return Parse::Done;
  }
  if (in[pos] != 0) {
    v2 = v2_[connection] = false;
    return Parse::Done;
  }
  if (in.size() - pos < 1 + sizeof(uint32_t)) return Parse::Incomplete;
  uint32_t magic = 0;
  std::memcpy(&magic, in.data() + pos + 1, sizeof(magic));
  v2 = v2_[connection] = magic == kValidationMagic;
  return Parse::Done;
}

Parse StoreState::handle_one(uint64_t connection, const std::vector<uint8_t>& in, size_t& pos) {
  bool v2 = false;
  if (const auto known = dialect_of(connection, in, pos, v2); known != Parse::Done) return known;
  Reader r{in, pos, limits_};
  const auto op = op_of(r.value<uint8_t>(), v2);
  if (!r.ok()) return r.status;
  switch (op) {
    case Op::kValidate:
      return r.value<uint32_t>() == kValidationMagic || !r.ok() ? r.status : Parse::Malformed;
    case Op::kPing: {
      const auto nonce = r.value<uint32_t>();
      if (r.ok()) send_(connection, encode<uint32_t>(nonce));
      return r.status;
    }
    case Op::kSet:
    case Op::kAppend:
    case Op::kCompareSet:
    case Op::kAdd:
      return write(connection, r, op);
    case Op::kMultiSet:
      return multi_set(r);
    case Op::kGet:
    case Op::kMultiGet:
      return get(connection, r, op == Op::kMultiGet);
    case Op::kCheck:
    case Op::kWait: {
      auto list = r.keys();
      if (r.ok()) check_or_wait(connection, op == Op::kWait, list);
      return r.status;
    }
    case Op::kCancelWait:
      forget_waits(connection);
      send_(connection, encode<uint8_t>(kWaitCanceled));
      return r.status;
    case Op::kNumKeys:
      send_(connection, encode<int64_t>(static_cast<int64_t>(data_.size())));
      return r.status;
    case Op::kWatch: {
      auto k = r.key();
      if (!r.ok()) return r.status;
      watching_[k].insert(connection);
      send_(connection, encode<uint8_t>(kRegistered));
      return r.status;
    }
    case Op::kDelete: {
      auto k = r.key();
      if (r.ok()) remove(connection, k);
      return r.status;
    }
    case Op::kUnsupported:
      return Parse::Malformed;
  }
  return Parse::Malformed;
}

// SET, APPEND, COMPARE_SET and ADD: one key written.
Parse StoreState::write(uint64_t connection, Reader& r, Op op) {
  auto k = r.key();
  if (op == Op::kAdd) {
    auto delta = r.value<int64_t>();
    if (r.ok() && !add(connection, k, delta)) return Parse::Malformed;  // the key holds no number
    return r.status;
  }
  auto v = r.bytes(limits_.max_value_bytes);
  if (op == Op::kCompareSet) {
    auto desired = r.bytes(limits_.max_value_bytes);
    if (r.ok()) compare_set(connection, k, v, desired);
    return r.status;
  }
  if (!r.ok()) return r.status;
  if (op == Op::kAppend) return append(k, v) ? r.status : Parse::Malformed;  // over the value limit
  set(k, std::move(v));
  return r.status;
}

// GET: one key's value; MULTI_GET: a count of keys, each value in turn. c10d clients wait for a key before they
// get it, so a missing key is a broken client.
Parse StoreState::get(uint64_t connection, Reader& r, bool many) {
  const auto list = many ? r.keys() : std::vector<std::string>{r.key()};
  if (!r.ok()) return r.status;
  std::string reply;
  for (const auto& k : list) {
    auto it = data_.find(k);
    if (it == data_.end()) return Parse::Malformed;
    reply += encode_bytes(it->second);
  }
  send_(connection, reply);
  return r.status;
}

Parse StoreState::multi_set(Reader& r) {
  const auto n = r.value<uint64_t>();
  if (r.ok() && n > limits_.max_keys) return Parse::Malformed;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> pairs;
  for (uint64_t i = 0; r.ok() && i < n; ++i) {
    auto k = r.key();
    auto v = r.bytes(limits_.max_value_bytes);
    pairs.emplace_back(std::move(k), std::move(v));
  }
  if (!r.ok()) return r.status;  // nothing is set before the whole request has arrived
  for (auto& [k, v] : pairs) set(k, std::move(v));
  return r.status;
}

bool StoreState::append(const std::string& key, const std::vector<uint8_t>& more) {
  auto value = data_.count(key) ? data_[key] : std::vector<uint8_t>();
  if (value.size() + more.size() > limits_.max_value_bytes) return false;  // bounded like any value
  value.insert(value.end(), more.begin(), more.end());
  set(key, std::move(value));
  return true;
}

void StoreState::compare_set(uint64_t connection, const std::string& key, const std::vector<uint8_t>& expected,
                             const std::vector<uint8_t>& desired) {
  auto it = data_.find(key);
  if (it == data_.end() && !expected.empty()) {
    send_(connection, encode_bytes(expected));  // c10d's answer for a missing key
  } else if (it == data_.end() || it->second == expected) {
    set(key, desired);
    send_(connection, encode_bytes(desired));
  } else {
    send_(connection, encode_bytes(it->second));
  }
}

bool StoreState::add(uint64_t connection, const std::string& key, int64_t delta) {
  int64_t total = delta;
  if (auto it = data_.find(key); it != data_.end()) {
    try {
      if (__builtin_add_overflow(total, std::stoll(as_string(it->second)), &total)) return false;
    } catch (const std::exception&) {
      return false;
    }
  }
  const auto text = std::to_string(total);
  send_(connection, encode<int64_t>(total));
  set(key, std::vector<uint8_t>(text.begin(), text.end()));
  return true;
}

void StoreState::check_or_wait(uint64_t connection, bool wait, const std::vector<std::string>& keys) {
  size_t missing = 0;
  for (const auto& k : keys) missing += data_.count(k) == 0;
  if (!wait) {
    send_(connection, encode<uint8_t>(missing == 0 ? kReady : kNotReady));
    return;
  }
  forget_waits(connection);  // a new WAIT replaces one the client gave up on (its own timeout)
  if (missing == 0) {
    send_(connection, encode<uint8_t>(kStopWaiting));
    return;
  }
  for (const auto& k : keys) {
    if (data_.count(k) == 0) waiting_[k].push_back(connection);
  }
  awaited_[connection] = missing;
}

void StoreState::remove(uint64_t connection, const std::string& key) {
  auto it = data_.find(key);
  const int64_t deleted = it != data_.end();
  if (it != data_.end()) {
    notify(key, kDeleted, it->second, {});
    data_.erase(it);
  }
  send_(connection, encode<int64_t>(deleted));
}

void StoreState::set(const std::string& key, std::vector<uint8_t> value) {
  auto it = data_.find(key);
  const bool created = it == data_.end();
  const auto old = created ? std::vector<uint8_t>() : it->second;
  data_[key] = std::move(value);
  wake(key);
  notify(key, created ? kCreated : kUpdated, old, data_[key]);
}

void StoreState::wake(const std::string& key) {
  auto it = waiting_.find(key);
  if (it == waiting_.end()) return;
  for (uint64_t connection : it->second) {
    auto left = awaited_.find(connection);
    if (left != awaited_.end() && --left->second == 0) {
      awaited_.erase(left);
      send_(connection, encode<uint8_t>(kStopWaiting));
    }
  }
  waiting_.erase(it);
}

void StoreState::notify(const std::string& key, uint8_t kind, const std::vector<uint8_t>& old_value,
                        const std::vector<uint8_t>& new_value) {
  auto it = watching_.find(key);
  if (it == watching_.end()) return;
  const std::string message = encode<uint8_t>(kind) + encode<uint64_t>(key.size()) + key + encode_bytes(old_value) +
                              encode_bytes(new_value);
  for (uint64_t connection : it->second) send_(connection, message);
}

void StoreState::disconnect(uint64_t connection) {
  forget_waits(connection);
  v2_.erase(connection);
  for (auto& [key, set] : watching_) set.erase(connection);
}

void StoreState::forget_waits(uint64_t connection) {
  if (awaited_.erase(connection) == 0) return;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    auto& list = it->second;
    list.erase(std::remove(list.begin(), list.end(), connection), list.end());
    it = list.empty() ? waiting_.erase(it) : std::next(it);
  }
}

}  // namespace gradsync
