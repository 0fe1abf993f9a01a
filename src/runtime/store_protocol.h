// defines: StoreState, c10d's TCPStore protocol as libtorch's clients speak it, 1.13's and 2.x's -- requests parsed
// with limits checked as each length arrives, the key-value map, replies, and the wake-ups of WAIT and WATCH_KEY --
// apart from any socket: StoreServer (store_server.h) feeds it the bytes each connection sent.
//
// A request is one query byte, then its arguments: strings and byte vectors as a uint64 length and the bytes, counts
// as uint64, ADD's delta as int64 (host byte order, as c10d writes them). The two generations number the queries
// differently; each connection's first request tells which it speaks:
// - 1.13: SET 0, COMPARE_SET 1, GET 2, ADD 3, CHECK 4, WAIT 5, GETNUMKEYS 6, WATCH_KEY 7, DELETE_KEY 8.
// - 2.x: VALIDATE 0 (with the uint32 0x3C85F7CE, its first request), SET 1, COMPARE_SET 2, GET 3, ADD 4, CHECK 5,
//   WAIT 6, GETNUMKEYS 7, DELETE_KEY 8, APPEND 9, MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13 (a uint32
//   echoed back). Its queue operations and LIST_KEYS are not served: such a request drops the connection.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace gradsync {

enum class Parse { Incomplete, Done, Malformed, WrongToken };

// What a request asks, whichever client generation numbered it (1.13's or 2.x's query numbers).
enum class StoreOp {
  kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kWatch, kDelete, kAppend, kMultiGet, kMultiSet,
  kCancelWait, kPing, kUnsupported
};

struct StoreLimits {
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = size_t{64} << 20;
  size_t max_keys = 4096;
  std::string key_prefix;  // "/<token>/", or "" for any key
};

class StoreState {
 public:
  using Send = std::function<void(uint64_t connection, const std::string& bytes)>;
  StoreState(StoreLimits limits, Send send) : limits_(std::move(limits)), send_(std::move(send)) {}

  // Handles every complete request at the front of `in`, erasing what it consumed. Returns Done when nothing is
  // left, Incomplete when a partial request remains, Malformed or WrongToken when the connection must be dropped.
  Parse feed(uint64_t connection, std::vector<uint8_t>& in);
  // Forgets a closed connection's waits and watches.
  void disconnect(uint64_t connection);

 private:
  struct Reader;
  // Whether `connection` speaks 2.x's numbering, decided by its first request (Incomplete until that can be told).
  Parse dialect_of(uint64_t connection, const std::vector<uint8_t>& in, size_t pos, bool& v2);
  Parse get(uint64_t connection, Reader& r, bool many);
  Parse multi_set(Reader& r);
  Parse write(uint64_t connection, Reader& r, StoreOp op);
  bool append(const std::string& key, const std::vector<uint8_t>& more);  // false: over the value limit
  Parse handle_one(uint64_t connection, const std::vector<uint8_t>& in, size_t& pos);
  void compare_set(uint64_t connection, const std::string& key, const std::vector<uint8_t>& expected,
                   const std::vector<uint8_t>& desired);
  bool add(uint64_t connection, const std::string& key, int64_t delta);  // false: the key holds no number
  void check_or_wait(uint64_t connection, bool wait, const std::vector<std::string>& keys);
  void remove(uint64_t connection, const std::string& key);
  void set(const std::string& key, std::vector<uint8_t> value);
  void wake(const std::string& key);
  void forget_waits(uint64_t connection);
  void notify(const std::string& key, uint8_t kind, const std::vector<uint8_t>& old_value,
              const std::vector<uint8_t>& new_value);

  StoreLimits limits_;
  Send send_;
  std::map<std::string, std::vector<uint8_t>> data_;
  std::map<std::string, std::vector<uint64_t>> waiting_;  // key -> connections waiting for it
  std::map<uint64_t, size_t> awaited_;                    // connection -> keys it still waits for
  std::map<std::string, std::set<uint64_t>> watching_;    // key -> connections watching it
  std::map<uint64_t, bool> v2_;                           // connection -> speaks 2.x's numbering
};

}  // namespace gradsync
