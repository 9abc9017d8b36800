// The host-staging and hierarchical data planes on a fake device (host
// memory, a stream that runs its work later on its own thread) in an
// in-process world of N ranks.  Every collective's result is checked
// element by element on every rank; the fake stream's delay makes the host
// race ahead of it, so a missing synchronisation shows up as wrong data.

#include <algorithm>
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
// with hosts[h] ranks on simulated host h (world ranks numbered host by
// host).  As MpiTransport::CreateHostPlane splits them: a local world per
// host, and per local rank l a cross world of the hosts that have rank l.
struct Worlds {
  Worlds(std::vector<int> hosts, HierarchicalPlane::CrossHost cross_host)
      : hosts(hosts), cross_host(cross_host) {
    n = 0;
    int most = 0;
    for (int h = 0; h < static_cast<int>(hosts.size()); ++h) {
      local.push_back(FakeWorld::Create(hosts[h], hosts[h], 30.0));
      for (int l = 0; l < hosts[h]; ++l) {
        host_of.push_back(h);
        local_rank_of.push_back(l);
      }
      n += hosts[h];
      most = std::max(most, hosts[h]);
    }
    for (int l = 0; l < most; ++l) {
      int with_l = 0;
      for (int size : hosts) with_l += size > l ? 1 : 0;
      cross.push_back(FakeWorld::Create(with_l, 1, 30.0));
    }
    const bool even = most > 0 && n == most * static_cast<int>(hosts.size());
    world = FakeWorld::Create(n, even ? most : 1, 30.0);
  }
  // Staging over `n` ranks, no hosts.
  explicit Worlds(int n) : n(n), world(FakeWorld::Create(n, 0, 30.0)) {}

  std::unique_ptr<DataPlane> Plane(int rank) {
    auto staging = [](std::unique_ptr<Transport> t, int64_t divisor) {
      return std::unique_ptr<DataPlane>(new StagingPlane(
          std::make_unique<HostPlane>(std::move(t)), divisor));
    };
    std::unique_ptr<DataPlane> all = staging(world->CreateTransport(rank), 0);
    if (hosts.empty()) return all;
    const int host = host_of[rank];
    const int local_rank = local_rank_of[rank];
    // This host's index among the hosts that have `local_rank`.
    int cross_rank = 0;
    for (int h = 0; h < host; ++h) cross_rank += hosts[h] > local_rank ? 1 : 0;
    return std::unique_ptr<DataPlane>(new HierarchicalPlane(
        std::move(all), staging(local[host]->CreateTransport(local_rank), 0),
        staging(cross[local_rank]->CreateTransport(cross_rank), n),
        cross_host));
  }

  int n;
  std::vector<int> hosts;
  HierarchicalPlane::CrossHost cross_host = HierarchicalPlane::CrossHost::kShards;
  std::vector<int> host_of;
  std::vector<int> local_rank_of;
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

void CheckEveryCollective(Worlds& worlds) {
  const int n = worlds.n;
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

void CheckStaging(int n) {
  Worlds worlds(n);
  CheckEveryCollective(worlds);
}

void CheckHierarchical(std::vector<int> hosts,
                       HierarchicalPlane::CrossHost cross_host) {
  Worlds worlds(hosts, cross_host);
  CheckEveryCollective(worlds);
}

constexpr auto kShards = HierarchicalPlane::CrossHost::kShards;
constexpr auto kFirstRanks = HierarchicalPlane::CrossHost::kFirstRanks;

TEST(StagingPlane, EveryCollective2Ranks) { CheckStaging(2); }
TEST(StagingPlane, EveryCollective3Ranks) { CheckStaging(3); }
TEST(HierarchicalPlane, TwoHostsOfTwo) { CheckHierarchical({2, 2}, kShards); }
TEST(HierarchicalPlane, TwoHostsOfThree) {
  CheckHierarchical({3, 3}, kShards);
}
TEST(HierarchicalPlane, ThreeHostsOfTwo) {
  CheckHierarchical({2, 2, 2}, kShards);
}
TEST(HierarchicalPlane, OneRankPerHost) {
  CheckHierarchical({1, 1, 1}, kShards);
}
// Hosts of different sizes: each host's first rank crosses hosts.
TEST(HierarchicalPlane, FirstRanksTwoAndOne) {
  CheckHierarchical({2, 1}, kFirstRanks);
}
TEST(HierarchicalPlane, FirstRanksOneThreeTwo) {
  CheckHierarchical({1, 3, 2}, kFirstRanks);
}
TEST(HierarchicalPlane, FirstRanksEvenHosts) {
  CheckHierarchical({2, 2}, kFirstRanks);
}

}  // namespace
}  // namespace mpistrategy
