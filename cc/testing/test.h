// Tiny header-only unit-test harness (a gtest-like subset; gtest is not
// available offline).  Link your cc_test with //cc/testing:test_main.
//
//   #include "cc/testing/test.h"
//
//   TEST(Fusion, PacksUpToThreshold) {
//     auto buckets = Fuse(...);
//     ASSERT_EQ(buckets.size(), 2u);            // on failure: return from test
//     EXPECT_EQ(buckets[0].bytes, 64) << "bucket 0";   // on failure: continue
//     EXPECT_TRUE(buckets[1].single);
//     EXPECT_NEAR(x, 0.5, 1e-6);
//     EXPECT_THROW(Parse(""), std::invalid_argument);
//   }
//
//   class EngineTest : public ::testing::Test {      // fixtures
//    protected:
//     void SetUp() override { ... }
//     void TearDown() override { ... }
//   };
//   TEST_F(EngineTest, Shutdown) { ... }
//
// Macros: TEST, TEST_F, {EXPECT,ASSERT}_{TRUE,FALSE,EQ,NE,LT,LE,GT,GE,NEAR,
// STREQ,STRNE,THROW,ANY_THROW,NO_THROW}, ADD_FAILURE(), FAIL(), SUCCEED().
// Every failure prints "file:line: Failure" with the expression and the
// values.  EXPECT_*/ASSERT_* are thread-safe (may be used from helper
// threads; ASSERT_* returns from the enclosing void function).
// The binary's main() (test_main.cc) runs all tests in registration order
// and exits non-zero if any failed, or if no test ran.  Filter with
// `bazel test --test_filter=Suite.Name*` or `./x_test --filter=Suite.*`.
#ifndef MPISTRATEGY_CC_TESTING_TEST_H_
#define MPISTRATEGY_CC_TESTING_TEST_H_

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpistrategy {
namespace testing {

// ------------------------------------------------------------- registry
struct TestCase {
  std::string suite;
  std::string name;
  std::function<void()> body;
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase>* r = new std::vector<TestCase>;
  return *r;
}

struct Registrar {
  Registrar(const char* suite, const char* name, std::function<void()> body) {
    Registry().push_back({suite, name, std::move(body)});
  }
};

// Per-test state (reset by the runner before each test).
inline std::atomic<int>& FailureCount() {
  static std::atomic<int> n{0};
  return n;
}
inline std::atomic<bool>& FatalFailure() {
  static std::atomic<bool> f{false};
  return f;
}
inline std::mutex& OutputMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

inline bool HasFailure() { return FailureCount().load() > 0; }
inline bool HasFatalFailure() { return FatalFailure().load(); }

// ------------------------------------------------------------- printing
template <typename T, typename = void>
struct IsStreamable : std::false_type {};
template <typename T>
struct IsStreamable<T, std::void_t<decltype(std::declval<std::ostream&>()
                                            << std::declval<const T&>())>>
    : std::true_type {};

template <typename T, typename = void>
struct IsContainer : std::false_type {};
template <typename T>
struct IsContainer<T, std::void_t<decltype(std::begin(std::declval<const T&>())),
                                  decltype(std::end(std::declval<const T&>()))>>
    : std::true_type {};

template <typename T>
std::string Print(const T& v);

template <typename T>
void PrintTo(std::ostream& os, const T& v) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, bool>) {
    os << (v ? "true" : "false");
  } else if constexpr (std::is_same_v<D, std::nullptr_t>) {
    os << "nullptr";
  } else if constexpr (std::is_same_v<D, char> ||
                       std::is_same_v<D, signed char> ||
                       std::is_same_v<D, unsigned char>) {
    os << static_cast<int>(v);
    if (v >= 32 && v < 127) os << " ('" << static_cast<char>(v) << "')";
  } else if constexpr (std::is_same_v<D, const char*> ||
                       std::is_same_v<D, char*>) {
    const char* p = v;  // may be an array: compare the decayed pointer
    if (p == nullptr) {
      os << "nullptr";
    } else {
      os << '"' << p << '"';
    }
  } else if constexpr (std::is_same_v<D, std::string> ||
                       std::is_same_v<D, std::string_view>) {
    os << '"' << v << '"';
  } else if constexpr (std::is_pointer_v<D>) {
    os << static_cast<const void*>(v);
  } else if constexpr (IsStreamable<D>::value) {
    os << v;
  } else if constexpr (std::is_enum_v<D>) {
    os << static_cast<long long>(static_cast<std::underlying_type_t<D>>(v));
  } else if constexpr (IsContainer<D>::value) {
    os << '{';
    size_t i = 0;
    for (const auto& e : v) {
      if (i) os << ", ";
      if (i == 32) {
        os << "...";
        break;
      }
      PrintTo(os, e);
      ++i;
    }
    os << '}';
  } else {
    os << '<' << sizeof(D) << "-byte object>";
  }
}

template <typename T>
std::string Print(const T& v) {
  std::ostringstream os;
  PrintTo(os, v);
  return os.str();
}

// --------------------------------------------------------------- results
struct Result {
  bool ok = true;
  std::string what;  // description of the failure (without location)
  explicit operator bool() const { return ok; }
};

inline Result Ok() { return Result{}; }
inline Result Fail(std::string what) { return Result{false, std::move(what)}; }

// Extra text streamed after a macro:  EXPECT_EQ(a, b) << "context " << i;
class Message {
 public:
  Message() = default;
  Message(const Message& o) { os_ << o.os_.str(); }
  template <typename T>
  Message& operator<<(const T& v) {
    if constexpr (IsStreamable<T>::value) {
      os_ << v;  // messages print streamable values (strings, chars) raw
    } else {
      PrintTo(os_, v);
    }
    return *this;
  }
  Message& operator<<(std::ostream& (*manip)(std::ostream&)) {
    os_ << manip;
    return *this;
  }
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

class Reporter {
 public:
  Reporter(const char* file, int line, Result r, bool fatal)
      : file_(file), line_(line), r_(std::move(r)), fatal_(fatal) {}
  // Assigning the (possibly empty) message reports the failure.  Returns
  // void so that `return Reporter(...) = Message() << ...;` works in void
  // functions (ASSERT_*).
  void operator=(const Message& m) const {
    FailureCount().fetch_add(1);
    if (fatal_) FatalFailure().store(true);
    std::string extra = m.str();
    std::lock_guard<std::mutex> l(OutputMutex());
    std::fprintf(stderr, "%s:%d: Failure\n%s%s%s\n", file_, line_,
                 r_.what.c_str(), extra.empty() ? "" : "\n  ",
                 extra.c_str());
    std::fflush(stderr);
  }

 private:
  const char* file_;
  int line_;
  Result r_;
  bool fatal_;
};

// ------------------------------------------------------------ predicates
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#endif

#define MPISTRATEGY_TESTING_DEFINE_CMP_(fn, op)                              \
  template <typename A, typename B>                                         \
  Result fn(const char* ea, const char* eb, const A& a, const B& b) {        \
    if (a op b) return Ok();                                                 \
    return Fail(std::string("Expected: (") + ea + ") " #op " (" + eb +      \
                "), actual:\n  " + ea + " = " + Print(a) + "\n  " + eb +    \
                " = " + Print(b));                                           \
  }
MPISTRATEGY_TESTING_DEFINE_CMP_(CmpEQ, ==)
MPISTRATEGY_TESTING_DEFINE_CMP_(CmpNE, !=)
MPISTRATEGY_TESTING_DEFINE_CMP_(CmpLT, <)
MPISTRATEGY_TESTING_DEFINE_CMP_(CmpLE, <=)
MPISTRATEGY_TESTING_DEFINE_CMP_(CmpGT, >)
MPISTRATEGY_TESTING_DEFINE_CMP_(CmpGE, >=)
#undef MPISTRATEGY_TESTING_DEFINE_CMP_

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

template <typename T>
Result CmpBool(const char* expr, const T& value, bool expected) {
  if (static_cast<bool>(value) == expected) return Ok();
  return Fail(std::string("Value of: ") + expr + "\n  Actual: " +
              (expected ? "false" : "true") + "\nExpected: " +
              (expected ? "true" : "false"));
}

inline Result CmpNear(const char* ea, const char* eb, const char* et,
                      double a, double b, double tol) {
  double diff = std::fabs(a - b);
  if (diff <= tol) return Ok();
  std::ostringstream os;
  os.precision(17);
  os << "The difference between " << ea << " and " << eb << " is " << diff
     << ", which exceeds " << et << ", where\n  " << ea << " = " << a
     << "\n  " << eb << " = " << b << "\n  " << et << " = " << tol;
  return Fail(os.str());
}

inline Result CmpStr(const char* ea, const char* eb, const char* a,
                     const char* b, bool want_equal) {
  bool eq = (a == nullptr || b == nullptr) ? a == b : std::strcmp(a, b) == 0;
  if (eq == want_equal) return Ok();
  return Fail(std::string("Expected: ") + ea + (want_equal ? " == " : " != ") +
              eb + " (C strings), actual:\n  " + ea + " = " + Print(a) +
              "\n  " + eb + " = " + Print(b));
}

// ----------------------------------------------------------------- fixtures
class Test {
 public:
  virtual ~Test() = default;
  virtual void SetUp() {}
  virtual void TearDown() {}
};

template <typename T>
void RunFixture() {
  T t;
  Test& base = t;  // SetUp/TearDown are usually protected in the fixture
  base.SetUp();
  if (!HasFatalFailure()) t.TestBody();
  base.TearDown();
}

// Inside a catch block: describes the exception being handled.
inline std::string CurrentExceptionMessage() {
  try {
    throw;
  } catch (const std::exception& e) {
    return std::string("std::exception: ") + e.what();
  } catch (...) {
    return "a non-std::exception";
  }
}

}  // namespace testing
}  // namespace mpistrategy

// gtest spelling for fixtures:  class FooTest : public ::testing::Test {...};
namespace testing {
using Test = ::mpistrategy::testing::Test;
}  // namespace testing

// ------------------------------------------------------------------ macros
#define MPISTRATEGY_TESTING_CAT_(a, b) a##b
#define MPISTRATEGY_TESTING_FN_(suite, name) \
  MPISTRATEGY_TESTING_CAT_(suite##_##name, _Test)

#define TEST(suite, name)                                                     \
  static void MPISTRATEGY_TESTING_FN_(suite, name)();                         \
  static ::mpistrategy::testing::Registrar MPISTRATEGY_TESTING_CAT_(          \
      suite##_##name, _registrar)(#suite, #name,                              \
                                  &MPISTRATEGY_TESTING_FN_(suite, name));     \
  static void MPISTRATEGY_TESTING_FN_(suite, name)()

#define TEST_F(fixture, name)                                                 \
  class MPISTRATEGY_TESTING_FN_(fixture, name) : public fixture {             \
   public:                                                                    \
    void TestBody();                                                          \
  };                                                                          \
  static ::mpistrategy::testing::Registrar MPISTRATEGY_TESTING_CAT_(          \
      fixture##_##name, _registrar)(                                          \
      #fixture, #name,                                                        \
      &::mpistrategy::testing::RunFixture<MPISTRATEGY_TESTING_FN_(fixture,    \
                                                                  name)>);    \
  void MPISTRATEGY_TESTING_FN_(fixture, name)::TestBody()

// `switch (0) case 0: default:` keeps `if (x) EXPECT_..(); else ...` unambiguous.
#define MPISTRATEGY_TESTING_CHECK_(result_expr, on_failure)                   \
  switch (0)                                                                  \
  case 0:                                                                     \
  default:                                                                    \
    if (const ::mpistrategy::testing::Result mpistrategy_testing_r_ =         \
            (result_expr))                                                    \
      ;                                                                       \
    else                                                                      \
      on_failure ::mpistrategy::testing::Reporter(                            \
          __FILE__, __LINE__, mpistrategy_testing_r_, #on_failure[0] != 0) =  \
          ::mpistrategy::testing::Message()

#define MPISTRATEGY_TESTING_EXPECT_(r) MPISTRATEGY_TESTING_CHECK_(r, )
#define MPISTRATEGY_TESTING_ASSERT_(r) MPISTRATEGY_TESTING_CHECK_(r, return)

#define EXPECT_TRUE(c) \
  MPISTRATEGY_TESTING_EXPECT_(::mpistrategy::testing::CmpBool(#c, (c), true))
#define EXPECT_FALSE(c) \
  MPISTRATEGY_TESTING_EXPECT_(::mpistrategy::testing::CmpBool(#c, (c), false))
#define ASSERT_TRUE(c) \
  MPISTRATEGY_TESTING_ASSERT_(::mpistrategy::testing::CmpBool(#c, (c), true))
#define ASSERT_FALSE(c) \
  MPISTRATEGY_TESTING_ASSERT_(::mpistrategy::testing::CmpBool(#c, (c), false))

#define MPISTRATEGY_TESTING_CMP_(kind, fn, a, b) \
  MPISTRATEGY_TESTING_##kind##_(::mpistrategy::testing::fn(#a, #b, (a), (b)))
#define EXPECT_EQ(a, b) MPISTRATEGY_TESTING_CMP_(EXPECT, CmpEQ, a, b)
#define EXPECT_NE(a, b) MPISTRATEGY_TESTING_CMP_(EXPECT, CmpNE, a, b)
#define EXPECT_LT(a, b) MPISTRATEGY_TESTING_CMP_(EXPECT, CmpLT, a, b)
#define EXPECT_LE(a, b) MPISTRATEGY_TESTING_CMP_(EXPECT, CmpLE, a, b)
#define EXPECT_GT(a, b) MPISTRATEGY_TESTING_CMP_(EXPECT, CmpGT, a, b)
#define EXPECT_GE(a, b) MPISTRATEGY_TESTING_CMP_(EXPECT, CmpGE, a, b)
#define ASSERT_EQ(a, b) MPISTRATEGY_TESTING_CMP_(ASSERT, CmpEQ, a, b)
#define ASSERT_NE(a, b) MPISTRATEGY_TESTING_CMP_(ASSERT, CmpNE, a, b)
#define ASSERT_LT(a, b) MPISTRATEGY_TESTING_CMP_(ASSERT, CmpLT, a, b)
#define ASSERT_LE(a, b) MPISTRATEGY_TESTING_CMP_(ASSERT, CmpLE, a, b)
#define ASSERT_GT(a, b) MPISTRATEGY_TESTING_CMP_(ASSERT, CmpGT, a, b)
#define ASSERT_GE(a, b) MPISTRATEGY_TESTING_CMP_(ASSERT, CmpGE, a, b)

#define EXPECT_NEAR(a, b, tol)                                         \
  MPISTRATEGY_TESTING_EXPECT_(::mpistrategy::testing::CmpNear(         \
      #a, #b, #tol, static_cast<double>(a), static_cast<double>(b),    \
      static_cast<double>(tol)))
#define ASSERT_NEAR(a, b, tol)                                         \
  MPISTRATEGY_TESTING_ASSERT_(::mpistrategy::testing::CmpNear(         \
      #a, #b, #tol, static_cast<double>(a), static_cast<double>(b),    \
      static_cast<double>(tol)))

#define EXPECT_STREQ(a, b) \
  MPISTRATEGY_TESTING_EXPECT_(::mpistrategy::testing::CmpStr(#a, #b, a, b, true))
#define EXPECT_STRNE(a, b) \
  MPISTRATEGY_TESTING_EXPECT_(::mpistrategy::testing::CmpStr(#a, #b, a, b, false))
#define ASSERT_STREQ(a, b) \
  MPISTRATEGY_TESTING_ASSERT_(::mpistrategy::testing::CmpStr(#a, #b, a, b, true))
#define ASSERT_STRNE(a, b) \
  MPISTRATEGY_TESTING_ASSERT_(::mpistrategy::testing::CmpStr(#a, #b, a, b, false))

// Exceptions: evaluates to a Result via an immediately invoked lambda.
#define MPISTRATEGY_TESTING_THROW_RESULT_(stmt, exc)                        \
  ([&]() -> ::mpistrategy::testing::Result {                                \
    try {                                                                   \
      stmt;                                                                 \
    } catch (const exc&) {                                                  \
      return ::mpistrategy::testing::Ok();                                  \
    } catch (...) {                                                         \
      return ::mpistrategy::testing::Fail(                                  \
          "Expected: " #stmt " throws " #exc                                \
          ".\n  Actual: it throws a different type: " +                    \
          ::mpistrategy::testing::CurrentExceptionMessage());               \
    }                                                                       \
    return ::mpistrategy::testing::Fail(                                    \
        "Expected: " #stmt " throws " #exc ".\n  Actual: it throws nothing."); \
  }())
#define MPISTRATEGY_TESTING_ANY_THROW_RESULT_(stmt)                         \
  ([&]() -> ::mpistrategy::testing::Result {                                \
    try {                                                                   \
      stmt;                                                                 \
    } catch (...) {                                                         \
      return ::mpistrategy::testing::Ok();                                  \
    }                                                                       \
    return ::mpistrategy::testing::Fail(                                    \
        "Expected: " #stmt " throws.\n  Actual: it throws nothing.");       \
  }())
#define MPISTRATEGY_TESTING_NO_THROW_RESULT_(stmt)                          \
  ([&]() -> ::mpistrategy::testing::Result {                                \
    try {                                                                   \
      stmt;                                                                 \
    } catch (...) {                                                         \
      return ::mpistrategy::testing::Fail(                                  \
          "Expected: " #stmt " does not throw.\n  Actual: it throws " +    \
          ::mpistrategy::testing::CurrentExceptionMessage());               \
    }                                                                       \
    return ::mpistrategy::testing::Ok();                                    \
  }())
#define EXPECT_THROW(stmt, exc) \
  MPISTRATEGY_TESTING_EXPECT_(MPISTRATEGY_TESTING_THROW_RESULT_(stmt, exc))
#define ASSERT_THROW(stmt, exc) \
  MPISTRATEGY_TESTING_ASSERT_(MPISTRATEGY_TESTING_THROW_RESULT_(stmt, exc))
#define EXPECT_ANY_THROW(stmt) \
  MPISTRATEGY_TESTING_EXPECT_(MPISTRATEGY_TESTING_ANY_THROW_RESULT_(stmt))
#define ASSERT_ANY_THROW(stmt) \
  MPISTRATEGY_TESTING_ASSERT_(MPISTRATEGY_TESTING_ANY_THROW_RESULT_(stmt))
#define EXPECT_NO_THROW(stmt) \
  MPISTRATEGY_TESTING_EXPECT_(MPISTRATEGY_TESTING_NO_THROW_RESULT_(stmt))
#define ASSERT_NO_THROW(stmt) \
  MPISTRATEGY_TESTING_ASSERT_(MPISTRATEGY_TESTING_NO_THROW_RESULT_(stmt))

#define ADD_FAILURE() \
  MPISTRATEGY_TESTING_EXPECT_(::mpistrategy::testing::Fail("Failed"))
#define FAIL() MPISTRATEGY_TESTING_ASSERT_(::mpistrategy::testing::Fail("Failed"))
#define SUCCEED() static_cast<void>(0)

#endif  // MPISTRATEGY_CC_TESTING_TEST_H_
