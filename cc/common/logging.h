// A tiny logger: one line to stderr, prefixed "[mpistrategy rank R] ".
// Thread-safe (a single fprintf per line).

#ifndef MPISTRATEGY_CC_COMMON_LOGGING_H_
#define MPISTRATEGY_CC_COMMON_LOGGING_H_

#include <string>

namespace mpistrategy {

void LogLine(int rank, const std::string& message);
// "[mpistrategy <who>] message", e.g. who = "rank 1 (host a, pid 7)".
void LogLine(const std::string& who, const std::string& message);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_COMMON_LOGGING_H_
