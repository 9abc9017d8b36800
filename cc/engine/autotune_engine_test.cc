// Autotune and fusion wait, end to end: N engines over FakeTransport.

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
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

std::string TmpDir() {
  // Bazel gives each test a private directory.
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// A reusable barrier for the test's rank threads.
class ThreadBarrier {
 public:
  explicit ThreadBarrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

EngineConfig FastAutotuneConfig(const std::string& log_path) {
  EngineConfig c;
  c.stall_warning_seconds = 0.0;
  c.autotune = true;
  c.autotune_log = log_path;
  AutotuneSettings& s = c.autotune_settings;
  s.warmup_cycles = 0;
  s.rounds = 1;
  s.min_sample_seconds = 0.01;
  s.min_cycles_per_sample = 2;
  s.fusion_wait_ms = {0.0, 0.2};
  s.fusion_threshold_bytes = {0, 1 << 20, 64 << 20};
  return c;
}

// Submits `count` float allreduces of `elements` values (rank + 1) named
// "<prefix>/i" and waits; returns false if any failed or is wrong.
bool Step(Engine* engine, const std::string& prefix, int count,
          int elements) {
  const int size = engine->size();
  std::vector<std::vector<float>> in(count), out(count);
  std::vector<std::future<Status>> done;
  for (int i = 0; i < count; ++i) {
    in[i].assign(elements, static_cast<float>(engine->rank() + 1));
    out[i].assign(elements, -1.0f);
    TensorEntry e;
    e.type = CollectiveType::kAllreduce;
    e.name = prefix + "/" + std::to_string(i);
    e.dtype = DataType::kFloat32;
    e.shape = {elements};
    e.input = in[i].data();
    e.output = out[i].data();
    auto promise = std::make_shared<std::promise<Status>>();
    done.push_back(promise->get_future());
    e.done = [promise](const Status& s) { promise->set_value(s); };
    engine->Enqueue(std::move(e));
  }
  bool ok = true;
  const float expected = size * (size + 1) / 2.0f;
  for (int i = 0; i < count; ++i) {
    if (done[i].wait_for(std::chrono::seconds(30)) !=
        std::future_status::ready) {
      ADD_FAILURE() << prefix << "/" << i << " did not complete";
      return false;
    }
    Status s = done[i].get();
    if (!s.ok()) {
      ADD_FAILURE() << s.ToString();
      ok = false;
    }
    for (float v : out[i]) {
      if (v != expected) {
        ADD_FAILURE() << prefix << "/" << i << ": got " << v << ", expected "
                      << expected;
        return false;
      }
    }
  }
  return ok;
}

TEST(Autotune, EveryRankSwitchesAlikeAndEndsWithTheSameFinalParameters) {
  const int n = 3;
  const std::string log_path = TmpDir() + "/autotune.csv";
  std::remove(log_path.c_str());
  std::shared_ptr<FakeWorld> world = FakeWorld::Create(n, 0, 30.0);
  std::vector<std::unique_ptr<Engine>> engines(n);
  for (int r = 0; r < n; ++r) {
    Status s = Engine::Create(FastAutotuneConfig(log_path),
                              world->CreateTransport(r), &engines[r]);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  ThreadBarrier barrier(n);
  bool stop = false;
  int steps = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      for (int step = 0; step < 5000; ++step) {
        if (!Step(engines[r].get(), "s" + std::to_string(step), 8, 256)) {
          stop = true;
        }
        barrier.Wait();
        if (r == 0) {
          bool all_final = true;
          for (auto& e : engines) all_final &= e->tuned_parameters().final;
          if (all_final) stop = true;
          steps = step + 1;
        }
        barrier.Wait();
        if (stop) break;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const TunedParameters p0 = engines[0]->tuned_parameters();
  EXPECT_TRUE(p0.final) << "not final after " << steps << " steps";
  for (int r = 1; r < n; ++r) {
    EXPECT_TRUE(engines[r]->tuned_parameters() == p0) << "rank " << r;
  }
  engines.clear();

  std::ifstream log(log_path);
  ASSERT_TRUE(static_cast<bool>(log)) << log_path;
  std::stringstream text;
  text << log.rdbuf();
  EXPECT_NE(text.str().find("phase,fusion_threshold_bytes,fusion_wait_ms"),
            std::string::npos)
      << text.str();
  EXPECT_NE(text.str().find(",final"), std::string::npos) << text.str();
}

TEST(Autotune, UnwritableLogFailsCreateNamingThePath) {
  std::shared_ptr<FakeWorld> world = FakeWorld::Create(1);
  std::unique_ptr<Engine> engine;
  Status s = Engine::Create(FastAutotuneConfig("/nonexistent/dir/a.csv"),
                            world->CreateTransport(0), &engine);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("/nonexistent/dir/a.csv"), std::string::npos)
      << s.message();
}

TEST(Autotune, WithoutAutotuneTheConfiguredParametersAreFinal) {
  std::shared_ptr<FakeWorld> world = FakeWorld::Create(1);
  EngineConfig c;
  c.fusion_threshold_bytes = 12345;
  c.fusion_wait_ms = 0.5;
  std::unique_ptr<Engine> engine;
  ASSERT_TRUE(Engine::Create(c, world->CreateTransport(0), &engine).ok());
  const TunedParameters p = engine->tuned_parameters();
  EXPECT_EQ(p.fusion_threshold_bytes, 12345);
  EXPECT_EQ(p.fusion_wait_ms, 0.5);
  EXPECT_TRUE(p.final);
}

// Two tensors submitted 50 ms apart share one bucket when the engine waits
// 500 ms after the first; they cannot without the wait (the first one is
// negotiated and executed alone while the second is not yet submitted; the
// gap leaves that negotiation time on a loaded machine).
TEST(FusionWait, TensorsArrivingApartShareABucket) {
  for (double wait_ms : {0.0, 500.0}) {
    const int n = 2;
    std::shared_ptr<FakeWorld> world = FakeWorld::Create(n, 0, 30.0);
    EngineConfig c;
    c.stall_warning_seconds = 0.0;
    c.fusion_wait_ms = wait_ms;
    std::vector<std::unique_ptr<Engine>> engines(n);
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(
          Engine::Create(c, world->CreateTransport(r), &engines[r]).ok());
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> a(4, 1.0f), b(4, 1.0f), oa(4), ob(4);
        auto pa = std::make_shared<std::promise<Status>>();
        auto pb = std::make_shared<std::promise<Status>>();
        auto fa = pa->get_future();
        auto fb = pb->get_future();
        TensorEntry e;
        e.name = "a";
        e.shape = {4};
        e.input = a.data();
        e.output = oa.data();
        e.done = [pa](const Status& s) { pa->set_value(s); };
        engines[r]->Enqueue(std::move(e));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        TensorEntry f;
        f.name = "b";
        f.shape = {4};
        f.input = b.data();
        f.output = ob.data();
        f.done = [pb](const Status& s) { pb->set_value(s); };
        engines[r]->Enqueue(std::move(f));
        EXPECT_TRUE(fa.get().ok());
        EXPECT_TRUE(fb.get().ok());
        EXPECT_EQ(oa[0], 2.0f);
        EXPECT_EQ(ob[3], 2.0f);
      });
    }
    for (std::thread& t : threads) t.join();
    const EngineStats stats = engines[0]->stats();
    if (wait_ms > 0) {
      EXPECT_EQ(stats.buckets, 1) << "wait " << wait_ms;
      EXPECT_EQ(stats.fused_buckets, 1) << "wait " << wait_ms;
    } else {
      EXPECT_EQ(stats.buckets, 2) << "wait " << wait_ms;
    }
  }
}

}  // namespace
}  // namespace mpistrategy
