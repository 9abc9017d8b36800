// Peer timeout end to end: N engines in one process over FakeTransport, one
// of them frozen (FakeWorld::Freeze, which stops its engine and monitor
// threads at their next transport call, as SIGSTOP would).

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine/engine.h"
#include <gtest/gtest.h>
#include "cc/transport/fake_transport.h"

namespace mpistrategy {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

EngineConfig LivenessConfig(double timeout_seconds, double warning_seconds) {
  EngineConfig c;
  c.cycle_time_ms = 1.0;
  c.stall_warning_seconds = warning_seconds;
  c.peer_timeout_seconds = timeout_seconds;
  return c;
}

// One engine per rank, each rank on its own host ("host<r>", pid 1000 + r);
// records what the engines hand to their PeerTimeoutHandler.
struct Cluster {
  Cluster(int n, const EngineConfig& config)
      : world(FakeWorld::Create(n, 1, 30.0)), engines(n), handled(n) {
    for (int r = 0; r < n; ++r) {
      Status s = Engine::Create(config, world->CreateTransport(r), &engines[r],
                                [this, r](const std::string& message) {
                                  std::lock_guard<std::mutex> lock(mu);
                                  handled[r] = message;
                                });
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  ~Cluster() {
    for (int r = 0; r < world->size(); ++r) world->Thaw(r);
    for (auto& e : engines) e.reset();
  }
  std::string Handled(int r) {
    std::lock_guard<std::mutex> lock(mu);
    return handled[r];
  }
  std::shared_ptr<FakeWorld> world;
  std::vector<std::unique_ptr<Engine>> engines;
  std::mutex mu;
  std::vector<std::string> handled;
};

struct Allreduce {
  std::vector<float> in, out;
  std::future<Status> done;
};

// Submits a one-float SUM allreduce `name` of `value` on `engine`.
std::unique_ptr<Allreduce> Submit(Engine* engine, const std::string& name,
                                  float value) {
  auto a = std::make_unique<Allreduce>();
  a->in = {value};
  a->out = {0.0f};
  auto promise = std::make_shared<std::promise<Status>>();
  a->done = promise->get_future();
  TensorEntry e;
  e.type = CollectiveType::kAllreduce;
  e.name = name;
  e.dtype = DataType::kFloat32;
  e.shape = {1};
  e.input = a->in.data();
  e.output = a->out.data();
  e.done = [promise](const Status& s) { promise->set_value(s); };
  engine->Enqueue(std::move(e));
  return a;
}

Status Await(Allreduce* a, double seconds) {
  if (a->done.wait_for(std::chrono::duration<double>(seconds)) !=
      std::future_status::ready) {
    return Status::Internal("test: collective did not complete");
  }
  return a->done.get();
}

// Every rank reduces once, so all engines are up and cycling.
void WarmUp(Cluster* c) {
  std::vector<std::unique_ptr<Allreduce>> all;
  for (size_t r = 0; r < c->engines.size(); ++r) {
    all.push_back(Submit(c->engines[r].get(), "warmup", 1.0f));
  }
  for (auto& a : all) ASSERT_TRUE(Await(a.get(), 20.0).ok());
}

// Redirects stderr (fd 2) to a file while alive; text() reads it so far.
class CaptureStderr {
 public:
  CaptureStderr() : path_("/tmp/liveness_test_stderr." +
                          std::to_string(getpid())) {
    std::fflush(stderr);
    saved_ = dup(2);
    std::FILE* f = std::fopen(path_.c_str(), "w");
    dup2(fileno(f), 2);
    std::fclose(f);
  }
  ~CaptureStderr() {
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    std::fputs(text().c_str(), stderr);  // still visible in the test log
    std::remove(path_.c_str());
  }
  std::string text() const {
    std::fflush(stderr);
    std::ifstream in(path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string path_;
  int saved_ = -1;
};

TEST(Liveness, FrozenRankIsNamedWarnedAboutThenEveryoneElseFails) {
  CaptureStderr captured;
  const double timeout = 1.5;
  Cluster c(3, LivenessConfig(timeout, 0.5));
  WarmUp(&c);
  c.world->Freeze(2);
  const auto start = std::chrono::steady_clock::now();
  auto r0 = Submit(c.engines[0].get(), "x", 1.0f);
  auto r1 = Submit(c.engines[1].get(), "x", 1.0f);
  for (Allreduce* a : {r0.get(), r1.get()}) {
    Status s = Await(a, 20.0);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "collective \"x\" failed: peer timeout"))
        << s.message();
    EXPECT_TRUE(Contains(s.message(), "rank 2 (host host2, pid 1002)"))
        << s.message();
    EXPECT_TRUE(Contains(s.message(), "peer_timeout_seconds = 1.5"))
        << s.message();
  }
  const double waited = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - start)
                            .count();
  EXPECT_GE(waited, timeout - 0.3);
  EXPECT_LT(waited, timeout + 3.0);
  // Rank 1 heard it from rank 0, which names itself.
  Status later = Await(Submit(c.engines[1].get(), "later", 1.0f).get(), 5.0);
  EXPECT_EQ(later.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(later.message(), "reported by rank 0 (host host0, "
                                        "pid 1000)"))
      << later.message();
  // The embedding's handler ends the job on every reachable rank.
  for (int r : {0, 1}) {
    for (int i = 0; i < 300 && c.Handled(r).empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(Contains(c.Handled(r), "rank 2 (host host2, pid 1002)"))
        << "rank " << r << ": " << c.Handled(r);
  }
  EXPECT_EQ(c.Handled(2), "");
  // Stderr: first the warning after 0.5 s, then the timeout.
  const std::string log = captured.text();
  const size_t warning = log.find(
      "no message from rank 2 (host host2, pid 1002) for 0.");
  const size_t timed_out =
      log.find("peer timeout: no message from rank 2 (host host2, pid 1002)");
  EXPECT_TRUE(warning != std::string::npos) << log;
  EXPECT_TRUE(timed_out != std::string::npos) << log;
  EXPECT_LT(warning, timed_out);
  EXPECT_TRUE(Contains(log, "[mpistrategy rank 0 (host host0, pid 1000)]"))
      << log;
}

TEST(Liveness, FrozenCoordinatorStopsTheOthersByThemselves) {
  Cluster c(3, LivenessConfig(1.0, 0.0));
  WarmUp(&c);
  c.world->Freeze(0);
  auto r1 = Submit(c.engines[1].get(), "y", 1.0f);
  auto r2 = Submit(c.engines[2].get(), "y", 1.0f);
  for (Allreduce* a : {r1.get(), r2.get()}) {
    Status s = Await(a, 20.0);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "no message from rank 0 (host host0, "
                                      "pid 1000), the coordinator,"))
        << s.message();
  }
}

TEST(Liveness, RankFrozenForLessThanTheDeadlineResumes) {
  const double timeout = 2.0;
  Cluster c(3, LivenessConfig(timeout, 0.3));
  WarmUp(&c);
  c.world->Freeze(1);
  auto r0 = Submit(c.engines[0].get(), "z", 1.0f);
  auto r2 = Submit(c.engines[2].get(), "z", 3.0f);
  std::this_thread::sleep_for(std::chrono::duration<double>(timeout * 0.6));
  EXPECT_EQ(r0->done.wait_for(std::chrono::seconds(0)),
            std::future_status::timeout);
  c.world->Thaw(1);
  auto r1 = Submit(c.engines[1].get(), "z", 5.0f);
  for (Allreduce* a : {r0.get(), r1.get(), r2.get()}) {
    Status s = Await(a, 20.0);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(a->out[0], 9.0f);
  }
  // Well past the deadline: nobody gave up, and everything still works.
  std::this_thread::sleep_for(std::chrono::duration<double>(timeout + 0.5));
  std::vector<std::unique_ptr<Allreduce>> again;
  for (int r = 0; r < 3; ++r) {
    again.push_back(Submit(c.engines[r].get(), "again", 2.0f));
  }
  for (auto& a : again) {
    Status s = Await(a.get(), 20.0);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(a->out[0], 6.0f);
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(c.Handled(r), "");
    EXPECT_FALSE(c.engines[r]->stopped());
  }
}

TEST(Liveness, ZeroDisablesTheDeadline) {
  Cluster c(2, LivenessConfig(0.0, 0.0));
  WarmUp(&c);
  c.world->Freeze(1);
  auto r0 = Submit(c.engines[0].get(), "w", 1.0f);
  // Waits (no monitor) until the frozen rank is back.
  EXPECT_EQ(r0->done.wait_for(std::chrono::milliseconds(1500)),
            std::future_status::timeout);
  c.world->Thaw(1);
  auto r1 = Submit(c.engines[1].get(), "w", 1.0f);
  ASSERT_TRUE(Await(r0.get(), 20.0).ok());
  ASSERT_TRUE(Await(r1.get(), 20.0).ok());
  EXPECT_EQ(r0->out[0], 2.0f);
}

TEST(Liveness, ConfigValidation) {
  EngineConfig config;
  config.peer_timeout_seconds = -1;
  EXPECT_TRUE(Contains(config.Validate().message(), "peer_timeout_seconds"));
  config.peer_timeout_seconds = 1.0 / 0.0;
  EXPECT_TRUE(Contains(config.Validate().message(), "peer_timeout_seconds"));
  config.peer_timeout_seconds = 0;
  EXPECT_TRUE(config.Validate().ok());
}

}  // namespace
}  // namespace mpistrategy
