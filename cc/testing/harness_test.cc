// Self-test of cc/testing/test.h: only passing checks here (the failure
// paths are exercised by tests/single/test_build.py::test_cc_harness_reports_failures
// with a scratch binary, see there).
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cc/testing/test.h"

namespace {

enum class Color { kRed = 1, kBlue = 2 };

int Twice(int x) { return 2 * x; }

void AssertPositive(int x, bool* reached_end) {
  ASSERT_GT(x, 0);
  *reached_end = true;
}

TEST(Harness, Comparisons) {
  EXPECT_EQ(Twice(2), 4);
  EXPECT_NE(Twice(2), 5);
  EXPECT_LT(1, 2);
  EXPECT_LE(2, 2);
  EXPECT_GT(3u, 2);  // mixed signedness compiles without -Wsign-compare noise
  EXPECT_GE((std::vector<int>{1, 2}.size()), 2);  // comma: parenthesize
  EXPECT_TRUE(true) << "message " << 1;
  EXPECT_FALSE(false);
  EXPECT_NEAR(0.1 + 0.2, 0.3, 1e-12);
  EXPECT_STREQ("abc", std::string("abc").c_str());
  EXPECT_STRNE("abc", "abd");
  EXPECT_EQ(std::string("x"), "x");
  EXPECT_EQ(Color::kRed, Color::kRed);
  EXPECT_EQ((std::vector<int>{1, 2, 3}), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ((std::map<int, int>{{1, 2}}).size(), 1u);
  EXPECT_EQ(nullptr, static_cast<int*>(nullptr));
  ASSERT_EQ(1, 1);
}

TEST(Harness, Exceptions) {
  EXPECT_THROW(throw std::invalid_argument("x"), std::invalid_argument);
  EXPECT_ANY_THROW(throw 1);
  EXPECT_NO_THROW(Twice(1));
  ASSERT_THROW(throw std::runtime_error("y"), std::exception);
}

TEST(Harness, AssertReturnsFromHelper) {
  bool reached = false;
  AssertPositive(1, &reached);
  EXPECT_TRUE(reached);
}

TEST(Harness, Printing) {
  namespace t = ::mpistrategy::testing;
  EXPECT_EQ(t::Print(true), "true");
  EXPECT_EQ(t::Print(Color::kBlue), "2");
  EXPECT_EQ(t::Print(std::vector<int>{1, 2}), "{1, 2}");
  EXPECT_EQ(t::Print(std::string("s")), "\"s\"");
  EXPECT_EQ(t::Print('a'), "97 ('a')");
  EXPECT_FALSE(t::CmpEQ("a", "b", 1, 2).ok);
  EXPECT_EQ(t::CmpEQ("a", "b", 1, 2).what,
            "Expected: (a) == (b), actual:\n  a = 1\n  b = 2");
}

TEST(Harness, DanglingElseIsUnambiguous) {
  int x = 1;
  if (x == 1)
    EXPECT_EQ(x, 1);
  else
    ADD_FAILURE() << "wrong branch";
}

TEST(Harness, ThreadSafe) {
  std::vector<std::thread> ts;
  for (int i = 0; i < 4; ++i) {
    ts.emplace_back([i] {
      for (int j = 0; j < 1000; ++j) EXPECT_EQ(Twice(i), i + i);
    });
  }
  for (auto& t : ts) t.join();
}

class Fixture : public ::testing::Test {
 protected:
  void SetUp() override { value_ = 42; }
  void TearDown() override { value_ = 0; }
  int value_ = 0;
};

TEST_F(Fixture, SetUpRuns) { EXPECT_EQ(value_, 42); }

}  // namespace
