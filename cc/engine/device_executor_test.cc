// The executor's device paths on a fake device (cc/device/fake_device.h):
// N engines in one process, GPU entries whose DeviceContext has a fake
// stream that runs its work later on its own thread, and the host-staging
// or hierarchical data plane built over in-process worlds.  Checks fusion
// on the device (entries on two streams, joined by events), every
// collective's layout, kMean, and that a plane's asynchronous failure
// reaches the entries and every later collective of the device.

#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cc/common/common.h"
#include "cc/device/fake_device.h"
#include "cc/engine/config.h"
#include "cc/engine/device.h"
#include "cc/engine/engine.h"
#include "cc/transport/fake_transport.h"
#include "cc/transport/hierarchical_plane.h"
#include "cc/transport/host_plane.h"
#include "cc/transport/staging_plane.h"

namespace mpistrategy {
namespace {

constexpr int32_t kGpu = 0;

using PlaneFactory = std::function<Status(Transport* control, bool hierarchical,
                                          std::unique_ptr<DataPlane>*)>;

// A GPU entry's device: a fake stream and the factory of the device's plane.
class FakeDeviceContext : public DeviceContext {
 public:
  FakeDeviceContext(std::shared_ptr<Stream> stream, PlaneFactory factory)
      : stream_(std::move(stream)), factory_(std::move(factory)) {}
  int ordinal() const override { return 0; }
  const std::shared_ptr<Stream>& stream() const override { return stream_; }
  Status CreatePlane(Transport* control, bool hierarchical, int32_t device,
                     std::unique_ptr<DataPlane>* plane) const override {
    EXPECT_EQ(device, kGpu);
    return factory_(control, hierarchical, plane);
  }

 private:
  std::shared_ptr<Stream> stream_;
  PlaneFactory factory_;
};

// A plane whose asynchronous status the test fails.
class FailingPlane : public StagingPlane {
 public:
  explicit FailingPlane(Transport* control)
      : StagingPlane(std::make_unique<HostPlane>(control)),
        status_(std::make_shared<AsyncStatus>()) {}
  std::shared_ptr<const AsyncStatus> async_status() const override {
    return status_;
  }
  std::shared_ptr<AsyncStatus> status_;
};

EngineConfig TestConfig(bool hierarchical = false) {
  EngineConfig c;
  c.cycle_time_ms = 1.0;
  c.stall_warning_seconds = 0.0;
  c.hierarchical_allreduce = hierarchical;
  return c;
}

template <typename Fn>
void OnEveryRank(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

Status Await(std::future<Status>* f) {
  if (f->wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    return Status::Internal("test: collective did not complete");
  }
  return f->get();
}

std::future<Status> Hook(TensorEntry* e) {
  auto promise = std::make_shared<std::promise<Status>>();
  e->done = [promise](const Status& s) { promise->set_value(s); };
  return promise->get_future();
}

// The engines of `n` ranks and, per rank, the factory of its GPU plane:
// host staging, or hierarchical with `per_host` ranks per simulated host.
struct Cluster {
  Cluster(int n, int per_host = 0)
      : n(n), world(FakeWorld::Create(n, per_host, 30.0)), engines(n) {
    for (int h = 0; per_host > 0 && h < n / per_host; ++h) {
      local.push_back(FakeWorld::Create(per_host, per_host, 30.0));
    }
    for (int l = 0; l < per_host; ++l) {
      cross.push_back(FakeWorld::Create(n / per_host, 1, 30.0));
    }
    for (int r = 0; r < n; ++r) {
      Status s = Engine::Create(TestConfig(per_host > 0),
                                world->CreateTransport(r), &engines[r]);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    this->per_host = per_host;
  }

  PlaneFactory Factory(int rank) {
    return [this, rank](Transport* control, bool hierarchical,
                        std::unique_ptr<DataPlane>* plane) -> Status {
      std::unique_ptr<DataPlane> all(
          new StagingPlane(std::make_unique<HostPlane>(control)));
      if (!hierarchical) {
        *plane = std::move(all);
        return Status::Ok();
      }
      const int host = rank / per_host;
      const int local_rank = rank % per_host;
      plane->reset(new HierarchicalPlane(
          std::move(all),
          std::make_unique<StagingPlane>(std::make_unique<HostPlane>(
              local[host]->CreateTransport(local_rank))),
          std::make_unique<StagingPlane>(
              std::make_unique<HostPlane>(
                  cross[local_rank]->CreateTransport(host)),
              n)));
      return Status::Ok();
    };
  }

  int n;
  int per_host = 0;
  std::shared_ptr<FakeWorld> world;
  std::vector<std::shared_ptr<FakeWorld>> local;
  std::vector<std::shared_ptr<FakeWorld>> cross;
  std::vector<std::unique_ptr<Engine>> engines;
};

// Device memory for the test, written and read through a stream.
struct DeviceFloats {
  DeviceFloats(FakeStream* stream, int64_t count) : count(count) {
    EXPECT_TRUE(stream->Allocate(count * 4 + 4, &holder).ok());
  }
  float* data() const { return static_cast<float*>(holder.get()); }
  // As a slow kernel would: the executor must order its work after it.
  void Fill(FakeStream* stream, std::vector<float> values, int sleep_ms = 5) {
    float* d = data();
    stream->Enqueue([d, values, sleep_ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      std::memcpy(d, values.data(), values.size() * 4);
    });
  }
  std::vector<float> Read(FakeStream* stream) const {
    EXPECT_TRUE(stream->Synchronize().ok());
    return std::vector<float>(data(), data() + count);
  }
  int64_t count;
  std::shared_ptr<void> holder;
};

TensorEntry GpuEntry(CollectiveType type, const std::string& name,
                     const Shape& shape,
                     const std::shared_ptr<DeviceContext>& context) {
  TensorEntry e;
  e.type = type;
  e.name = name;
  e.dtype = DataType::kFloat32;
  e.shape = shape;
  e.device = kGpu;
  e.device_context = context;
  return e;
}

// Tensor t of CheckFusedAllreduce is on the first stream: tensor 0 (a
// bucket of its own) and the odd ones, so the fused bucket (1..5) runs on
// the first stream and packs inputs that the second writes late.
bool OnFirst(int t) { return t == 0 || t % 2 == 1; }

// A fused bucket whose entries sit on two streams: packing needs the join
// of the streams, and reading on the second stream the fork back.
void CheckFusedAllreduce(int n, int per_host) {
  Cluster c(n, per_host);
  const int kTensors = 6;
  OnEveryRank(n, [&](int rank) {
    auto s1 = std::make_shared<FakeStream>(rank == 0 ? 0 : 1000);
    auto s2 = std::make_shared<FakeStream>(3000);
    auto c1 = std::make_shared<FakeDeviceContext>(s1, c.Factory(rank));
    auto c2 = std::make_shared<FakeDeviceContext>(s2, c.Factory(rank));
    for (int round = 0; round < 3; ++round) {
      std::vector<DeviceFloats> ins, outs;
      std::vector<TensorEntry> group;
      std::vector<std::future<Status>> fs;
      for (int t = 0; t < kTensors; ++t) {
        FakeStream* s = OnFirst(t) ? s1.get() : s2.get();
        const int64_t count = 3 + t;
        ins.emplace_back(s, count);
        outs.emplace_back(s, count);
        // The second stream's kernels are much slower than negotiation.
        ins.back().Fill(s, std::vector<float>(count, rank + t + round),
                        OnFirst(t) ? 5 : 100);
      }
      for (int t = 0; t < kTensors; ++t) {
        TensorEntry e = GpuEntry(CollectiveType::kAllreduce,
                                 "fused." + std::to_string(t), {3 + t},
                                 OnFirst(t) ? c1 : c2);
        e.reduce_op = t == 0 ? ReduceOp::kMean : ReduceOp::kSum;
        // One reduce op per bucket: tensor 0 (mean) goes alone.
        e.input = ins[t].data();
        e.output = outs[t].data();
        fs.push_back(Hook(&e));
        group.push_back(std::move(e));
      }
      ASSERT_TRUE(c.engines[rank]->EnqueueGroup(std::move(group)).ok());
      for (int t = 0; t < kTensors; ++t) {
        Status s = Await(&fs[t]);
        ASSERT_TRUE(s.ok()) << s.ToString();
        ASSERT_TRUE(c1->async_status() == nullptr ||
                    c1->async_status()->Get().ok());
      }
      for (int t = 0; t < kTensors; ++t) {
        FakeStream* s = OnFirst(t) ? s1.get() : s2.get();
        const float rank_sum = n * (n - 1) / 2.0f;
        const float want = t == 0 ? (rank_sum + n * (t + round)) / n
                                  : rank_sum + n * (t + round);
        for (float v : outs[t].Read(s)) {
          ASSERT_FLOAT_EQ(v, want) << "tensor " << t << " round " << round;
        }
      }
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_GE(c.engines[r]->stats().fused_buckets, 3) << "rank " << r;
  }
}

TEST(DeviceExecutor, FusedAllreduceOnTwoStreamsStaging2) {
  CheckFusedAllreduce(2, 0);
}
TEST(DeviceExecutor, FusedAllreduceOnTwoStreamsStaging3) {
  CheckFusedAllreduce(3, 0);
}
TEST(DeviceExecutor, FusedAllreduceHierarchicalTwoHostsOfTwo) {
  CheckFusedAllreduce(4, 2);
}

// Allgather, reducescatter, alltoall and broadcast with outputs the
// executor allocates on the device.
TEST(DeviceExecutor, LayoutsOfEveryCollective) {
  const int n = 3;
  Cluster c(n);
  OnEveryRank(n, [&](int rank) {
    auto stream = std::make_shared<FakeStream>(rank == 0 ? 0 : 1000);
    auto context = std::make_shared<FakeDeviceContext>(stream, c.Factory(rank));
    Engine* engine = c.engines[rank].get();
    std::vector<std::shared_ptr<void>> keep;
    auto allocator = [&keep, stream](Shape* shape_out, float** data_out) {
      return [&keep, stream, shape_out, data_out](const Shape& shape,
                                                  void** data) {
        std::shared_ptr<void> h;
        MPISTRATEGY_RETURN_IF_ERROR(
            stream->Allocate(NumElements(shape) * 4 + 4, &h));
        keep.push_back(h);
        *shape_out = shape;
        *data_out = static_cast<float*>(h.get());
        *data = h.get();
        return Status::Ok();
      };
    };
    // Allgather: rank r has r + 1 rows of 2.
    {
      DeviceFloats in(stream.get(), (rank + 1) * 2);
      std::vector<float> v((rank + 1) * 2);
      for (size_t i = 0; i < v.size(); ++i) v[i] = 100 * rank + i;
      in.Fill(stream.get(), v);
      TensorEntry e = GpuEntry(CollectiveType::kAllgather, "gather",
                               {rank + 1, 2}, context);
      e.input = in.data();
      Shape shape;
      float* out = nullptr;
      e.allocate_output = allocator(&shape, &out);
      auto f = Hook(&e);
      engine->Enqueue(std::move(e));
      ASSERT_TRUE(Await(&f).ok());
      ASSERT_EQ(shape, (Shape{6, 2}));
      ASSERT_TRUE(stream->Synchronize().ok());
      int k = 0;
      for (int r = 0; r < n; ++r) {
        for (int i = 0; i < (r + 1) * 2; ++i, ++k) ASSERT_EQ(out[k], 100 * r + i);
      }
    }
    // Reducescatter (mean) of 7 rows of 1: blocks of 3, 2, 2 rows.
    {
      DeviceFloats in(stream.get(), 7);
      std::vector<float> v(7);
      for (int i = 0; i < 7; ++i) v[i] = 3.0f * (i + rank);
      in.Fill(stream.get(), v);
      TensorEntry e = GpuEntry(CollectiveType::kReducescatter, "rs", {7, 1},
                               context);
      e.reduce_op = ReduceOp::kMean;
      e.input = in.data();
      Shape shape;
      float* out = nullptr;
      e.allocate_output = allocator(&shape, &out);
      auto f = Hook(&e);
      engine->Enqueue(std::move(e));
      ASSERT_TRUE(Await(&f).ok());
      const int64_t rows = rank == 0 ? 3 : 2;
      const int64_t first = rank == 0 ? 0 : (rank == 1 ? 3 : 5);
      ASSERT_EQ(shape, (Shape{rows, 1}));
      ASSERT_TRUE(stream->Synchronize().ok());
      for (int64_t i = 0; i < rows; ++i) {
        ASSERT_FLOAT_EQ(out[i], 3.0f * (first + i) + 3.0f);  // mean rank = 1
      }
    }
    // Alltoall: rank r sends j + r rows of 1 to rank j.
    {
      std::vector<int64_t> splits;
      std::vector<float> v;
      for (int j = 0; j < n; ++j) {
        splits.push_back(j + rank);
        for (int i = 0; i < j + rank; ++i) v.push_back(100 * rank + 10 * j + i);
      }
      DeviceFloats in(stream.get(), static_cast<int64_t>(v.size()));
      in.Fill(stream.get(), v);
      TensorEntry e = GpuEntry(CollectiveType::kAlltoall, "a2a",
                               {static_cast<int64_t>(v.size()), 1}, context);
      e.splits = splits;
      e.input = in.data();
      Shape shape;
      float* out = nullptr;
      e.allocate_output = allocator(&shape, &out);
      std::vector<int64_t> received;
      e.set_received_splits = [&received](const std::vector<int64_t>& s) {
        received = s;
      };
      auto f = Hook(&e);
      engine->Enqueue(std::move(e));
      ASSERT_TRUE(Await(&f).ok());
      ASSERT_TRUE(stream->Synchronize().ok());
      int k = 0;
      for (int r = 0; r < n; ++r) {
        ASSERT_EQ(received[r], r + rank);
        for (int i = 0; i < r + rank; ++i, ++k) {
          ASSERT_EQ(out[k], 100 * r + 10 * rank + i);
        }
      }
    }
    // Broadcast from rank 2, out of place.
    {
      DeviceFloats in(stream.get(), 4);
      DeviceFloats out(stream.get(), 4);
      in.Fill(stream.get(), std::vector<float>(4, 7.0f + rank));
      TensorEntry e = GpuEntry(CollectiveType::kBroadcast, "bcast", {4},
                               context);
      e.root_rank = 2;
      e.input = in.data();
      e.output = out.data();
      auto f = Hook(&e);
      engine->Enqueue(std::move(e));
      ASSERT_TRUE(Await(&f).ok());
      for (float x : out.Read(stream.get())) ASSERT_EQ(x, 9.0f);
    }
  });
}

// A group packed by the kernel with several dtypes (packed_dtypes) is
// reduced segment by segment on the device, in place, as on the CPU.
TEST(DeviceExecutor, MixedDtypePackedGroup) {
  const int n = 2;
  Cluster c(n);
  const std::vector<DataType> dtypes = {DataType::kFloat32, DataType::kInt64,
                                        DataType::kFloat32};
  const std::vector<Shape> shapes = {{3}, {2}, {5}};
  const PackedLayout layout = PackedGroupLayout(dtypes, shapes);
  OnEveryRank(n, [&](int rank) {
    auto stream = std::make_shared<FakeStream>(rank == 0 ? 0 : 1000);
    auto context = std::make_shared<FakeDeviceContext>(stream, c.Factory(rank));
    std::shared_ptr<void> holder;
    ASSERT_TRUE(stream->Allocate(layout.total_bytes, &holder).ok());
    char* base = static_cast<char*>(holder.get());
    std::vector<char> host(layout.total_bytes, 0);
    for (int i = 0; i < 3; ++i) {
      reinterpret_cast<float*>(host.data() + layout.byte_offsets[0])[i] =
          rank + i;
    }
    for (int i = 0; i < 2; ++i) {
      reinterpret_cast<int64_t*>(host.data() + layout.byte_offsets[1])[i] =
          (int64_t{1} << 40) * (rank + 1) + i;
    }
    for (int i = 0; i < 5; ++i) {
      reinterpret_cast<float*>(host.data() + layout.byte_offsets[2])[i] =
          0.5f * rank;
    }
    stream->Enqueue([base, host] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::memcpy(base, host.data(), host.size());
    });
    TensorEntry e;
    e.type = CollectiveType::kAllreduce;
    e.name = "mixed";
    e.dtype = DataType::kUint8;
    e.shape = {layout.total_bytes};
    e.packed_shapes = shapes;
    e.packed_dtypes = dtypes;
    e.device = kGpu;
    e.device_context = context;
    e.input = base;
    e.output = base;
    auto f = Hook(&e);
    c.engines[rank]->Enqueue(std::move(e));
    Status s = Await(&f);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(stream->Synchronize().ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(reinterpret_cast<float*>(base + layout.byte_offsets[0])[i],
                1.0f + 2 * i);
    }
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(reinterpret_cast<int64_t*>(base + layout.byte_offsets[1])[i],
                (int64_t{1} << 40) * 3 + 2 * i);
    }
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(reinterpret_cast<float*>(base + layout.byte_offsets[2])[i],
                0.5f);
    }
  });
}

// A failure the plane reports after its call returned reaches the entries
// (DeviceContext::async_status) and fails every later collective of the
// device, on every rank.
TEST(DeviceExecutor, AsynchronousFailureIsSticky) {
  const int n = 2;
  Cluster c(n);
  std::vector<FailingPlane*> planes(n, nullptr);
  OnEveryRank(n, [&](int rank) {
    auto stream = std::make_shared<FakeStream>();
    auto context = std::make_shared<FakeDeviceContext>(
        stream, [&planes, rank](Transport* control, bool,
                                std::unique_ptr<DataPlane>* plane) {
          auto* p = new FailingPlane(control);
          planes[rank] = p;
          plane->reset(p);
          return Status::Ok();
        });
    DeviceFloats buffer(stream.get(), 4);
    buffer.Fill(stream.get(), std::vector<float>(4, 1.0f));
    TensorEntry e = GpuEntry(CollectiveType::kAllreduce, "x", {4}, context);
    e.input = buffer.data();
    e.output = buffer.data();
    auto f = Hook(&e);
    c.engines[rank]->Enqueue(std::move(e));
    ASSERT_TRUE(Await(&f).ok());
    ASSERT_NE(context->async_status(), nullptr);
    // The device's work fails later (as NCCL's watchdog would report).
    planes[rank]->status_->Fail(Status::Unavailable("NCCL failed (test)"));
    EXPECT_EQ(context->async_status()->Get().code(), StatusCode::kUnavailable);
    TensorEntry again = GpuEntry(CollectiveType::kAllreduce, "y", {4}, context);
    again.input = buffer.data();
    again.output = buffer.data();
    auto g = Hook(&again);
    c.engines[rank]->Enqueue(std::move(again));
    Status s = Await(&g);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("NCCL failed (test)"), std::string::npos)
        << s.ToString();
  });
}

}  // namespace
}  // namespace mpistrategy
