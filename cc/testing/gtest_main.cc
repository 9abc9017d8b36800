// main() for the C++ tests (googletest).  Unlike gtest_main, a binary whose
// filter selects no test fails: "0 tests ran" usually means a typo in
// --gtest_filter (or Bazel's --test_filter), never a pass.
#include <cstdio>

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();
  if (result == 0 && ::testing::UnitTest::GetInstance()->test_to_run_count() == 0) {
    std::fprintf(stderr, "gtest_main: no test ran (check the filter)\n");
    return 1;
  }
  return result;
}
