// Checks MpiTransport and the engine over real MPI.  Run under mpirun:
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 mpi_transport_check
//   mpirun --allow-run-as-root --oversubscribe -np 3 mpi_transport_check
//
// Every rank prints "rank R: PASS" (exit 0) or the failures (exit 1).

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine/engine.h"
#include "cc/common/float16.h"
#include "cc/testing/mpi_check.h"
#include "cc/transport/mpi_transport.h"

namespace mpistrategy {
namespace {

using ToF = float (*)(uint16_t);
using FromF = uint16_t (*)(float);

// float16/bfloat16 allreduce of values with closed-form results.
void CheckHalf(Transport* t, DataType dtype, ToF to, FromF from) {
  const int n = t->size();
  const int r = t->rank();
  const int64_t count = 1000;
  std::vector<uint16_t> in(count), out(count);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax,
                      ReduceOp::kProduct}) {
    for (int64_t i = 0; i < count; ++i) {
      float v = static_cast<float>((r + 1) * (i % 7) - 3 * r);
      if (op == ReduceOp::kProduct) v = (i % 2 ? 0.5f : -2.0f) * (r + 1);
      in[i] = from(v);
    }
    CHECK_OK(t->Allreduce(in.data(), out.data(), count, dtype, op));
    for (int64_t i = 0; i < count; ++i) {
      double want = 0;
      const double k = i % 7;
      switch (op) {
        case ReduceOp::kSum:
          want = k * n * (n + 1) / 2 - 3.0 * n * (n - 1) / 2;
          break;
        case ReduceOp::kMin:
          want = std::min(k, k * n - 3.0 * (n - 1));
          break;
        case ReduceOp::kMax:
          want = std::max(k, k * n - 3.0 * (n - 1));
          break;
        case ReduceOp::kProduct: {
          want = 1;
          for (int q = 0; q < n; ++q) want *= (i % 2 ? 0.5 : -2.0) * (q + 1);
          break;
        }
        default:
          break;
      }
      if (to(out[i]) != static_cast<float>(want)) {
        CHECK_TRUE(false, "%s %s element %ld: got %g want %g",
                   DataTypeName(dtype), ReduceOpName(op),
                   static_cast<long>(i), to(out[i]), want);
        break;
      }
    }
  }
  // Rounding: with two ranks, a + b is rounded once to nearest even.
  if (n == 2) {
    for (int64_t i = 0; i < count; ++i) {
      const float v = r == 0 ? 1.0f + i * 0.37f : 0.001f * (i + 1);
      in[i] = from(v);
    }
    CHECK_OK(t->Allreduce(in.data(), out.data(), count, dtype, ReduceOp::kSum));
    for (int64_t i = 0; i < count; ++i) {
      const float a = to(from(1.0f + i * 0.37f));
      const float b = to(from(0.001f * (i + 1)));
      if (out[i] != from(a + b)) {
        CHECK_TRUE(false, "%s rounding element %ld: got %g want %g",
                   DataTypeName(dtype), static_cast<long>(i), to(out[i]),
                   to(from(a + b)));
        break;
      }
    }
    // In place.
    for (int64_t i = 0; i < count; ++i) in[i] = from(1.5f);
    CHECK_OK(t->Allreduce(in.data(), in.data(), count, dtype, ReduceOp::kSum));
    CHECK_TRUE(to(in[5]) == 3.0f, "in-place got %g", to(in[5]));
  }
}

void CheckBool(Transport* t) {
  const int n = t->size();
  const int r = t->rank();
  const int64_t count = 64;
  std::vector<uint8_t> in(count), out(count);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin,
                      ReduceOp::kProduct}) {
    const bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMax;
    // OR: true where some rank has i % (n+1) == rank; AND: true where every
    // rank has i % (n+1) != rank, i.e. i % (n+1) == n.
    for (int64_t i = 0; i < count; ++i) {
      in[i] = is_or ? (i % (n + 1) == r) : (i % (n + 1) != r);
    }
    CHECK_OK(t->Allreduce(in.data(), out.data(), count, DataType::kBool, op));
    for (int64_t i = 0; i < count; ++i) {
      const bool want = is_or ? (i % (n + 1) < n) : (i % (n + 1) == n);
      CHECK_TRUE((out[i] != 0) == want, "bool %s element %ld",
                 ReduceOpName(op), static_cast<long>(i));
    }
  }
}

template <typename T>
void CheckNative(Transport* t, DataType dtype) {
  const int n = t->size();
  const int r = t->rank();
  const int64_t count = 100;
  std::vector<T> in(count), out(count);
  for (int64_t i = 0; i < count; ++i) in[i] = static_cast<T>((i % 9) + r);
  CHECK_OK(t->Allreduce(in.data(), out.data(), count, dtype, ReduceOp::kSum));
  CHECK_OK(t->Allreduce(in.data(), in.data(), count, dtype, ReduceOp::kMax));
  for (int64_t i = 0; i < count; ++i) {
    CHECK_TRUE(out[i] == static_cast<T>((i % 9) * n + n * (n - 1) / 2),
               "%s sum element %ld", DataTypeName(dtype), static_cast<long>(i));
    CHECK_TRUE(in[i] == static_cast<T>((i % 9) + n - 1), "%s max",
               DataTypeName(dtype));
  }
}

// More elements than a C int (an MPI count) holds: the transport splits
// them.  On one host the data plane hands it pieces (HostPlane), so only
// this check reaches the split there.  Each rank's buffer holds one value,
// so a part skipped or reduced twice changes the minimum or maximum.  About
// 2 GiB per rank: np 2 only.
void CheckCountAboveIntRange(Transport* t) {
  if (t->size() != 2) return;
  const int64_t count = int64_t{INT_MAX} + 1031;
  std::vector<uint8_t> data(count, static_cast<uint8_t>(t->rank() + 1));
  CHECK_OK(t->Allreduce(data.data(), data.data(), count, DataType::kUint8,
                        ReduceOp::kSum));
  const auto [lo, hi] = std::minmax_element(data.begin(), data.end());
  CHECK_TRUE(*lo == 3 && *hi == 3, "allreduce above INT_MAX: min %d max %d",
             *lo, *hi);
}

void CheckControlAndData(Transport* t) {
  const int n = t->size();
  const int r = t->rank();
  std::vector<uint64_t> bits = {~0ull ^ (1ull << r), 0xffull, 1ull << 63};
  CHECK_OK(t->BitwiseAnd(&bits));
  uint64_t want0 = ~0ull;
  for (int q = 0; q < n; ++q) want0 ^= 1ull << q;
  CHECK_TRUE(bits[0] == want0 && bits[1] == 0xff && bits[2] == 1ull << 63,
             "BitwiseAnd");
  std::vector<std::string> all;
  CHECK_OK(t->GatherBytes(std::string(r + 1, static_cast<char>('a' + r)), &all));
  if (r == 0) {
    CHECK_TRUE(static_cast<int>(all.size()) == n, "gather size");
    for (int q = 0; q < n && q < static_cast<int>(all.size()); ++q) {
      CHECK_TRUE(all[q] == std::string(q + 1, static_cast<char>('a' + q)),
                 "gather %d", q);
    }
  } else {
    CHECK_TRUE(all.empty(), "gather on non-root");
  }
  std::string b = r == 0 ? std::string("hello from rank 0") : std::string("x");
  CHECK_OK(t->BroadcastBytes(&b));
  CHECK_TRUE(b == "hello from rank 0", "BroadcastBytes got %s", b.c_str());
  // Reducescatter: rows split 1 extra on rank 0.
  std::vector<int64_t> counts(n, 2);
  counts[0] = 3;
  int64_t total = 2 * n + 1;
  std::vector<float> in(total), out(counts[r]);
  for (int64_t i = 0; i < total; ++i) in[i] = static_cast<float>(i * (r + 1));
  CHECK_OK(t->Reducescatter(in.data(), out.data(), counts, DataType::kFloat32,
                            ReduceOp::kSum));
  const int64_t offset = r == 0 ? 0 : 3 + 2 * (r - 1);
  for (int64_t i = 0; i < counts[r]; ++i) {
    CHECK_TRUE(out[i] == static_cast<float>((offset + i) * n * (n + 1) / 2),
               "reducescatter %ld", static_cast<long>(i));
  }
  CHECK_OK(t->Barrier());
}

// The engine end to end over MPI.
// An engine over MPI_COMM_WORLD with `config`, or null after a failed check.
std::unique_ptr<Engine> StartEngine(const EngineConfig& config) {
  std::unique_ptr<Transport> transport;
  CHECK_OK(MpiTransport::Create(MPI_COMM_WORLD, &transport));
  if (!transport) return nullptr;
  std::unique_ptr<Engine> engine;
  CHECK_OK(Engine::Create(config, std::move(transport), &engine));
  return engine;
}

void CheckEngine(int round) {
  EngineConfig config;
  config.fusion_threshold_bytes = 1 << 20;
  std::unique_ptr<Engine> engine = StartEngine(config);
  if (!engine) return;
  const int n = engine->size();
  const int r = engine->rank();
  for (int it = 0; it < 20; ++it) {
    std::vector<std::vector<float>> ins(10), outs(10);
    std::vector<std::future<Status>> fs;
    for (int k = 0; k < 10; ++k) {
      const int idx = (k + r * 3) % 10;  // different order per rank
      ins[idx].assign(100 + idx, static_cast<float>(r + idx + round));
      outs[idx].assign(100 + idx, -1.0f);
      auto p = std::make_shared<std::promise<Status>>();
      fs.push_back(p->get_future());
      TensorEntry e;
      e.name = "t" + std::to_string(idx);
      e.dtype = DataType::kFloat32;
      e.shape = {100 + idx};
      e.reduce_op = idx % 2 ? ReduceOp::kMean : ReduceOp::kSum;
      e.input = ins[idx].data();
      e.output = outs[idx].data();
      e.done = [p](const Status& s) { p->set_value(s); };
      engine->Enqueue(std::move(e));
    }
    for (auto& f : fs) CHECK_OK(f.get());
    for (int idx = 0; idx < 10; ++idx) {
      const float sum = static_cast<float>(n * (idx + round) + n * (n - 1) / 2);
      const float want = idx % 2 ? sum / n : sum;
      CHECK_TRUE(outs[idx][0] == want && outs[idx].back() == want,
                 "engine round %d tensor %d got %g want %g", round, idx,
                 outs[idx][0], want);
    }
  }
  // Allgather with rank-dependent rows.
  {
    std::vector<int64_t> in(r + 1, r);
    std::vector<int64_t> out;
    Shape out_shape;
    auto p = std::make_shared<std::promise<Status>>();
    auto f = p->get_future();
    TensorEntry e;
    e.type = CollectiveType::kAllgather;
    e.name = "gather";
    e.dtype = DataType::kInt64;
    e.shape = {r + 1};
    e.input = in.data();
    e.allocate_output = [&](const Shape& s, void** data) {
      out_shape = s;
      out.assign(NumElements(s), -1);
      *data = out.data();
      return Status::Ok();
    };
    e.done = [p](const Status& s) { p->set_value(s); };
    engine->Enqueue(std::move(e));
    CHECK_OK(f.get());
    CHECK_TRUE(out_shape == Shape{n * (n + 1) / 2}, "allgather shape");
    size_t k = 0;
    for (int q = 0; q < n; ++q) {
      for (int j = 0; j <= q && k < out.size(); ++j, ++k) {
        CHECK_TRUE(out[k] == q, "allgather element %zu", k);
      }
    }
  }
  const EngineStats stats = engine->stats();
  CHECK_TRUE(stats.fast_responses > 0, "fast path never taken");
  engine.reset();  // shutdown cycle with every rank
}

// Where an allreduce completed: on the thread that enqueued it, before
// Enqueue returned, or on another thread, and then on which.
struct Completion {
  std::promise<Status> promise;
  std::thread::id thread;
  char thread_name[16] = {0};
  std::atomic<bool> enqueue_returned{false};
  bool before_enqueue_returned = false;
};

// Enqueues a float32 SUM allreduce `name` of `count` elements, each rank
// r + 1; waits for it and checks the sum.  Returns how it completed.
std::unique_ptr<Completion> AllreduceOnce(Engine* engine,
                                          const std::string& name,
                                          int64_t count, double* enqueue_ms) {
  const int n = engine->size();
  std::vector<float> in(count, static_cast<float>(engine->rank() + 1));
  std::vector<float> out(count, -1.0f);
  auto c = std::make_unique<Completion>();
  Completion* raw = c.get();
  TensorEntry e;
  e.name = name;
  e.dtype = DataType::kFloat32;
  e.shape = {count};
  e.input = in.data();
  e.output = out.data();
  e.done = [raw](const Status& s) {
    raw->thread = std::this_thread::get_id();
    pthread_getname_np(pthread_self(), raw->thread_name,
                       sizeof(raw->thread_name));
    raw->before_enqueue_returned = !raw->enqueue_returned.load();
    raw->promise.set_value(s);
  };
  std::future<Status> f = c->promise.get_future();
  const auto start = std::chrono::steady_clock::now();
  engine->Enqueue(std::move(e));
  c->enqueue_returned = true;
  if (enqueue_ms != nullptr) {
    *enqueue_ms = std::chrono::duration<double, std::milli>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  }
  CHECK_OK(f.get());
  const float want = static_cast<float>(n * (n + 1) / 2);
  CHECK_TRUE(out[0] == want && out[count - 1] == want, "%s got %g want %g",
             name.c_str(), out[0], want);
  return c;
}

// A grouped allreduce whose kernel left the packing to the engine
// (TensorEntry::packed_inputs) on the data plane `plane`: shared memory
// reduces the tensors from where they are, MPI after the engine packed
// them.  Odd sizes leave gaps; one group is over shared memory's
// one-barrier limit (16 KB), one under it; a plain tensor is fused beside
// each.  Every tensor must land at its packed offset with the inputs
// untouched (and, on MPI, the gaps zero), and at np 2 the planes must agree
// bit for bit (`bits`: empty on the first call, compared on the next).
// With `own_outputs` (shared memory only) each tensor has an output of its
// own instead (TensorEntry::packed_outputs), every other one its input (in
// place, as when the kernel forwards it); the others' inputs stay as they
// were.
void CheckPackedInputs(HostDataPlane plane, bool own_outputs,
                       std::vector<float>* bits) {
  EngineConfig config;
  config.data_plane = plane;
  config.fusion_threshold_bytes = 1 << 20;
  std::unique_ptr<Engine> engine = StartEngine(config);
  if (!engine) return;
  const int n = engine->size();
  const int r = engine->rank();
  // Set by the engine thread once its plane is up: after a collective.
  AllreduceOnce(engine.get(), "packed-inputs/warm-up", 4, nullptr);
  CHECK_TRUE(engine->cpu_plane_reduces_parts() ==
                 (plane == HostDataPlane::kShm),
             "%s: cpu_plane_reduces_parts() is %d", HostDataPlaneName(plane),
             engine->cpu_plane_reduces_parts());
  const std::vector<std::vector<Shape>> groups = {
      {{3}, {0}, {17, 5}, {}, {6001}, {1}},  // 24 KB
      {{5}, {7, 2}, {0}, {9}}};              // under 1 KB
  std::vector<float> results;
  int round = 0;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
    for (const std::vector<Shape>& shapes : groups) {
      ++round;
      const std::vector<DataType> dtypes(shapes.size(), DataType::kFloat32);
      const PackedLayout layout = PackedGroupLayout(dtypes, shapes);
      std::vector<std::vector<float>> ins;
      for (size_t k = 0; k < shapes.size(); ++k) {
        ins.emplace_back(NumElements(shapes[k]));
        for (size_t i = 0; i < ins[k].size(); ++i) {
          ins[k][i] = static_cast<float>(r + k + 0.5 * i) / 3.0f;
        }
      }
      const std::vector<std::vector<float>> originals = ins;
      std::vector<float> out(layout.total_bytes / 4, std::nanf(""));
      // own_outputs: tensor k's output (odd k: a buffer of its own).
      std::vector<std::vector<float>> own(shapes.size());
      auto output_of = [&](size_t k) -> float* {
        return k % 2 == 0 ? ins[k].data() : own[k].data();
      };
      std::vector<float> plain_in(100, static_cast<float>(r));
      std::vector<float> plain_out(100, -1.0f);
      std::vector<TensorEntry> entries(2);
      TensorEntry& g = entries[0];
      g.name = "packed-inputs/" + std::to_string(round);
      g.dtype = DataType::kFloat32;
      g.shape = {static_cast<int64_t>(out.size())};
      g.reduce_op = op;
      g.packed_shapes = shapes;
      for (std::vector<float>& in : ins) {
        g.packed_inputs.push_back(in.empty() ? nullptr : in.data());
      }
      g.output = out.data();
      if (own_outputs) {
        g.output = nullptr;
        for (size_t k = 0; k < shapes.size(); ++k) {
          own[k].assign(ins[k].size(), std::nanf(""));
          g.packed_outputs.push_back(ins[k].empty() ? nullptr : output_of(k));
        }
      }
      TensorEntry& p = entries[1];
      p.name = "packed-inputs/plain/" + std::to_string(round);
      p.dtype = DataType::kFloat32;
      p.shape = {100};
      p.reduce_op = op;
      p.input = plain_in.data();
      p.output = plain_out.data();
      std::vector<std::future<Status>> fs;
      for (TensorEntry& e : entries) {
        auto promise = std::make_shared<std::promise<Status>>();
        fs.push_back(promise->get_future());
        e.done = [promise](const Status& s) { promise->set_value(s); };
      }
      engine->EnqueueGroup(std::move(entries));
      for (auto& f : fs) CHECK_OK(f.get());
      std::vector<bool> covered(out.size(), false);
      for (size_t k = 0; k < shapes.size(); ++k) {
        const int64_t at = layout.byte_offsets[k] / 4;
        for (size_t i = 0; i < ins[k].size(); ++i) {
          covered[at + i] = true;
          double want = 0;
          for (int q = 0; q < n; ++q) {
            const double v = (q + k + 0.5 * i) / 3.0;
            want = op == ReduceOp::kMax ? std::max(want, v) : want + v;
          }
          if (op == ReduceOp::kMean) want /= n;
          const float got = own_outputs ? output_of(k)[i] : out[at + i];
          CHECK_TRUE(std::fabs(got - want) <= 1e-5 * (1 + want),
                     "%s%s round %d tensor %zu element %zu: got %g want %g",
                     HostDataPlaneName(plane), own_outputs ? " own" : "",
                     round, k, i, got, want);
          if (own_outputs) results.push_back(got);
        }
      }
      if (own_outputs) {
        // The inputs not reduced in place stay as they were.
        for (size_t k = 1; k < shapes.size(); k += 2) {
          CHECK_TRUE(ins[k] == originals[k],
                     "own outputs round %d: input %zu changed", round, k);
        }
      }
      for (size_t i = 0; i < out.size() && !own_outputs; ++i) {
        // The engine packs the tensors for MPI, zeroing the gaps it reduces
        // with them; shared memory reduces only the tensors.
        const float gap = plane == HostDataPlane::kMpi ? 0.0f : out[i];
        CHECK_TRUE(covered[i] || std::memcmp(&out[i], &gap, 4) == 0,
                   "%s round %d: gap element %zu is %g",
                   HostDataPlaneName(plane), round, i, out[i]);
        if (covered[i]) results.push_back(out[i]);
      }
      CHECK_TRUE(own_outputs || ins == originals,
                 "%s round %d: an input changed", HostDataPlaneName(plane),
                 round);
      const float plain_want =
          op == ReduceOp::kMax    ? n - 1.0f
          : op == ReduceOp::kMean ? (n - 1) / 2.0f
                                  : n * (n - 1) / 2.0f;
      CHECK_TRUE(plain_out[0] == plain_want && plain_out[99] == plain_want,
                 "%s round %d: fused plain tensor got %g want %g",
                 HostDataPlaneName(plane), round, plain_out[0], plain_want);
    }
  }
  if (bits->empty()) {
    *bits = results;
  } else if (n == 2) {  // MPI may add 3 ranks' values in another order
    CHECK_TRUE(std::memcmp(bits->data(), results.data(),
                           results.size() * sizeof(float)) == 0 &&
                   bits->size() == results.size(),
               "packed inputs: %s differs from the first plane's bits",
               HostDataPlaneName(plane));
  }
  engine.reset();
}

// The state letter of /proc/<pid>/stat ('T': stopped), or '?'.
char ProcessState(int pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return '?';
  char line[512] = {0};
  const size_t got = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  const char* paren = std::strrchr(line, ')');
  return got > 0 && paren != nullptr && paren[1] == ' ' ? paren[2] : '?';
}

constexpr int kInlineRounds = 200;

// Small cached allreduces whose peers are ready complete on the thread
// that enqueued them; a late peer or a large allreduce leaves the work to
// the engine thread, and Enqueue does not wait for the late peer.
//
// Runs kInlineRounds small cached allreduces, each after an MPI barrier
// (peers ready), and returns the fewest that completed on the enqueuing
// thread on any rank.  Checks that each completed on that thread, within
// Enqueue, or on the engine thread.
int InlineCompletions(Engine* engine) {
  const auto me = std::this_thread::get_id();
  AllreduceOnce(engine, "small", 16, nullptr);  // first: slow path
  int here = 0;
  for (int i = 0; i < kInlineRounds; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto c = AllreduceOnce(engine, "small", 16, nullptr);
    if (c->thread == me) {
      ++here;
      CHECK_TRUE(c->before_enqueue_returned,
                 "done ran on the enqueuing thread after Enqueue returned");
    } else {
      CHECK_TRUE(std::strcmp(c->thread_name, "mpistrategy") == 0,
                 "done ran on thread \"%s\"", c->thread_name);
    }
  }
  int fewest = 0;
  MPI_Allreduce(&here, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  std::printf("rank %d: %d of %d small allreduces completed on the "
              "enqueuing thread\n", engine->rank(), here, kInlineRounds);
  return fewest;
}

void CheckCyclesOnTheEnqueuingThread() {
  // No idle cycles between the rounds (a submission still wakes the engine
  // thread at once).  Each round's `done` wakes this thread, which then
  // enqueues the next allreduce while, on two cores, the thread that called
  // `done` may not have run again yet: it must have left its cycle before
  // calling it, or the engine threads keep every cycle from then on (the
  // engine held its cycle lock through the last bucket's `done`s until
  // 2026-12-05; then 6 of 12 np-2 runs here had a rank under a quarter,
  // against none of 35 np-2 runs since, 5 of them beside two busy loops).
  // A rank whose op thread reaches the rendezvous 50 us before its peers'
  // leaves its round to the engine thread, so each rank is asked for a
  // quarter of the rounds, not all; a tenth where the ranks outnumber the
  // cores and wait for each other to be scheduled (np 3 on two cores: 56
  // to 200 here).
  EngineConfig config;
  config.cycle_time_ms = 1000.0;
  std::unique_ptr<Engine> engine = StartEngine(config);
  if (!engine) return;
  const int fewest = InlineCompletions(engine.get());
  const bool crowded = static_cast<unsigned>(engine->size()) >
                       std::thread::hardware_concurrency();
  const int want = kInlineRounds / (crowded ? 10 : 4);
  CHECK_TRUE(fewest >= want,
             "a rank completed %d of %d small allreduces on the enqueuing "
             "thread (want at least %d)", fewest, kInlineRounds, want);
  const int r = engine->rank();
  const auto me = std::this_thread::get_id();

  // Large (1 MiB > the op-thread limit): always the engine thread.
  AllreduceOnce(engine.get(), "large", 1 << 18, nullptr);
  for (int i = 0; i < 20; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto c = AllreduceOnce(engine.get(), "large", 1 << 18, nullptr);
    CHECK_TRUE(c->thread != me && std::strcmp(c->thread_name,
                                              "mpistrategy") == 0,
               "large allreduce completed on thread \"%s\"",
               c->thread_name);
  }

  // A frozen peer: the other ranks stop themselves (SIGSTOP) and rank 0
  // continues them 500 ms later.  Rank 0's Enqueue returns without waiting
  // for them; the allreduce completes once they are back.
  std::vector<int> pids(engine->size());
  int my_pid = static_cast<int>(getpid());
  MPI_Allgather(&my_pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  if (r != 0) {
    raise(SIGSTOP);
    AllreduceOnce(engine.get(), "small", 16, nullptr);
  } else {
    for (size_t q = 1; q < pids.size(); ++q) {
      bool stopped = false;
      for (int i = 0; i < 1000 && !stopped; ++i) {
        stopped = ProcessState(pids[q]) == 'T';
        if (!stopped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      CHECK_TRUE(stopped, "rank %zu did not stop itself", q);
    }
    std::thread waker([&pids] {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      for (size_t q = 1; q < pids.size(); ++q) kill(pids[q], SIGCONT);
    });
    double enqueue_ms = 0;
    auto c = AllreduceOnce(engine.get(), "small", 16, &enqueue_ms);
    waker.join();
    CHECK_TRUE(enqueue_ms < 100.0,
               "Enqueue took %.1f ms while the peers were stopped",
               enqueue_ms);
    CHECK_TRUE(c->thread != me, "completed on the enqueuing thread");
  }

  // `done` enqueues the next allreduce on the thread it runs on (as TF does
  // when it continues a graph): a chain of 100, each result checked.
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<float> in(16), out(16);
  std::promise<Status> chain_end;
  std::function<void(int)> next;
  int failures = 0;
  next = [&](int i) {
    std::fill(in.begin(), in.end(), static_cast<float>(r + i));
    TensorEntry e;
    e.name = "chain";
    e.dtype = DataType::kFloat32;
    e.shape = {16};
    e.input = in.data();
    e.output = out.data();
    e.done = [&, i](const Status& s) {
      const int n = engine->size();
      const float want = static_cast<float>(n * i + n * (n - 1) / 2);
      if (!s.ok() || out[0] != want || out[15] != want) ++failures;
      if (!s.ok() || i == 99) {
        chain_end.set_value(s);
      } else {
        next(i + 1);
      }
    };
    engine->Enqueue(std::move(e));
  };
  std::future<Status> chain_done = chain_end.get_future();
  next(0);
  CHECK_OK(chain_done.get());
  CHECK_TRUE(failures == 0, "%d wrong results in the chain", failures);
  engine.reset();
}

int Main() {
  bool we_initialized = false;
  int provided = 0;
  Status s = EnsureMpiInitialized(&we_initialized, &provided);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  CHECK_TRUE(provided == MPI_THREAD_MULTIPLE, "provided thread level %d",
             provided);
  std::unique_ptr<Transport> t;
  CHECK_OK(MpiTransport::Create(MPI_COMM_WORLD, &t));
  if (t) {
    g_check_rank = t->rank();
    CHECK_TRUE(t->local_size() >= 1 && t->local_rank() < t->local_size(),
               "local rank");
    CheckHalf(t.get(), DataType::kFloat16, HalfToFloat, FloatToHalf);
    CheckHalf(t.get(), DataType::kBFloat16, BFloat16ToFloat, FloatToBFloat16);
    CheckBool(t.get());
    CheckNative<uint8_t>(t.get(), DataType::kUint8);
    CheckNative<int8_t>(t.get(), DataType::kInt8);
    CheckNative<int32_t>(t.get(), DataType::kInt32);
    CheckNative<int64_t>(t.get(), DataType::kInt64);
    CheckNative<float>(t.get(), DataType::kFloat32);
    CheckNative<double>(t.get(), DataType::kFloat64);
    CheckControlAndData(t.get());
    CheckCountAboveIntRange(t.get());
    t.reset();
  }
  // Engine twice: re-creation after destruction.
  CheckEngine(0);
  CheckEngine(1);
  CheckCyclesOnTheEnqueuingThread();
  std::vector<float> packed_bits;
  CheckPackedInputs(HostDataPlane::kShm, false, &packed_bits);
  CheckPackedInputs(HostDataPlane::kMpi, false, &packed_bits);
  CheckPackedInputs(HostDataPlane::kShm, true, &packed_bits);
  std::printf("rank %d: %s\n", g_check_rank,
              g_check_failures == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);
  FinalizeMpiIfWeInitialized();
  return g_check_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mpistrategy

int main() { return mpistrategy::Main(); }
