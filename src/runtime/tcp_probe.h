// defines: wait_until_accepting, which waits for a TCP server to accept connections, within a deadline.
#pragma once
#include <chrono>
#include <string>

namespace gradsync {

// Connects to host:port (every address it resolves to) until one accepts or `deadline` passes, closing each
// connection at once. Returns "" once a server accepts, else the last failure ("Connection refused", a resolver
// error, "no answer within the timeout"). No attempt outlives the deadline: a connect that gets no answer (a host
// that drops packets) is abandoned when the deadline comes.
std::string wait_until_accepting(const std::string& host, int port, std::chrono::steady_clock::time_point deadline);

}  // namespace gradsync
