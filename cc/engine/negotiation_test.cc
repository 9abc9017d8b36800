// End-to-end tests of the engine: N Engine objects in one process, one per
// thread, talking through FakeTransport.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cc/engine/engine.h"
#include "cc/common/float16.h"
#include "cc/engine/negotiator.h"
#include <gtest/gtest.h>
#include "cc/transport/fake_transport.h"

namespace mpistrategy {
namespace {

// ---- helpers ------------------------------------------------------------

EngineConfig TestConfig() {
  EngineConfig c;
  c.cycle_time_ms = 1.0;
  c.stall_warning_seconds = 0.0;
  return c;
}

struct Cluster {
  Cluster(int n, const EngineConfig& config = TestConfig())
      : world(FakeWorld::Create(n, 0, 30.0)), engines(n) {
    for (int r = 0; r < n; ++r) {
      Status s = Engine::Create(config, world->CreateTransport(r), &engines[r]);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  int size() const { return static_cast<int>(engines.size()); }
  std::shared_ptr<FakeWorld> world;
  std::vector<std::unique_ptr<Engine>> engines;
};

// Runs fn(rank) on one thread per rank and joins them.
template <typename Fn>
void OnEveryRank(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

// Enqueues `entry` and returns a future for its status.
std::future<Status> Submit(Engine* engine, TensorEntry entry) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  entry.done = [promise](const Status& s) { promise->set_value(s); };
  engine->Enqueue(std::move(entry));
  return future;
}

Status Await(std::future<Status>* f, double seconds = 30.0) {
  if (f->wait_for(std::chrono::duration<double>(seconds)) !=
      std::future_status::ready) {
    return Status::Internal("test: collective did not complete");
  }
  return f->get();
}

// Typed buffers through doubles.
double Get(DataType dtype, const std::vector<char>& buf, int64_t i) {
  const char* p = buf.data();
  switch (dtype) {
    case DataType::kUint8: return reinterpret_cast<const uint8_t*>(p)[i];
    case DataType::kInt8: return reinterpret_cast<const int8_t*>(p)[i];
    case DataType::kBool: return reinterpret_cast<const uint8_t*>(p)[i];
    case DataType::kInt32: return reinterpret_cast<const int32_t*>(p)[i];
    case DataType::kInt64:
      return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    case DataType::kFloat16:
      return HalfToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DataType::kBFloat16:
      return BFloat16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DataType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DataType::kFloat64: return reinterpret_cast<const double*>(p)[i];
  }
  return 0;
}

void Set(DataType dtype, std::vector<char>* buf, int64_t i, double v) {
  char* p = buf->data();
  switch (dtype) {
    case DataType::kUint8: reinterpret_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DataType::kInt8: reinterpret_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DataType::kBool: reinterpret_cast<uint8_t*>(p)[i] = v != 0; break;
    case DataType::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DataType::kInt64: reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DataType::kFloat16:
      reinterpret_cast<uint16_t*>(p)[i] = FloatToHalf(static_cast<float>(v)); break;
    case DataType::kBFloat16:
      reinterpret_cast<uint16_t*>(p)[i] = FloatToBFloat16(static_cast<float>(v)); break;
    case DataType::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DataType::kFloat64: reinterpret_cast<double*>(p)[i] = v; break;
  }
}

std::vector<char> Buffer(DataType dtype, int64_t n) {
  return std::vector<char>(static_cast<size_t>(n * DataTypeSize(dtype)) + 1);
}

TensorEntry AllreduceEntry(const std::string& name, DataType dtype,
                           const Shape& shape, const std::vector<char>& in,
                           std::vector<char>* out,
                           ReduceOp op = ReduceOp::kSum) {
  TensorEntry e;
  e.type = CollectiveType::kAllreduce;
  e.name = name;
  e.dtype = dtype;
  e.shape = shape;
  e.reduce_op = op;
  e.input = in.data();
  e.output = out->data();
  return e;
}

// Output holder for collectives that allocate after negotiation.
struct Allocated {
  Shape shape;
  std::vector<char> data;
  std::vector<int64_t> received_splits;
};

void AttachAllocator(TensorEntry* e, Allocated* a) {
  const DataType dtype = e->dtype;
  e->allocate_output = [a, dtype](const Shape& shape, void** data) {
    a->shape = shape;
    a->data.assign(static_cast<size_t>(NumElements(shape) * DataTypeSize(dtype)) + 1, 0);
    *data = a->data.data();
    return Status::Ok();
  };
  e->set_received_splits = [a](const std::vector<int64_t>& s) {
    a->received_splits = s;
  };
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Awaits `f`, expects it to fail with `code` and a message containing
// `text`; returns its status.
Status ExpectFailure(std::future<Status>* f, StatusCode code,
                     const std::string& text) {
  Status s = Await(f);
  EXPECT_EQ(s.code(), code) << s.message();
  EXPECT_TRUE(Contains(s.message(), text)) << s.message();
  return s;
}

const DataType kAllTypes[] = {
    DataType::kUint8,   DataType::kInt8,     DataType::kBool,
    DataType::kInt32,   DataType::kInt64,    DataType::kFloat16,
    DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};

// ---- tests --------------------------------------------------------------

TEST(Negotiation, AllreduceEveryDtypeAndOp) {
  const int n = 3;
  const int64_t count = 37;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    for (DataType dtype : kAllTypes) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMin,
                          ReduceOp::kMax, ReduceOp::kProduct}) {
        if (op == ReduceOp::kMean && !IsFloatingDataType(dtype)) continue;
        std::vector<char> in = Buffer(dtype, count);
        std::vector<char> out = Buffer(dtype, count);
        for (int64_t i = 0; i < count; ++i) {
          double v = (rank + 1) * (i % 5 + 1);
          if (op == ReduceOp::kProduct) v = rank + 1;
          if (dtype == DataType::kBool) {
            v = (op == ReduceOp::kSum || op == ReduceOp::kMax)
                    ? (i % 4 == rank)
                    : (i % 4 != rank);
          }
          Set(dtype, &in, i, v);
        }
        const std::string name =
            std::string(DataTypeName(dtype)) + "/" + ReduceOpName(op);
        auto f = Submit(c.engines[rank].get(),
                        AllreduceEntry(name, dtype, {count}, in, &out, op));
        Status s = Await(&f);
        ASSERT_TRUE(s.ok()) << name << ": " << s.ToString();
        for (int64_t i = 0; i < count; ++i) {
          const double k = i % 5 + 1;
          double want = 0;
          switch (op) {
            case ReduceOp::kSum: want = 6 * k; break;
            case ReduceOp::kMean: want = 2 * k; break;
            case ReduceOp::kMin: want = k; break;
            case ReduceOp::kMax: want = 3 * k; break;
            case ReduceOp::kProduct: want = 6; break;
          }
          if (dtype == DataType::kBool) {
            want = (op == ReduceOp::kSum || op == ReduceOp::kMax)
                       ? (i % 4 < 3)
                       : (i % 4 == 3);
          }
          ASSERT_EQ(Get(dtype, out, i), want) << name << " element " << i;
        }
      }
    }
  });
}

TEST(Negotiation, ShuffledOrdersNeverMispair) {
  const int n = 3;
  const int kTensors = 50;
  const int kIterations = 4;
  EngineConfig config = TestConfig();
  config.fusion_threshold_bytes = 4096;
  Cluster c(n, config);
  OnEveryRank(n, [&](int rank) {
    std::mt19937 rng(1234 + rank);
    for (int it = 0; it < kIterations; ++it) {
      std::vector<int> order(kTensors);
      for (int t = 0; t < kTensors; ++t) order[t] = t;
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<std::vector<char>> ins(kTensors), outs(kTensors);
      std::vector<std::future<Status>> futures(kTensors);
      for (int t : order) {
        const int64_t count = 1 + (t * 7) % 23;
        const DataType dtype = t % 2 ? DataType::kFloat32 : DataType::kInt64;
        ins[t] = Buffer(dtype, count);
        outs[t] = Buffer(dtype, count);
        for (int64_t i = 0; i < count; ++i) {
          Set(dtype, &ins[t], i, 1000 * t + i + rank);
        }
        futures[t] = Submit(c.engines[rank].get(),
                            AllreduceEntry("grad/" + std::to_string(t), dtype,
                                           {count}, ins[t], &outs[t]));
        if (t % 10 == rank) std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
      for (int t = 0; t < kTensors; ++t) {
        Status s = Await(&futures[t]);
        ASSERT_TRUE(s.ok()) << s.ToString();
        const int64_t count = 1 + (t * 7) % 23;
        const DataType dtype = t % 2 ? DataType::kFloat32 : DataType::kInt64;
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(Get(dtype, outs[t], i), n * (1000.0 * t + i) + 3)
              << "tensor " << t << " element " << i;
        }
      }
    }
  });
  EXPECT_GT(c.engines[0]->stats().fast_responses, 0);
}

TEST(Negotiation, FastPathInSteadyState) {
  const int n = 2;
  Cluster c(n);
  std::vector<int64_t> slow_after_first(n);
  OnEveryRank(n, [&](int rank) {
    for (int it = 0; it < 30; ++it) {
      std::vector<std::vector<char>> ins(5), outs(5);
      std::vector<std::future<Status>> fs;
      for (int t = 0; t < 5; ++t) {
        ins[t] = Buffer(DataType::kFloat32, 8);
        outs[t] = Buffer(DataType::kFloat32, 8);
        for (int i = 0; i < 8; ++i) Set(DataType::kFloat32, &ins[t], i, rank + it);
        fs.push_back(Submit(c.engines[rank].get(),
                            AllreduceEntry("w" + std::to_string(t),
                                           DataType::kFloat32, {8}, ins[t],
                                           &outs[t])));
      }
      for (int t = 0; t < 5; ++t) {
        Status s = Await(&fs[t]);
        ASSERT_TRUE(s.ok()) << s.ToString();
        ASSERT_EQ(Get(DataType::kFloat32, outs[t], 7), 1.0 + 2 * it);
      }
      if (it == 1) slow_after_first[rank] = c.engines[rank]->stats().slow_cycles;
    }
  });
  for (int r = 0; r < n; ++r) {
    EngineStats s = c.engines[r]->stats();
    EXPECT_EQ(s.slow_cycles, slow_after_first[r]) << "rank " << r;
    EXPECT_GE(s.fast_responses, 5 * 28) << "rank " << r;
  }
}

// An idle rank's empty cycles come further and further apart (up to 16 ms)
// instead of every cycle_time_ms, but never stop, and a submission brings
// its collective through at once.  With the period fixed at 1 ms, 300 ms
// idle would run about 300 cycles.
// A cycle time far below a microsecond (valid; a stranger tried 1e-300)
// backs off as fast: it reached 16 ms only after a thousand doublings, and
// the idle ranks burned a core meanwhile.
TEST(Negotiation, IdleRanksBackOffAndStillCycle) {
  const int n = 2;
  EngineConfig tiny = TestConfig();
  tiny.cycle_time_ms = 1e-300;
  for (const EngineConfig& config : {TestConfig(), tiny}) {
    Cluster c(n, config);
    for (int round = 0; round < 2; ++round) {
      OnEveryRank(n, [&](int rank) {
        std::vector<char> in = Buffer(DataType::kFloat32, 1);
        std::vector<char> out = Buffer(DataType::kFloat32, 1);
        Set(DataType::kFloat32, &in, 0, rank + 1);
        auto f = Submit(c.engines[rank].get(),
                        AllreduceEntry("x", DataType::kFloat32, {1}, in, &out));
        ASSERT_TRUE(Await(&f).ok());
        EXPECT_EQ(Get(DataType::kFloat32, out, 0), 3.0);
      });
      const int64_t before = c.engines[0]->stats().cycles;
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      const int64_t idle = c.engines[0]->stats().cycles - before;
      EXPECT_GE(idle, 5) << "round " << round;
      EXPECT_LE(idle, 60) << "round " << round << ", cycle time "
                          << config.cycle_time_ms << " ms";
    }
  }
}

// Ranks that submit two collectives in opposite orders agree on nothing
// until each has submitted both; meanwhile their cycles must not spin
// through empty rendezvous as fast as the ranks can meet (engine.cc,
// kEmptyCyclesBeforeBackoff), yet must go on cycling, and both collectives
// complete.  With the back-off, 200 ms crossed run at most about 32 +
// 200 ms / 128 us = 1600 cycles on any machine; without it, 2200 through
// this in-process transport on the 2-core development VM (and hundreds of
// thousands a second through shared memory).
TEST(Negotiation, CrossedSubmissionsBackOffAndStillCycle) {
  const int n = 2;
  Cluster c(n);
  std::vector<int64_t> crossed_cycles(n);
  OnEveryRank(n, [&](int rank) {
    std::vector<char> in = Buffer(DataType::kFloat32, 1);
    std::vector<char> out_a = Buffer(DataType::kFloat32, 1);
    std::vector<char> out_b = Buffer(DataType::kFloat32, 1);
    Set(DataType::kFloat32, &in, 0, rank + 1);
    const std::string first = rank == 0 ? "a" : "b";
    const std::string second = rank == 0 ? "b" : "a";
    Engine* engine = c.engines[rank].get();
    const int64_t before = engine->stats().cycles;
    auto f1 = Submit(engine, AllreduceEntry(first, DataType::kFloat32, {1}, in,
                                            rank == 0 ? &out_a : &out_b));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    crossed_cycles[rank] = engine->stats().cycles - before;
    auto f2 = Submit(engine, AllreduceEntry(second, DataType::kFloat32, {1},
                                            in, rank == 0 ? &out_b : &out_a));
    ASSERT_TRUE(Await(&f1).ok());
    ASSERT_TRUE(Await(&f2).ok());
    EXPECT_EQ(Get(DataType::kFloat32, out_a, 0), 3.0);
    EXPECT_EQ(Get(DataType::kFloat32, out_b, 0), 3.0);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_GE(crossed_cycles[r], 40) << "rank " << r;
    EXPECT_LE(crossed_cycles[r], 1700) << "rank " << r;
  }
}

// A full cache forgets its least recently used entry: a stream of one-shot
// names (say, names with a step counter) must not keep a recurring
// collective off the fast path, and the evictions must keep the bits
// consistent across ranks (ranks submit in different orders; every result
// is checked).
TEST(Negotiation, FullCacheEvictsLeastRecentlyUsed) {
  const int n = 3;
  EngineConfig config = TestConfig();
  config.cache_capacity = 3;
  Cluster c(n, config);
  std::vector<int64_t> fast_before(n), fast_after(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    // Input (`count` copies of this rank's `value`), output buffer and the
    // expected sum over the ranks, for one float64 allreduce.
    auto buffers = [](int64_t count, double value, double expected) {
      std::vector<char> in = Buffer(DataType::kFloat64, count);
      std::vector<char> out = Buffer(DataType::kFloat64, count);
      for (int64_t i = 0; i < count; ++i) Set(DataType::kFloat64, &in, i, value);
      return std::make_tuple(std::move(in), std::move(out), expected);
    };
    // Ten one-shot names fill the cache.
    for (int k = 0; k < 10; ++k) {
      auto [in, out, want] = buffers(2, rank + k, 3.0 + 3 * k);
      auto f = Submit(e, AllreduceEntry("one-shot." + std::to_string(k),
                                        DataType::kFloat64, {2}, in, &out));
      ASSERT_TRUE(Await(&f).ok());
      ASSERT_EQ(Get(DataType::kFloat64, out, 1), want);
    }
    // A recurring name is still cached: from its second call on it takes
    // the fast path (alone in flight, so every cycle is all-cached).
    fast_before[rank] = e->stats().fast_responses;
    for (int k = 0; k < 10; ++k) {
      auto [in, out, want] = buffers(4, rank * k, 3.0 * k);
      auto f = Submit(e, AllreduceEntry("steady", DataType::kFloat64, {4}, in,
                                        &out));
      ASSERT_TRUE(Await(&f).ok());
      ASSERT_EQ(Get(DataType::kFloat64, out, 3), want);
    }
    fast_after[rank] = e->stats().fast_responses;
    // Churn: six names over three bits, submitted in a different order on
    // every rank; a bit naming different collectives on different ranks
    // would pair the wrong tensors (wrong sums) or fail.
    std::mt19937 rng(99 + rank);
    for (int round = 0; round < 20; ++round) {
      std::vector<int> order = {0, 1, 2, 3, 4, 5};
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<std::vector<char>> ins(6), outs(6);
      std::vector<double> wants(6);
      std::vector<std::future<Status>> fs(6);
      for (int t : order) {
        std::tie(ins[t], outs[t], wants[t]) =
            buffers(1 + t, rank * 10 + t + round, 30.0 + 3 * (t + round));
        fs[t] = Submit(e, AllreduceEntry("churn." + std::to_string(t),
                                         DataType::kFloat64, {1 + t}, ins[t],
                                         &outs[t]));
      }
      for (int t = 0; t < 6; ++t) {
        Status s = Await(&fs[t]);
        ASSERT_TRUE(s.ok()) << s.ToString();
        ASSERT_EQ(Get(DataType::kFloat64, outs[t], t), wants[t])
            << "round " << round << " tensor " << t;
      }
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_GE(fast_after[r] - fast_before[r], 9) << "rank " << r;
  }
}

// A group is drained by the engine thread in one piece, so with a large
// enough threshold the whole group runs as one fused transport call.
TEST(Negotiation, EnqueueGroupFusesTheWholeGroup) {
  const int n = 2;
  const int kTensors = 40;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    std::vector<std::vector<char>> ins(kTensors), outs(kTensors);
    std::vector<TensorEntry> group;
    std::vector<std::future<Status>> fs;
    for (int t = 0; t < kTensors; ++t) {
      ins[t] = Buffer(DataType::kFloat32, 16);
      outs[t] = Buffer(DataType::kFloat32, 16);
      for (int i = 0; i < 16; ++i) Set(DataType::kFloat32, &ins[t], i, rank + t);
      TensorEntry e = AllreduceEntry("g." + std::to_string(t),
                                     DataType::kFloat32, {16}, ins[t],
                                     &outs[t]);
      auto promise = std::make_shared<std::promise<Status>>();
      fs.push_back(promise->get_future());
      e.done = [promise](const Status& s) { promise->set_value(s); };
      group.push_back(std::move(e));
    }
    EXPECT_TRUE(c.engines[rank]->EnqueueGroup(std::move(group)).ok());
    for (int t = 0; t < kTensors; ++t) {
      Status s = Await(&fs[t]);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(Get(DataType::kFloat32, outs[t], 15), 1.0 + 2 * t);
    }
  });
  for (int r = 0; r < n; ++r) {
    EngineStats s = c.engines[r]->stats();
    EXPECT_EQ(s.buckets, 1) << "rank " << r;
    EXPECT_EQ(s.fused_buckets, 1) << "rank " << r;
  }
}

// MEAN through the fusion buffer: the division happens on the copies out
// of the buffer, for float32 and float64 tensors of odd and empty sizes, and
// is the scalar division of the sum (3 ranks: not a power of two), NaN
// included.
TEST(Negotiation, FusedMeanDividesOnTheCopiesOut) {
  const int n = 3;
  const int64_t kCounts[] = {37, 0, 1, 8, 53};
  Cluster c(n);
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat64}) {
    OnEveryRank(n, [&](int rank) {
      std::vector<std::vector<char>> ins, outs;
      std::vector<TensorEntry> group;
      std::vector<std::future<Status>> fs;
      for (int64_t count : kCounts) {
        ins.push_back(Buffer(dtype, count));
        outs.push_back(Buffer(dtype, count));
      }
      for (size_t t = 0; t < ins.size(); ++t) {
        for (int64_t i = 0; i < kCounts[t]; ++i) {
          double v = (rank + 1) * (i + 1) + 0.25 * t;
          if (t == 0 && i == 5 && rank == 1) v = std::nan("");
          Set(dtype, &ins[t], i, v);
        }
        TensorEntry e = AllreduceEntry(
            std::string("mean.") + DataTypeName(dtype) + "." +
                std::to_string(t),
            dtype, {kCounts[t]}, ins[t], &outs[t], ReduceOp::kMean);
        auto promise = std::make_shared<std::promise<Status>>();
        fs.push_back(promise->get_future());
        e.done = [promise](const Status& s) { promise->set_value(s); };
        group.push_back(std::move(e));
      }
      EXPECT_TRUE(c.engines[rank]->EnqueueGroup(std::move(group)).ok());
      for (size_t t = 0; t < fs.size(); ++t) {
        Status s = Await(&fs[t]);
        ASSERT_TRUE(s.ok()) << s.ToString();
        for (int64_t i = 0; i < kCounts[t]; ++i) {
          const double got = Get(dtype, outs[t], i);
          if (t == 0 && i == 5) {
            EXPECT_TRUE(std::isnan(got));
            continue;
          }
          // Integer-valued sums are exact in either dtype, so the mean is
          // the division of that sum, rounded in the dtype.
          const double sum = 6.0 * (i + 1) + 0.75 * t;
          const double want =
              dtype == DataType::kFloat32
                  ? static_cast<double>(static_cast<float>(sum) / 3.0f)
                  : sum / 3.0;
          ASSERT_EQ(got, want) << DataTypeName(dtype) << " tensor " << t
                               << " element " << i;
        }
      }
    });
  }
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(c.engines[r]->stats().fused_buckets, 2) << "rank " << r;
  }
}

TEST(Negotiation, MismatchesFailOnEveryRank) {
  const int n = 3;
  Cluster c(n);
  struct Case {
    const char* name;
    std::vector<std::string> expect;  // substrings
  };
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> in = Buffer(DataType::kFloat64, 64);
    std::vector<char> out = Buffer(DataType::kFloat64, 64);
    // Shape.
    {
      Shape shape = rank == 1 ? Shape{5, 4} : Shape{3, 4};
      auto f = Submit(e, AllreduceEntry("grad/dense_1", DataType::kFloat32,
                                        shape, in, &out));
      Status s = ExpectFailure(&f, StatusCode::kFailedPrecondition,
                               "Mismatched allreduce \"grad/dense_1\": rank 0 "
                               "has shape [3, 4] but rank 1 has shape [5, 4]");
      EXPECT_FALSE(Contains(s.message(), "no elements")) << s.message();
    }
    // A rank with an empty tensor (a per-row loss on a rank left no rows).
    {
      Shape shape = rank == 2 ? Shape{0} : Shape{};
      auto f = Submit(e, AllreduceEntry("loss", DataType::kFloat32, shape, in,
                                        &out));
      ExpectFailure(&f, StatusCode::kFailedPrecondition,
                    "rank 0 has shape [] but rank 2 has shape [0] "
                    "(rank 2's tensor has no elements: did a short "
                    "last batch leave that rank no rows?");
    }
    // Dtype.
    {
      DataType dt = rank == 2 ? DataType::kInt32 : DataType::kFloat32;
      auto f = Submit(e, AllreduceEntry("d", dt, {4}, in, &out));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE(Contains(s.message(), "rank 0 has dtype float32 but rank 2 "
                                        "has dtype int32"))
          << s.message();
    }
    // Reduce op.
    {
      ReduceOp op = rank == 1 ? ReduceOp::kMax : ReduceOp::kSum;
      auto f = Submit(e, AllreduceEntry("o", DataType::kFloat32, {4}, in, &out, op));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE(Contains(s.message(), "sum") && Contains(s.message(), "max"))
          << s.message();
    }
    // Root rank.
    {
      TensorEntry b;
      b.type = CollectiveType::kBroadcast;
      b.name = "b";
      b.dtype = DataType::kFloat32;
      b.shape = {4};
      b.root_rank = rank == 2 ? 1 : 0;
      b.input = in.data();
      b.output = out.data();
      auto f = Submit(e, std::move(b));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE(Contains(s.message(), "rank 0 has root rank 0 but rank 2 "
                                        "has root rank 1"))
          << s.message();
    }
    // Collective type.
    {
      Allocated a;
      TensorEntry t = AllreduceEntry("t", DataType::kFloat32, {4}, in, &out);
      if (rank == 1) {
        t.type = CollectiveType::kAllgather;
        AttachAllocator(&t, &a);
      }
      auto f = Submit(e, std::move(t));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE(Contains(s.message(), "rank 0 called allreduce but rank 1 "
                                        "called allgather"))
          << s.message();
    }
    // Allgather: trailing dims.
    {
      Allocated a;
      TensorEntry t;
      t.type = CollectiveType::kAllgather;
      t.name = "ag";
      t.dtype = DataType::kFloat32;
      t.shape = rank == 1 ? Shape{2, 3} : Shape{2, 4};
      t.input = in.data();
      AttachAllocator(&t, &a);
      auto f = Submit(e, std::move(t));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE(Contains(s.message(), "[2, 4]") &&
                  Contains(s.message(), "[2, 3]"))
          << s.message();
    }
    // The engine still works afterwards.
    {
      Set(DataType::kFloat32, &in, 0, 1.0);
      auto f = Submit(e, AllreduceEntry("after", DataType::kFloat32, {1}, in, &out));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(Get(DataType::kFloat32, out, 0), 3.0);
    }
  });
}

// A group packed into one buffer by its kernel (TensorEntry::packed_shapes):
// reduced as one tensor, cached like one, and a group that differs between
// ranks fails on every rank naming the tensor, even when the totals agree.
TEST(Negotiation, PackedGroupsCompareTheirTensors) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> buffer = Buffer(DataType::kFloat32, 8);
    auto packed = [&](const std::string& name, std::vector<Shape> members) {
      TensorEntry t = AllreduceEntry(name, DataType::kFloat32, {8}, buffer,
                                     &buffer);
      t.packed_shapes = std::move(members);
      return t;
    };
    // Twice: the second call takes the cached fast path.
    for (int call = 0; call < 2; ++call) {
      for (int i = 0; i < 8; ++i) Set(DataType::kFloat32, &buffer, i, rank + i);
      auto f = Submit(e, packed("group", {{2, 3}, {1}}));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (int i = 0; i < 8; ++i) {
        EXPECT_EQ(Get(DataType::kFloat32, buffer, i), 3.0 + 3 * i) << i;
      }
    }
    // Rank 1 swaps the first tensor's dimensions: same total, so only the
    // packed shapes tell; ranks 0 and 2 still match the cache.
    {
      auto f = Submit(e, packed("group", {rank == 1 ? Shape{3, 2}
                                                    : Shape{2, 3},
                                          {1}}));
      ExpectFailure(&f, StatusCode::kFailedPrecondition,
                    "Mismatched allreduce \"group\": rank 0 has shape "
                    "[2, 3] but rank 1 has shape [3, 2] for grouped "
                    "tensor 0");
    }
    // Rank 2 adds a tensor.
    {
      std::vector<Shape> members = {{2, 3}, {1}};
      if (rank == 2) members.push_back({1});
      auto f = Submit(e, packed("group", members));
      ExpectFailure(&f, StatusCode::kFailedPrecondition,
                    "rank 0 has a group of 2 tensors but rank 2 has "
                    "a group of 3 tensors");
    }
    // A group of no tensors (the kernel's empty entry) meets the others'
    // groups: rank 1's empty group fails every rank, and empty groups on
    // every rank succeed.
    auto empty_group = [&](const std::string& name) {
      TensorEntry t = AllreduceEntry(name, DataType::kFloat32, {0}, buffer,
                                     &buffer);
      t.grouped = true;
      return t;
    };
    {
      auto f = Submit(e, rank == 1 ? empty_group("group")
                                   : packed("group", {{2, 3}, {1}}));
      ExpectFailure(&f, StatusCode::kFailedPrecondition,
                    "rank 0 has a group of 2 tensors but rank 1 has "
                    "a group of 0 tensors");
      f = Submit(e, empty_group("empty"));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    // Local misuse: packed shapes need a 1-D allreduce holding them.
    {
      auto f = Submit(e, packed("too-small", {{3, 3}}));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(s.message(), "room for 9 elements")) << s.message();
      TensorEntry b = packed("not-allreduce", {{2}});
      b.type = CollectiveType::kBroadcast;
      f = Submit(e, std::move(b));
      s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    }
    // The same name still works with the original group.
    {
      auto f = Submit(e, packed("group", {{2, 3}, {1}}));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
  });
}

// A group whose kernel left the packing to the engine
// (TensorEntry::packed_inputs), on a data plane that does not reduce parts:
// the engine copies each tensor to its PackedGroupLayout offset of the
// output, zeroes the gaps, and reduces the buffer, alone or fused with a
// plain tensor; the inputs stay as they were.  Local misuse fails naming it.
TEST(Negotiation, PackedInputsArePackedByTheEngine) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    // Odd sizes: every float32 tensor after the first starts after a gap.
    const std::vector<Shape> shapes = {{3}, {0}, {2, 5}, {}, {17}};
    const std::vector<DataType> dtypes(shapes.size(), DataType::kFloat32);
    const PackedLayout layout = PackedGroupLayout(dtypes, shapes);
    const int64_t total = layout.total_bytes / 4;
    std::vector<std::vector<char>> inputs;
    for (size_t k = 0; k < shapes.size(); ++k) {
      inputs.push_back(Buffer(DataType::kFloat32, NumElements(shapes[k])));
      for (int64_t i = 0; i < NumElements(shapes[k]); ++i) {
        Set(DataType::kFloat32, &inputs[k], i, 10 * k + i + rank);
      }
    }
    const std::vector<std::vector<char>> originals = inputs;
    std::vector<char> buffer = Buffer(DataType::kFloat32, total);
    auto group = [&](const std::string& name) {
      // Garbage where the gaps are: the engine must zero them.
      std::fill(buffer.begin(), buffer.end(), static_cast<char>(0x7f));
      TensorEntry t = AllreduceEntry(name, DataType::kFloat32, {total},
                                     buffer, &buffer);
      t.input = nullptr;
      t.packed_shapes = shapes;
      for (std::vector<char>& in : inputs) {
        t.packed_inputs.push_back(in.size() > 1 ? in.data() : nullptr);
      }
      return t;
    };
    auto check = [&]() {
      for (size_t k = 0; k < shapes.size(); ++k) {
        for (int64_t i = 0; i < NumElements(shapes[k]); ++i) {
          EXPECT_EQ(Get(DataType::kFloat32, buffer,
                        layout.byte_offsets[k] / 4 + i),
                    n * (10.0 * k + i) + 3)
              << "tensor " << k << " element " << i;
        }
      }
      // Gaps: 3 floats of the first tensor, then 13 up to the third's
      // 64-byte offset.
      for (int64_t i = 3; i < layout.byte_offsets[2] / 4; ++i) {
        EXPECT_EQ(Get(DataType::kFloat32, buffer, i), 0.0) << "gap " << i;
      }
      EXPECT_EQ(inputs, originals);
    };
    // Alone, twice (the second call takes the cached fast path).
    for (int call = 0; call < 2; ++call) {
      auto f = Submit(e, group("lazy"));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      check();
    }
    // Fused with a plain tensor enqueued in the same group of entries.
    {
      std::vector<char> in = Buffer(DataType::kFloat32, 5);
      std::vector<char> out = Buffer(DataType::kFloat32, 5);
      for (int i = 0; i < 5; ++i) Set(DataType::kFloat32, &in, i, rank);
      auto p1 = std::make_shared<std::promise<Status>>();
      auto p2 = std::make_shared<std::promise<Status>>();
      std::future<Status> f1 = p1->get_future();
      std::future<Status> f2 = p2->get_future();
      std::vector<TensorEntry> entries;
      entries.push_back(group("lazy/fused"));
      entries.back().done = [p1](const Status& s) { p1->set_value(s); };
      entries.push_back(
          AllreduceEntry("plain/fused", DataType::kFloat32, {5}, in, &out));
      entries.back().done = [p2](const Status& s) { p2->set_value(s); };
      e->EnqueueGroup(std::move(entries));
      Status s = Await(&f1);
      ASSERT_TRUE(s.ok()) << s.ToString();
      s = Await(&f2);
      ASSERT_TRUE(s.ok()) << s.ToString();
      check();
      EXPECT_EQ(Get(DataType::kFloat32, out, 4), 3.0);
    }
    // Local misuse, each named.
    auto expect_invalid = [&](TensorEntry t, const char* words) {
      auto f = Submit(e, std::move(t));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << words;
      EXPECT_TRUE(Contains(s.message(), words)) << s.message();
    };
    TensorEntry t = group("short");
    t.packed_inputs.pop_back();
    expect_invalid(std::move(t),
                   "one input per packed shape (4 inputs, 5 shapes)");
    t = group("null");
    t.packed_inputs[2] = nullptr;
    expect_invalid(std::move(t), "packed input 2 is null");
    t = group("gpu");
    t.device = 0;
    expect_invalid(std::move(t), "need a CPU group");
    t = group("does-not-fit");
    t.shape = {total - 1};
    expect_invalid(std::move(t), "does not fit shape");
    t = group("outputs-short");
    t.packed_outputs.assign(shapes.size() - 1, buffer.data());
    expect_invalid(std::move(t),
                   "packed_outputs need packed_inputs, one each (4 outputs, "
                   "5 inputs)");
    t = group("output-null");
    t.packed_outputs.assign(shapes.size(), buffer.data());
    t.packed_outputs[4] = nullptr;
    expect_invalid(std::move(t), "packed output 4 is null");
  });
}

// A group of several dtypes is one byte buffer with a segment per dtype
// (PackedGroupLayout), reduced segment by segment under one name; groups that
// differ in a tensor's dtype fail on every rank naming the tensor, whether
// the other rank's group is mixed or not.
TEST(Negotiation, MixedDtypeGroupsReduceBySegmentAndCompareDtypes) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    // float32 [3], int32 [2], float32 [1], int64 [] (a scalar).
    const std::vector<DataType> dtypes = {DataType::kFloat32, DataType::kInt32,
                                          DataType::kFloat32, DataType::kInt64};
    const std::vector<Shape> shapes = {{3}, {2}, {1}, {}};
    const PackedLayout layout = PackedGroupLayout(dtypes, shapes);
    std::vector<char> buffer(static_cast<size_t>(layout.total_bytes));
    auto mixed = [&](const std::string& name, std::vector<DataType> d,
                     ReduceOp op = ReduceOp::kSum) {
      TensorEntry t;
      t.type = CollectiveType::kAllreduce;
      t.name = name;
      t.dtype = DataType::kUint8;
      t.shape = {layout.total_bytes};
      t.reduce_op = op;
      t.packed_shapes = shapes;
      t.packed_dtypes = std::move(d);
      t.input = buffer.data();
      t.output = buffer.data();
      return t;
    };
    auto fill = [&]() {
      std::fill(buffer.begin(), buffer.end(), 0);
      for (size_t k = 0; k < dtypes.size(); ++k) {
        const int64_t size = DataTypeSize(dtypes[k]);
        std::vector<char> values = Buffer(dtypes[k], NumElements(shapes[k]));
        for (int64_t i = 0; i < NumElements(shapes[k]); ++i) {
          Set(dtypes[k], &values, i, 10 * k + i + rank);
        }
        std::memcpy(buffer.data() + layout.byte_offsets[k], values.data(),
                    NumElements(shapes[k]) * size);
      }
    };
    auto value = [&](size_t k, int64_t i) {
      std::vector<char> values = Buffer(dtypes[k], NumElements(shapes[k]));
      std::memcpy(values.data(), buffer.data() + layout.byte_offsets[k],
                  NumElements(shapes[k]) * DataTypeSize(dtypes[k]));
      return Get(dtypes[k], values, i);
    };
    // Twice: the second call takes the cached fast path.
    for (int call = 0; call < 2; ++call) {
      fill();
      auto f = Submit(e, mixed("mixed", dtypes));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (size_t k = 0; k < dtypes.size(); ++k) {
        for (int64_t i = 0; i < NumElements(shapes[k]); ++i) {
          // sum over ranks r of 10k + i + r
          EXPECT_EQ(value(k, i), n * (10.0 * k + i) + 3) << k << " " << i;
        }
      }
    }
    // Rank 1's tensor 1 is int64: same buffer size, only the dtypes differ.
    {
      std::vector<DataType> d = dtypes;
      if (rank == 1) d[1] = DataType::kInt64;
      fill();
      auto f = Submit(e, mixed("mixed", d));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
      EXPECT_TRUE(Contains(s.message(),
                           "Mismatched allreduce \"mixed\": rank 0 has dtype "
                           "int32 but rank 1 has dtype int64 for grouped "
                           "tensor 1"))
          << s.message();
    }
    // Rank 2's group has one dtype (a float32 buffer, no packed_dtypes).
    {
      std::vector<char> plain = Buffer(DataType::kFloat32, 6);
      TensorEntry t = AllreduceEntry("one-dtype", DataType::kFloat32, {6},
                                     plain, &plain);
      t.packed_shapes = {{3}, {2}, {1}};
      TensorEntry m = mixed("one-dtype", dtypes);
      m.packed_shapes = {{3}, {2}, {1}};
      m.packed_dtypes = {DataType::kFloat32, DataType::kInt32,
                         DataType::kFloat32};
      m.shape = {PackedGroupLayout(m.packed_dtypes, m.packed_shapes).total_bytes};
      auto f = Submit(e, rank == 2 ? std::move(t) : std::move(m));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
      EXPECT_TRUE(Contains(s.message(),
                           "rank 0 has dtype int32 but rank 2 has dtype "
                           "float32 for grouped tensor 1"))
          << s.message();
    }
    // A plain allreduce against a group under one name says so.
    {
      std::vector<char> plain = Buffer(DataType::kFloat32, 6);
      TensorEntry t = AllreduceEntry("plain-or-group", DataType::kFloat32, {6},
                                     plain, &plain);
      if (rank != 0) t.packed_shapes = {{6}};
      auto f = Submit(e, std::move(t));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
      EXPECT_TRUE(Contains(s.message(),
                           "rank 0 called allreduce but rank 1 called "
                           "grouped_allreduce of 1 tensors"))
          << s.message();
    }
    // Local misuse: mean over an integer tensor; a wrong byte size.
    {
      auto f = Submit(e, mixed("mean", dtypes, ReduceOp::kMean));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(s.message(), "tensor 1 is int32")) << s.message();
      TensorEntry t = mixed("size", dtypes);
      t.shape = {layout.total_bytes - 1};
      f = Submit(e, std::move(t));
      s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(s.message(), "(bytes)")) << s.message();
    }
    // Afterwards the name works again.
    {
      fill();
      auto f = Submit(e, mixed("mixed", dtypes));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(value(3, 0), n * 30.0 + 3);
    }
  });
}

// The bit vector of every cycle is sized by cache_capacity, and the data
// planes are set up by collectives that data_plane, shm_bytes and
// hierarchical_allreduce decide: ranks that differ fail every collective
// naming the setting instead of handing MPI mismatched calls.
TEST(Negotiation, RanksMustAgreeOnSharedSettings) {
  struct Case {
    std::function<void(EngineConfig*)> differ;  // applied on rank 1
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](EngineConfig* c) { c->cache_capacity = 0; },
       "ranks disagree on cache_capacity (rank 0: 1024, rank 1: 0); set "
       "MPISTRATEGY_CACHE_CAPACITY (or Options.cache_capacity, or "
       "HOROVOD_CACHE_CAPACITY with hvd) alike on every rank"},
      {[](EngineConfig* c) { c->data_plane = HostDataPlane::kShm; },
       "ranks disagree on data_plane (rank 0: mpi, rank 1: shm); set "
       "MPISTRATEGY_DATA_PLANE (or Options.data_plane) alike on every rank"},
      {[](EngineConfig* c) { c->shm_bytes = 1 << 20; },
       "ranks disagree on shm_bytes (rank 0: 16777216, rank 1: 1048576)"},
      {[](EngineConfig* c) { c->hierarchical_allreduce = true; },
       "ranks disagree on hierarchical_allreduce (rank 0: false, rank 1: "
       "true)"},
  };
  for (const Case& test : cases) {
    auto world = FakeWorld::Create(2, 0, 30.0);
    std::vector<std::unique_ptr<Engine>> engines(2);
    for (int r = 0; r < 2; ++r) {
      EngineConfig config = TestConfig();
      config.data_plane = HostDataPlane::kMpi;
      if (r == 1) test.differ(&config);
      ASSERT_TRUE(
          Engine::Create(config, world->CreateTransport(r), &engines[r]).ok());
    }
    OnEveryRank(2, [&](int rank) {
      std::vector<char> in = Buffer(DataType::kFloat32, 4);
      std::vector<char> out = Buffer(DataType::kFloat32, 4);
      auto f = Submit(engines[rank].get(),
                      AllreduceEntry("x", DataType::kFloat32, {4}, in, &out));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
      EXPECT_TRUE(Contains(s.message(), test.want)) << s.message();
      // What waits for the start-up exchange gets the same error.
      std::vector<PeerInfo> peers;
      s = engines[rank]->WaitForPeers(&peers);
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
      EXPECT_TRUE(Contains(s.message(), test.want)) << s.message();
      EXPECT_TRUE(peers.empty());
      // As does what waits for the engine to start (init).
      s = engines[rank]->WaitUntilStarted();
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
      EXPECT_TRUE(Contains(s.message(), test.want)) << s.message();
    });
  }
}

// Every rank learns every rank's host and pid from the start-up exchange,
// without a collective of its own.
TEST(Negotiation, WaitForPeersGivesEveryRanksHost) {
  const int n = 3;
  auto world = FakeWorld::Create(n, 2, 30.0);  // hosts of 2 and 1 ranks
  std::vector<std::unique_ptr<Engine>> engines(n);
  for (int r = 0; r < n; ++r) {
    EngineConfig config = TestConfig();
    config.data_plane = HostDataPlane::kMpi;
    ASSERT_TRUE(
        Engine::Create(config, world->CreateTransport(r), &engines[r]).ok());
  }
  OnEveryRank(n, [&](int rank) {
    std::vector<PeerInfo> peers;
    Status s = engines[rank]->WaitForPeers(&peers);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(peers.size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(peers[r].host, "host" + std::to_string(r / 2));
      EXPECT_EQ(peers[r].pid, 1000 + r);
    }
    s = engines[rank]->WaitUntilStarted();
    EXPECT_TRUE(s.ok()) << s.ToString();
  });
}

TEST(Negotiation, AllgatherDifferentFirstDims) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    const int64_t rows = rank + 1;  // 1, 2, 3
    std::vector<char> in = Buffer(DataType::kInt32, rows * 2);
    for (int64_t i = 0; i < rows * 2; ++i) Set(DataType::kInt32, &in, i, 100 * rank + i);
    Allocated a;
    TensorEntry t;
    t.type = CollectiveType::kAllgather;
    t.name = "gather";
    t.dtype = DataType::kInt32;
    t.shape = {rows, 2};
    t.input = in.data();
    AttachAllocator(&t, &a);
    for (int it = 0; it < 3; ++it) {  // again through the cache
      auto f = Submit(c.engines[rank].get(), t);
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(a.shape, (Shape{6, 2}));
      int64_t k = 0;
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < (r + 1) * 2; ++i, ++k) {
          ASSERT_EQ(Get(DataType::kInt32, a.data, k), 100.0 * r + i);
        }
      }
    }
  });
}

TEST(Negotiation, AlltoallUnevenSplits) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    // Rank r sends (r + j) rows to rank j; a row is 2 floats whose value
    // encodes (sender, receiver, row).
    std::vector<int64_t> splits;
    int64_t rows = 0;
    for (int j = 0; j < n; ++j) {
      splits.push_back(rank + j);
      rows += rank + j;
    }
    std::vector<char> in = Buffer(DataType::kFloat32, rows * 2);
    int64_t k = 0;
    for (int j = 0; j < n; ++j) {
      for (int64_t row = 0; row < rank + j; ++row, ++k) {
        Set(DataType::kFloat32, &in, 2 * k, 100 * rank + 10 * j + row);
        Set(DataType::kFloat32, &in, 2 * k + 1, -1);
      }
    }
    Allocated a;
    TensorEntry t;
    t.type = CollectiveType::kAlltoall;
    t.name = "a2a";
    t.dtype = DataType::kFloat32;
    t.shape = {rows, 2};
    t.splits = splits;
    t.input = in.data();
    AttachAllocator(&t, &a);
    auto f = Submit(c.engines[rank].get(), t);
    Status s = Await(&f);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::vector<int64_t> want_splits;
    int64_t want_rows = 0;
    for (int r = 0; r < n; ++r) {
      want_splits.push_back(r + rank);
      want_rows += r + rank;
    }
    EXPECT_EQ(a.received_splits, want_splits);
    ASSERT_EQ(a.shape, (Shape{want_rows, 2}));
    k = 0;
    for (int r = 0; r < n; ++r) {
      for (int64_t row = 0; row < r + rank; ++row, ++k) {
        EXPECT_EQ(Get(DataType::kFloat32, a.data, 2 * k), 100.0 * r + 10 * rank + row);
      }
    }
  });
}

TEST(Negotiation, ReducescatterBroadcastBarrier) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    // Reducescatter of [5, 2]: rows 2, 2, 1.
    std::vector<char> in = Buffer(DataType::kFloat64, 10);
    for (int i = 0; i < 10; ++i) Set(DataType::kFloat64, &in, i, i + rank);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean}) {
      Allocated a;
      TensorEntry t;
      t.type = CollectiveType::kReducescatter;
      t.name = std::string("rs/") + ReduceOpName(op);
      t.dtype = DataType::kFloat64;
      t.shape = {5, 2};
      t.reduce_op = op;
      t.input = in.data();
      AttachAllocator(&t, &a);
      auto f = Submit(e, std::move(t));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      const int64_t first_row = rank == 0 ? 0 : rank == 1 ? 2 : 4;
      const int64_t my_rows = rank < 2 ? 2 : 1;
      ASSERT_EQ(a.shape, (Shape{my_rows, 2}));
      for (int64_t i = 0; i < my_rows * 2; ++i) {
        const double sum = 3.0 * (first_row * 2 + i) + 3;
        EXPECT_EQ(Get(DataType::kFloat64, a.data, i),
                  op == ReduceOp::kSum ? sum : sum / 3);
      }
    }
    // Broadcast from rank 1.
    {
      std::vector<char> bin = Buffer(DataType::kInt64, 4);
      std::vector<char> bout = Buffer(DataType::kInt64, 4);
      for (int i = 0; i < 4; ++i) Set(DataType::kInt64, &bin, i, 10 * rank + i);
      TensorEntry b;
      b.type = CollectiveType::kBroadcast;
      b.name = "bcast";
      b.dtype = DataType::kInt64;
      b.shape = {4};
      b.root_rank = 1;
      b.input = bin.data();
      b.output = bout.data();
      auto f = Submit(e, std::move(b));
      Status s = Await(&f);
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (int i = 0; i < 4; ++i) EXPECT_EQ(Get(DataType::kInt64, bout, i), 10.0 + i);
    }
    // Barrier.
    {
      TensorEntry b;
      b.type = CollectiveType::kBarrier;
      b.name = "barrier";
      auto f = Submit(e, std::move(b));
      Status s = Await(&f);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  });
}

TEST(Negotiation, ZeroSizeTensors) {
  const int n = 2;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> empty;
    std::vector<std::future<Status>> fs;
    std::vector<Allocated> a(4);
    {
      TensorEntry t;
      t.name = "z/allreduce";
      t.shape = {0, 3};
      fs.push_back(Submit(e, t));
      t.name = "z/allreduce_mean";
      t.reduce_op = ReduceOp::kMean;
      fs.push_back(Submit(e, t));
    }
    {
      TensorEntry t;
      t.type = CollectiveType::kAllgather;
      t.name = "z/allgather";
      t.shape = {0, 3};
      AttachAllocator(&t, &a[0]);
      fs.push_back(Submit(e, t));
    }
    {
      TensorEntry t;
      t.type = CollectiveType::kBroadcast;
      t.name = "z/broadcast";
      t.shape = {0};
      fs.push_back(Submit(e, t));
    }
    {
      TensorEntry t;
      t.type = CollectiveType::kReducescatter;
      t.name = "z/reducescatter";
      t.shape = {0};
      AttachAllocator(&t, &a[1]);
      fs.push_back(Submit(e, t));
    }
    {
      TensorEntry t;
      t.type = CollectiveType::kAlltoall;
      t.name = "z/alltoall";
      t.shape = {0, 2};
      AttachAllocator(&t, &a[2]);
      fs.push_back(Submit(e, t));
    }
    // Allgather where only rank 1 contributes rows.
    std::vector<char> in = Buffer(DataType::kFloat32, 2);
    Set(DataType::kFloat32, &in, 0, 7);
    Set(DataType::kFloat32, &in, 1, 8);
    {
      TensorEntry t;
      t.type = CollectiveType::kAllgather;
      t.name = "z/allgather_mixed";
      t.shape = {rank == 1 ? 1 : 0, 2};
      t.input = in.data();
      AttachAllocator(&t, &a[3]);
      fs.push_back(Submit(e, t));
    }
    for (auto& f : fs) {
      Status s = Await(&f);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    EXPECT_EQ(a[0].shape, (Shape{0, 3}));
    EXPECT_EQ(a[1].shape, (Shape{0}));
    EXPECT_EQ(a[2].shape, (Shape{0, 2}));
    ASSERT_EQ(a[3].shape, (Shape{1, 2}));
    EXPECT_EQ(Get(DataType::kFloat32, a[3].data, 1), 8.0);
  });
}

TEST(Negotiation, LocalMisuseIsInvalidArgument) {
  Cluster c(2);
  Engine* e = c.engines[0].get();
  std::vector<char> in = Buffer(DataType::kInt32, 8), out = Buffer(DataType::kInt32, 8);
  auto check = [&](TensorEntry t, const std::string& needle) {
    Status from_done;
    t.done = [&from_done](const Status& s) { from_done = s; };
    Status s = e->Enqueue(std::move(t));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_EQ(from_done.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), needle)) << s.message();
  };
  check(AllreduceEntry("", DataType::kInt32, {8}, in, &out), "name");
  {
    TensorEntry t = AllreduceEntry("null", DataType::kInt32, {8}, in, &out);
    t.output = nullptr;
    check(t, "`output` is null");
  }
  // Duplicate name in flight: rank 1 never submits "dup", so the first
  // stays pending.
  std::vector<char> in2 = Buffer(DataType::kInt32, 8);
  auto first = Submit(e, AllreduceEntry("dup", DataType::kInt32, {8}, in2, &out));
  check(AllreduceEntry("dup", DataType::kInt32, {8}, in, &out), "in flight");
  // Let rank 1 complete it.
  std::vector<char> out1 = Buffer(DataType::kInt32, 8);
  auto second = Submit(c.engines[1].get(),
                       AllreduceEntry("dup", DataType::kInt32, {8}, in, &out1));
  EXPECT_TRUE(Await(&first).ok());
  EXPECT_TRUE(Await(&second).ok());
}

// Arguments that only one rank gets wrong (a splits tensor computed from
// its own data, say) fail the collective on every rank, naming the rank,
// instead of failing there at once while the others wait for it: also when
// the name is cached, and the name works again afterwards.
TEST(Negotiation, ArgumentsInvalidOnOneRankFailEveryRank) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> in = Buffer(DataType::kInt32, 8);
    std::vector<char> out = Buffer(DataType::kInt32, 8);
    Allocated a;
    // Each case: a valid entry of `type`, what rank 1 breaks in it, and
    // what the error says.
    struct Case {
      CollectiveType type;
      std::function<void(TensorEntry*)> break_it;
      std::string words;
    };
    const CollectiveType alltoall = CollectiveType::kAlltoall;
    const std::vector<Case> cases = {
        {alltoall, [](TensorEntry* t) { t->splits = {3, 4, 0}; },
         "splits [3, 4, 0] sum to 7 but the first dimension of the input is "
         "6"},
        {alltoall, [](TensorEntry* t) { t->splits = {6, -1, 1}; },
         "splits must be >= 0, got [6, -1, 1]"},
        {alltoall,
         [](TensorEntry* t) { t->splits = {INT64_MAX, INT64_MAX, 2}; },
         "overflow int64"},
        {alltoall,
         [](TensorEntry* t) {
           t->splits = {};
           t->shape = {4};
         },
         "must be divisible by the number of ranks (3)"},
        {alltoall, [](TensorEntry* t) { t->shape = {}; }, "got a scalar"},
        {CollectiveType::kBroadcast, [](TensorEntry* t) { t->root_rank = 3; },
         "root_rank must be in [0, 3), got 3"},
        {CollectiveType::kAllreduce,
         [](TensorEntry* t) { t->reduce_op = ReduceOp::kMean; },
         "reduce_op mean needs a floating dtype"},
    };
    // Six int32 elements; an alltoall sends two to each rank.
    auto entry = [&](const std::string& name, CollectiveType type) {
      TensorEntry t;
      t.type = type;
      t.name = name;
      t.dtype = DataType::kInt32;
      t.shape = {6};
      if (type == alltoall) t.splits = {2, 2, 2};
      t.input = in.data();
      t.output = out.data();
      AttachAllocator(&t, &a);
      return t;
    };
    for (size_t k = 0; k < cases.size(); ++k) {
      const std::string name = "case" + std::to_string(k);
      const TensorEntry good = entry(name, cases[k].type);
      // Valid everywhere first, so that the name is cached on every rank.
      {
        auto f = Submit(e, good);
        ASSERT_TRUE(Await(&f).ok()) << name;
      }
      TensorEntry t = good;
      if (rank == 1) cases[k].break_it(&t);
      auto f = Submit(e, std::move(t));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_TRUE(Contains(s.message(), cases[k].words)) << s.message();
      EXPECT_TRUE(Contains(s.message(), "(on rank 1)")) << s.message();
      f = Submit(e, good);
      EXPECT_TRUE(Await(&f).ok()) << name;
    }
  });
}

TEST(Negotiation, StallTimeoutFailsWaitingRanks) {
  const int n = 3;
  EngineConfig config = TestConfig();
  config.stall_warning_seconds = 0.1;
  config.stall_timeout_seconds = 0.4;
  Cluster c(n, config);
  std::atomic<int> timed_out_ranks{0};
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> in = Buffer(DataType::kFloat32, 4), out = Buffer(DataType::kFloat32, 4);
    // Cache "cached" first so the second stall goes through the bit path.
    {
      auto f = Submit(e, AllreduceEntry("cached", DataType::kFloat32, {4}, in, &out));
      ASSERT_TRUE(Await(&f).ok());
    }
    for (const char* name : {"lonely", "cached"}) {
      if (rank != 1) {
        auto f = Submit(e, AllreduceEntry(name, DataType::kFloat32, {4}, in, &out));
        Status s = Await(&f, 10.0);
        EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
        EXPECT_TRUE(Contains(s.message(), std::string("Collective \"") + name +
                                              "\" timed out") &&
                    Contains(s.message(),
                             "waiting for rank 1 (host host0, pid 1001); "
                             "rank 0 (host host0, pid 1000), rank 2 (host "
                             "host0, pid 1002) submitted it"))
            << s.message();
      }
    }
    // Rank 1 joins in again only after the others saw both timeouts.
    if (rank != 1) {
      ++timed_out_ranks;
    } else {
      while (timed_out_ranks.load() < n - 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    // Everybody still works.
    Set(DataType::kFloat32, &in, 0, 2.0);
    auto f = Submit(e, AllreduceEntry("after", DataType::kFloat32, {1}, in, &out));
    Status s = Await(&f);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(Get(DataType::kFloat32, out, 0), 6.0);
  });
}

TEST(Negotiation, CrossedBlockingJoinFailsFastOnEveryRank) {
  // `if rank == 0: restore()` then a broadcast on every rank: rank 0 waits
  // in the read's join, rank 1 in the broadcast.  Both are cached (bit
  // path) and stall detection is off, yet both fail within seconds.
  const int n = 2;
  Cluster c(n);
  const std::string join = std::string(kBlockingJoinPrefix) + "restore";
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> in = Buffer(DataType::kFloat32, 2);
    std::vector<char> out = Buffer(DataType::kFloat32, 2);
    auto barrier = [&] {
      TensorEntry b;
      b.type = CollectiveType::kBarrier;
      b.name = join;
      return Submit(e, std::move(b));
    };
    auto bcast = [&] {
      TensorEntry b;
      b.type = CollectiveType::kBroadcast;
      b.name = "bcast";
      b.dtype = DataType::kFloat32;
      b.shape = {2};
      b.input = in.data();
      b.output = out.data();
      return Submit(e, std::move(b));
    };
    for (int i = 0; i < 2; ++i) {  // every rank: fine, and now cached
      auto f = barrier();
      ASSERT_TRUE(Await(&f).ok());
      auto g = bcast();
      ASSERT_TRUE(Await(&g).ok());
    }
    const auto start = std::chrono::steady_clock::now();
    auto f = rank == 0 ? barrier() : bcast();
    Status s = Await(&f, 20.0);
    const double took = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - start)
                            .count();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_LT(took, kCrossedJoinSeconds + 3.0);
    if (rank == 0) {
      EXPECT_TRUE(Contains(s.message(), "Blocking join \"" + join +
                                            "\" cannot complete: rank 1"))
          << s.message();
      EXPECT_TRUE(Contains(s.message(), "waits in broadcast \"bcast\""))
          << s.message();
    } else {
      EXPECT_TRUE(Contains(s.message(),
                           "broadcast \"bcast\" cannot complete: rank 0"))
          << s.message();
      EXPECT_TRUE(Contains(s.message(), "blocked in the blocking join \"" +
                                            join + "\""))
          << s.message();
    }
    // Both sides failed cleanly: the ranks go on together.
    auto g = barrier();
    EXPECT_TRUE(Await(&g).ok());
    Set(DataType::kFloat32, &in, 0, 1.0 + rank);
    auto h = Submit(e, AllreduceEntry("after", DataType::kFloat32, {1}, in,
                                      &out));
    Status t = Await(&h);
    ASSERT_TRUE(t.ok()) << t.ToString();
    EXPECT_EQ(Get(DataType::kFloat32, out, 0), 3.0);
  });
}

TEST(Negotiation, AbortOnOneRankAbortsTheOthers) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    Engine* e = c.engines[rank].get();
    std::vector<char> in = Buffer(DataType::kFloat32, 4), out = Buffer(DataType::kFloat32, 4);
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      e->Abort("rank 1 raised ValueError: boom", 10.0);
    } else {
      auto f = Submit(e, AllreduceEntry("pending_x", DataType::kFloat32, {4}, in, &out));
      Status s = Await(&f);
      EXPECT_EQ(s.code(), StatusCode::kAborted);
      EXPECT_TRUE(Contains(s.message(), "collective \"pending_x\" was aborted "
                                        "because rank 1 (host host0, pid 1001) "
                                        "stopped: rank 1 raised "
                                        "ValueError: boom"))
          << s.message();
    }
    // Sticky: later submissions fail at once.
    auto f = Submit(e, AllreduceEntry("later", DataType::kFloat32, {4}, in, &out));
    Status s = Await(&f, 1.0);
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "ValueError: boom")) << s.message();
  });
}

TEST(Negotiation, DestroyAndRecreate) {
  const int n = 2;
  for (int round = 0; round < 3; ++round) {
    Cluster c(n);
    std::vector<std::future<Status>> pending(n);
    OnEveryRank(n, [&](int rank) {
      std::vector<char> in = Buffer(DataType::kFloat32, 1), out = Buffer(DataType::kFloat32, 1);
      Set(DataType::kFloat32, &in, 0, rank + round);
      auto f = Submit(c.engines[rank].get(),
                      AllreduceEntry("x", DataType::kFloat32, {1}, in, &out));
      ASSERT_TRUE(Await(&f).ok());
      EXPECT_EQ(Get(DataType::kFloat32, out, 0), 1.0 + 2 * round);
    });
    // A pending entry on rank 0 only is aborted by the shutdown.
    static std::vector<char> in = Buffer(DataType::kFloat32, 1), out = Buffer(DataType::kFloat32, 1);
    auto f = Submit(c.engines[0].get(),
                    AllreduceEntry("never", DataType::kFloat32, {1}, in, &out));
    c.engines[1].reset();  // tells rank 0's engine too
    Status s = Await(&f, 10.0);
    EXPECT_EQ(s.code(), StatusCode::kAborted);
    EXPECT_TRUE(Contains(s.message(),
                         "rank 1 (host host0, pid 1001) stopped: rank 1 "
                         "(host host0, pid 1001) shut down"))
        << s.message();
    c.engines[0].reset();
  }
}

TEST(Negotiation, ConfigValidation) {
  std::unique_ptr<Engine> e;
  auto world = FakeWorld::Create(1);
  EngineConfig config;
  config.fusion_threshold_bytes = -1;
  Status s = Engine::Create(config, world->CreateTransport(0), &e);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "fusion_threshold_bytes")) << s.message();
  config = EngineConfig();
  config.cycle_time_ms = 0;
  EXPECT_TRUE(Contains(config.Validate().message(), "cycle_time_ms"));
  config = EngineConfig();
  config.cache_capacity = -5;
  EXPECT_TRUE(Contains(config.Validate().message(), "cache_capacity"));
  config = EngineConfig();
  config.stall_timeout_seconds = -1;
  EXPECT_TRUE(Contains(config.Validate().message(), "stall_timeout_seconds"));
  config = EngineConfig();
  config.stall_warning_seconds = -1;
  EXPECT_TRUE(Contains(config.Validate().message(), "stall_warning_seconds"));
}

TEST(Negotiation, SingleRankAndNoCache) {
  EngineConfig config = TestConfig();
  config.cache_capacity = 0;
  config.fusion_threshold_bytes = 0;
  Cluster c(1, config);
  std::vector<char> in = Buffer(DataType::kFloat32, 3), out = Buffer(DataType::kFloat32, 3);
  for (int i = 0; i < 3; ++i) Set(DataType::kFloat32, &in, i, i);
  for (int it = 0; it < 3; ++it) {
    auto f = Submit(c.engines[0].get(),
                    AllreduceEntry("s", DataType::kFloat32, {3}, in, &out, ReduceOp::kMean));
    ASSERT_TRUE(Await(&f).ok());
    EXPECT_EQ(Get(DataType::kFloat32, out, 2), 2.0);
  }
  EXPECT_EQ(c.engines[0]->stats().fast_responses, 0);
}

}  // namespace
}  // namespace mpistrategy

namespace mpistrategy {
namespace {

TEST(Negotiation, TransportFailureIsSticky) {
  // Two-rank world but only rank 0 runs an engine: its first BitwiseAnd
  // cannot complete, the fake transport gives up and the error sticks.
  auto world = FakeWorld::Create(2, 0, 0.2);
  std::unique_ptr<Engine> engine;
  ASSERT_TRUE(Engine::Create(TestConfig(), world->CreateTransport(0), &engine).ok());
  std::vector<char> in = Buffer(DataType::kFloat32, 1), out = Buffer(DataType::kFloat32, 1);
  auto f = Submit(engine.get(), AllreduceEntry("x", DataType::kFloat32, {1}, in, &out));
  Status s = Await(&f, 10.0);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "collective \"x\"")) << s.message();
  auto g = Submit(engine.get(), AllreduceEntry("y", DataType::kFloat32, {1}, in, &out));
  s = Await(&g, 1.0);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "collective \"y\"")) << s.message();
  engine.reset();  // must not hang
}

}  // namespace
}  // namespace mpistrategy
