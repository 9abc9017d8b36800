#include "cc/common/logging.h"

#include <cstdio>

namespace mpistrategy {

void LogLine(int rank, const std::string& message) {
  std::fprintf(stderr, "[mpistrategy rank %d] %s\n", rank, message.c_str());
  std::fflush(stderr);
}

void LogLine(const std::string& who, const std::string& message) {
  std::fprintf(stderr, "[mpistrategy %s] %s\n", who.c_str(), message.c_str());
  std::fflush(stderr);
}

}  // namespace mpistrategy
