// The bytes one rank sends in a ring collective of n ranks: what CommStats counts (traffic.cpp) and what a
// trace's collective shows as `sent` (collectives.cpp). One formula, so the two always agree.
#pragma once

#include <cstdint>

namespace gradsync {

// An all-reduce: a reduce-scatter then an all-gather, each passing n-1 of the n chunks of `bytes`.
inline int64_t ring_allreduce_sent(int64_t bytes, int n) { return 2 * bytes * (n - 1) / n; }
// An all-gather of a `total`-byte output, or a reduce-scatter of a `total`-byte input: all but one share.
inline int64_t ring_share_sent(int64_t total, int n) { return total * (n - 1) / n; }

}  // namespace gradsync
