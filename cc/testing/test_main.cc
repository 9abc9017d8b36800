// main() for cc_test targets using cc/testing/test.h: runs every registered
// TEST in registration order, prints gtest-style progress, and exits 1 if
// any test failed (or threw), or if no test ran at all.
//
// Filter: --filter=PATTERN[:PATTERN...] (also --gtest_filter=), or Bazel's
// `bazel test --test_filter=...` (env TESTBRIDGE_TEST_ONLY).  PATTERN matches
// "Suite.Name" with '*' and '?' wildcards; a leading '-' excludes.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cc/testing/test.h"

namespace {

bool Glob(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (*p == '*') return Glob(p + 1, s) || (*s != '\0' && Glob(p, s + 1));
  if (*s == '\0') return false;
  return (*p == '?' || *p == *s) && Glob(p + 1, s + 1);
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

bool Selected(const std::string& filter, const std::string& full) {
  if (filter.empty()) return true;
  bool any_positive = false, included = false;
  for (const std::string& pat : Split(filter, ':')) {
    if (pat.empty()) continue;
    if (pat[0] == '-') {
      if (Glob(pat.c_str() + 1, full.c_str())) return false;
    } else {
      any_positive = true;
      // Bazel's --test_filter is often a bare prefix/substring.
      if (Glob(pat.c_str(), full.c_str()) ||
          full.find(pat) != std::string::npos) {
        included = true;
      }
    }
  }
  return included || !any_positive;
}

}  // namespace

int main(int argc, char** argv) {
  namespace t = ::mpistrategy::testing;
  std::string filter;
  if (const char* env = std::getenv("TESTBRIDGE_TEST_ONLY")) filter = env;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strncmp(a, "--filter=", 9) == 0) {
      filter = a + 9;
    } else if (std::strncmp(a, "--gtest_filter=", 15) == 0) {
      filter = a + 15;
    } else if (std::strcmp(a, "--list") == 0) {
      for (const auto& tc : t::Registry())
        std::printf("%s.%s\n", tc.suite.c_str(), tc.name.c_str());
      return 0;
    } else {
      std::fprintf(stderr, "usage: %s [--filter=Suite.Name*] [--list]\n",
                   argv[0]);
      return 2;
    }
  }

  std::vector<std::string> failed;
  int ran = 0;
  const auto t_all = std::chrono::steady_clock::now();
  for (const auto& tc : t::Registry()) {
    const std::string full = tc.suite + "." + tc.name;
    if (!Selected(filter, full)) continue;
    ++ran;
    t::FailureCount().store(0);
    t::FatalFailure().store(false);
    std::printf("[ RUN      ] %s\n", full.c_str());
    std::fflush(stdout);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      tc.body();
    } catch (...) {
      t::Reporter(__FILE__, __LINE__,
                  t::Fail("uncaught exception in " + full + ": " +
                          t::CurrentExceptionMessage()),
                  true) = t::Message();
    }
    const long long ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - t0)
            .count();
    const bool ok = !t::HasFailure();
    std::fflush(stderr);
    std::printf("[ %s ] %s (%lld ms)\n", ok ? "      OK" : " FAILED ",
                full.c_str(), ms);
    std::fflush(stdout);
    if (!ok) failed.push_back(full);
  }
  const long long ms_all =
      std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - t_all)
          .count();

  if (ran == 0) {
    std::printf("[  FAILED  ] no tests ran (%zu registered, filter \"%s\")\n",
                t::Registry().size(), filter.c_str());
    return 1;
  }
  std::printf("[==========] %d tests ran (%lld ms total)\n", ran, ms_all);
  if (failed.empty()) {
    std::printf("[  PASSED  ] %d tests.\n", ran);
    return 0;
  }
  std::printf("[  FAILED  ] %zu of %d tests, listed below:\n", failed.size(),
              ran);
  for (const auto& f : failed) std::printf("[  FAILED  ] %s\n", f.c_str());
  return 1;
}
