// The host-staging and hierarchical data planes on a fake device (host
// memory, a stream that runs its work later on its own thread) in an
// in-process world of N ranks.  Every collective's result is checked
// element by element on every rank; the fake stream's delay makes the host
// race ahead of it, so a missing synchronisation shows up as wrong data.

#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cc/common/common.h"
#include "cc/common/stream.h"
#include "cc/device/fake_device.h"
#include "cc/transport/fake_transport.h"
#include "cc/transport/hierarchical_plane.h"
#include "cc/transport/host_plane.h"
#include "cc/transport/staging_plane.h"

namespace mpistrategy {
namespace {

// Rank 0's stream runs at once, the others' late: a rank that reuses memory
// a pending copy still reads, or reads before synchronising, sees wrong
// values.
int DelayUs(int rank) { return rank == 0 ? 0 : 2000; }

template <typename Fn>
void OnEveryRank(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

// The planes of one rank: host staging over all ranks, or hierarchical
// with `per_host` ranks on each simulated host.
struct Worlds {
  Worlds(int n, int per_host) : n(n), per_host(per_host) {
    world = FakeWorld::Create(n, per_host, 30.0);
    if (per_host > 0) {
      for (int h = 0; h < n / per_host; ++h) {
        local.push_back(FakeWorld::Create(per_host, per_host, 30.0));
      }
      for (int l = 0; l < per_host; ++l) {
        cross.push_back(FakeWorld::Create(n / per_host, 1, 30.0));
      }
    }
  }

  std::unique_ptr<DataPlane> Plane(int rank) {
    auto staging = [](std::unique_ptr<Transport> t, int64_t divisor) {
      return std::unique_ptr<DataPlane>(new StagingPlane(
          std::make_unique<HostPlane>(std::move(t)), divisor));
    };
    std::unique_ptr<DataPlane> all = staging(world->CreateTransport(rank), 0);
    if (per_host == 0) return all;
    const int host = rank / per_host;
    const int local_rank = rank % per_host;
    return std::unique_ptr<DataPlane>(new HierarchicalPlane(
        std::move(all), staging(local[host]->CreateTransport(local_rank), 0),
        staging(cross[local_rank]->CreateTransport(host), n)));
  }

  int n;
  int per_host;
  std::shared_ptr<FakeWorld> world;
  std::vector<std::shared_ptr<FakeWorld>> local;
  std::vector<std::shared_ptr<FakeWorld>> cross;
};

// A device buffer of `count` floats on `stream`.
float* DeviceFloats(FakeStream* stream, int64_t count,
                    std::shared_ptr<void>* holder) {
  EXPECT_TRUE(stream->Allocate(count * 4 + 4, holder).ok());
  return static_cast<float*>(holder->get());
}

// Writes `values` into device memory through the stream (as a kernel would),
// so the plane must wait for the stream before it reads them.
void Fill(FakeStream* stream, float* device, std::vector<float> values) {
  stream->Enqueue([device, values] {
    std::memcpy(device, values.data(), values.size() * sizeof(float));
  });
}

std::vector<float> Read(FakeStream* stream, const float* device,
                        int64_t count) {
  EXPECT_TRUE(stream->Synchronize().ok());
  return std::vector<float>(device, device + count);
}

void CheckEveryCollective(int n, int per_host) {
  Worlds worlds(n, per_host);
  OnEveryRank(n, [&](int rank) {
    FakeStream stream(DelayUs(rank));
    std::unique_ptr<DataPlane> plane = worlds.Plane(rank);
    ASSERT_EQ(plane->rank(), rank);
    ASSERT_EQ(plane->size(), n);
    for (int round = 0; round < 3; ++round) {
      // Allreduce: sum and mean, out of place and in place, with counts that
      // are and are not multiples of the ranks per host.
      for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{12}, int64_t{1000}}) {
        std::shared_ptr<void> in_holder;
        std::shared_ptr<void> out_holder;
        float* in = DeviceFloats(&stream, count, &in_holder);
        float* out = DeviceFloats(&stream, count, &out_holder);
        std::vector<float> values(count);
        for (int64_t i = 0; i < count; ++i) values[i] = rank * 1000 + i + round;
        Fill(&stream, in, values);
        ASSERT_TRUE(plane->Allreduce(in, out, count, DataType::kFloat32,
                                     ReduceOp::kSum, &stream).ok());
        // In place, mean, right after: reuses the staging buffer.
        ASSERT_TRUE(plane->Allreduce(in, in, count, DataType::kFloat32,
                                     ReduceOp::kMean, &stream).ok());
        std::vector<float> sum = Read(&stream, out, count);
        std::vector<float> mean = Read(&stream, in, count);
        const float rank_sum = 1000.0f * n * (n - 1) / 2;
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(sum[i], rank_sum + n * (i + round)) << "count " << count;
          ASSERT_FLOAT_EQ(mean[i], (rank_sum + n * (i + round)) / n);
        }
      }
      // Allgatherv: rank r contributes r + 1 floats.
      {
        const int64_t mine = rank + 1;
        std::vector<int64_t> bytes(n);
        int64_t total = 0;
        for (int r = 0; r < n; ++r) total += (bytes[r] = (r + 1) * 4) / 4;
        std::shared_ptr<void> h1, h2;
        float* in = DeviceFloats(&stream, mine, &h1);
        float* out = DeviceFloats(&stream, total, &h2);
        std::vector<float> values(mine);
        for (int64_t i = 0; i < mine; ++i) values[i] = 10 * rank + i + round;
        Fill(&stream, in, values);
        ASSERT_TRUE(plane->Allgatherv(in, out, bytes, &stream).ok());
        // At once a broadcast, which on the other ranks receives into the
        // staging buffer while the copy-back of the allgather may still be
        // pending.
        std::shared_ptr<void> h3;
        float* b = DeviceFloats(&stream, total, &h3);
        Fill(&stream, b, std::vector<float>(total, -1.0f - rank));
        ASSERT_TRUE(plane->Broadcast(b, total * 4, 0, &stream).ok());
        std::vector<float> got = Read(&stream, out, total);
        for (float v : Read(&stream, b, total)) ASSERT_EQ(v, -1.0f);
        int64_t k = 0;
        for (int r = 0; r < n; ++r) {
          for (int64_t i = 0; i <= r; ++i, ++k) {
            ASSERT_EQ(got[k], 10 * r + i + round);
          }
        }
      }
      // Broadcast from the last rank.
      {
        std::shared_ptr<void> h;
        float* buffer = DeviceFloats(&stream, 5, &h);
        Fill(&stream, buffer, std::vector<float>(5, rank + 0.5f + round));
        ASSERT_TRUE(plane->Broadcast(buffer, 5 * 4, n - 1, &stream).ok());
        for (float v : Read(&stream, buffer, 5)) ASSERT_EQ(v, n - 0.5f + round);
      }
      // Reducescatter: block r has r + 1 elements; mean.
      {
        std::vector<int64_t> counts(n);
        int64_t total = 0;
        int64_t offset = 0;
        for (int r = 0; r < n; ++r) {
          counts[r] = r + 1;
          if (r < rank) offset += counts[r];
          total += counts[r];
        }
        std::shared_ptr<void> h1, h2;
        float* in = DeviceFloats(&stream, total, &h1);
        float* out = DeviceFloats(&stream, counts[rank], &h2);
        std::vector<float> values(total);
        for (int64_t i = 0; i < total; ++i) values[i] = 2.0f * (i + rank + round);
        Fill(&stream, in, values);
        ASSERT_TRUE(plane->Reducescatter(in, out, counts, DataType::kFloat32,
                                         ReduceOp::kMean, &stream).ok());
        std::vector<float> got = Read(&stream, out, counts[rank]);
        for (int64_t i = 0; i < counts[rank]; ++i) {
          // mean over r of 2 (offset + i + r + round)
          ASSERT_FLOAT_EQ(got[i], 2.0f * (offset + i + round) + (n - 1));
        }
      }
      // Alltoallv: rank r sends j + 1 floats to rank j.
      {
        std::vector<int64_t> send(n), recv(n);
        int64_t send_total = 0;
        int64_t recv_total = 0;
        for (int j = 0; j < n; ++j) {
          send[j] = (j + 1) * 4;
          recv[j] = (rank + 1) * 4;
          send_total += j + 1;
          recv_total += rank + 1;
        }
        std::shared_ptr<void> h1, h2;
        float* in = DeviceFloats(&stream, send_total, &h1);
        float* out = DeviceFloats(&stream, recv_total, &h2);
        std::vector<float> values;
        for (int j = 0; j < n; ++j) {
          for (int i = 0; i <= j; ++i) values.push_back(100 * rank + 10 * j + i);
        }
        Fill(&stream, in, values);
        ASSERT_TRUE(plane->Alltoallv(in, send, out, recv, &stream).ok());
        std::vector<float> got = Read(&stream, out, recv_total);
        int64_t k = 0;
        for (int r = 0; r < n; ++r) {
          for (int i = 0; i <= rank; ++i, ++k) {
            ASSERT_EQ(got[k], 100 * r + 10 * rank + i);
          }
        }
      }
    }
  });
}

TEST(StagingPlane, EveryCollective2Ranks) { CheckEveryCollective(2, 0); }
TEST(StagingPlane, EveryCollective3Ranks) { CheckEveryCollective(3, 0); }
TEST(HierarchicalPlane, TwoHostsOfTwo) { CheckEveryCollective(4, 2); }
TEST(HierarchicalPlane, TwoHostsOfThree) { CheckEveryCollective(6, 3); }
TEST(HierarchicalPlane, ThreeHostsOfTwo) { CheckEveryCollective(6, 2); }
TEST(HierarchicalPlane, OneRankPerHost) { CheckEveryCollective(3, 1); }

TEST(HostPlane, RefusesDeviceStreams) {
  auto world = FakeWorld::Create(1);
  HostPlane plane(world->CreateTransport(0));
  FakeStream stream;
  float x = 1;
  Status s = plane.Allreduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum,
                             &stream);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
}

// Ranks on one host: Allreduce goes to the transport in pieces.  Counts
// across several pieces with a remainder, in place and out of place, sum and
// mean; a piece that is skipped, repeated or misplaced changes an element.
TEST(HostPlane, OneHostAllreducesInPieces) {
  const int n = 3;
  auto world = FakeWorld::Create(n, n);
  const int64_t piece = HostPlane::kOneHostPieceBytes / 4;
  OnEveryRank(n, [&](int rank) {
    HostPlane plane(world->CreateTransport(rank));
    HostStream stream;
    for (int64_t count : {piece - 1, piece, 2 * piece + 7}) {
      std::vector<float> in(count);
      for (int64_t i = 0; i < count; ++i) in[i] = rank * 1000 + i % 997;
      std::vector<float> sum(count);
      ASSERT_TRUE(plane.Allreduce(in.data(), sum.data(), count,
                                  DataType::kFloat32, ReduceOp::kSum, &stream)
                      .ok());
      ASSERT_TRUE(plane.Allreduce(in.data(), in.data(), count,
                                  DataType::kFloat32, ReduceOp::kMean, &stream)
                      .ok());
      for (int64_t i = 0; i < count; ++i) {
        const float want = 3000.0f + n * (i % 997);
        ASSERT_EQ(sum[i], want) << "count " << count << " element " << i;
        ASSERT_FLOAT_EQ(in[i], want / n) << "count " << count << " element "
                                         << i;
      }
    }
    // Eight-byte elements: pieces of half as many elements.
    const int64_t count = HostPlane::kOneHostPieceBytes / 8 * 3 + 1;
    std::vector<int64_t> values(count);
    for (int64_t i = 0; i < count; ++i) values[i] = (rank + 1) * i;
    ASSERT_TRUE(plane.Allreduce(values.data(), values.data(), count,
                                DataType::kInt64, ReduceOp::kMax, &stream)
                    .ok());
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(values[i], n * i);
  });
}

// The fake stream itself: work runs later and in order; events order two
// streams; a freed buffer outlives the work enqueued before.
TEST(FakeStream, RunsInOrderAndEventsJoinStreams) {
  FakeStream a(1000);
  FakeStream b;
  int value = 0;
  a.Enqueue([&value] { value = 1; });
  std::unique_ptr<Event> e;
  ASSERT_TRUE(a.NewEvent(&e).ok());
  ASSERT_TRUE(a.Record(e.get()).ok());
  ASSERT_TRUE(b.Wait(e.get()).ok());
  int seen = -1;
  b.Enqueue([&value, &seen] { seen = value; });
  ASSERT_TRUE(b.Synchronize().ok());
  EXPECT_EQ(seen, 1);
}

}  // namespace
}  // namespace mpistrategy
