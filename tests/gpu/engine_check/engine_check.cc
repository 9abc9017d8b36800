// A TensorFlow-free check of the engine's device path, run under mpirun.
//
// It drives the real engine (negotiation, fusion, the executor) over the
// MPI transport with entries on a device, and checks every collective and
// fusion element by element on every rank:
//
//   --device=fake  host memory and a fake stream that runs its work late on
//                  a thread of its own (cc/device/fake_device.h); the plane
//                  is host staging over MPI, or with --ranks-per-host=N
//                  hierarchical (NCCL's place taken by staging over an MPI
//                  communicator of N consecutive ranks: simulated hosts),
//                  or with --hierarchical alone hierarchical over the real
//                  hosts (tests/multihost runs it on simulated hosts).
//                  Built by Bazel and run at np 2 and 3 by
//                  //cc/device:engine_check_mpi_test.
//   --device=cuda  cudaMalloc'd buffers, a CUDA stream and events
//                  (cc/device/cuda_stream.h) and the GPU's data plane from
//                  CreateNcclPlane: NCCL with one rank per GPU, host staging
//                  when processes share a GPU.  --bench adds a table of
//                  engine allreduce bandwidth against raw ncclAllReduce and
//                  device-to-device cudaMemcpy (1 rank).  Built and run on
//                  the GPU machine by run_engine_check.sh.
//
// Exit status 0 when every check passed on this rank.

#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "cc/common/common.h"
#include "cc/common/stream.h"
#include "cc/engine/config.h"
#include "cc/engine/device.h"
#include "cc/engine/engine.h"
#include "cc/testing/mpi_check.h"
#include "cc/transport/data_plane.h"
#include "cc/transport/hierarchical_plane.h"
#include "cc/transport/host_plane.h"
#include "cc/transport/mpi_transport.h"
#include "cc/transport/staging_plane.h"

#if MPISTRATEGY_ENGINE_CHECK_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cc/device/cuda_stream.h"
#include "cc/transport/nccl_plane.h"
#else
#include "cc/device/fake_device.h"
#endif

namespace mpistrategy {
namespace {

// ---- the device ----------------------------------------------------------

struct Options {
  bool bench = false;
  int ranks_per_host = 0;  // fake: simulated hosts for hierarchical
  bool hierarchical = false;
};

#if MPISTRATEGY_ENGINE_CHECK_CUDA

class CheckContext : public DeviceContext {
 public:
  CheckContext(int ordinal, cudaStream_t stream)
      : ordinal_(ordinal),
        stream_(std::make_shared<CudaStream>(ordinal, stream)) {}
  int ordinal() const override { return ordinal_; }
  const std::shared_ptr<Stream>& stream() const override { return stream_; }
  Status CreatePlane(Transport* control, bool hierarchical, int32_t device,
                     std::unique_ptr<DataPlane>* plane) const override {
    return CreateNcclPlane(control, hierarchical, device, ordinal_, plane);
  }

 private:
  const int ordinal_;
  const std::shared_ptr<Stream> stream_;
};

Status NewContext(const Options& /*options*/, Transport* /*control*/,
                  std::shared_ptr<DeviceContext>* context) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return Status::Unavailable("no CUDA device");
  }
  const int ordinal = g_check_rank % devices;
  if (cudaSetDevice(ordinal) != cudaSuccess) {
    return Status::Unavailable("cudaSetDevice failed");
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) !=
      cudaSuccess) {
    return Status::Unavailable("cudaStreamCreate failed");
  }
  *context = std::make_shared<CheckContext>(ordinal, stream);
  return Status::Ok();
}

#else  // the fake device

class CheckContext : public DeviceContext {
 public:
  CheckContext(std::shared_ptr<Stream> stream, int ranks_per_host)
      : stream_(std::move(stream)), ranks_per_host_(ranks_per_host) {}
  int ordinal() const override { return 0; }
  const std::shared_ptr<Stream>& stream() const override { return stream_; }

  // Host staging over the engine's MPI; hierarchical over MPI
  // communicators of simulated hosts (--ranks-per-host: consecutive ranks)
  // or, with --hierarchical alone, of the real hosts (the ranks that share
  // memory), as the NCCL plane splits them.
  Status CreatePlane(Transport* control, bool hierarchical, int32_t /*device*/,
                     std::unique_ptr<DataPlane>* plane) const override {
    std::unique_ptr<DataPlane> all(
        new StagingPlane(std::make_unique<HostPlane>(control)));
    if (!hierarchical) {
      *plane = std::move(all);
      return Status::Ok();
    }
    const int rank = control->rank();
    const int size = control->size();
    MPI_Comm world = static_cast<MpiTransport*>(control)->comm();
    MPI_Comm local_comm = MPI_COMM_NULL;
    MPI_Comm cross_comm = MPI_COMM_NULL;
    if (ranks_per_host_ > 0) {
      if (size % ranks_per_host_ != 0) {
        return Status::InvalidArgument(
            "--ranks-per-host must divide the size");
      }
      MPI_Comm_split(world, rank / ranks_per_host_, rank, &local_comm);
      MPI_Comm_split(world, rank % ranks_per_host_, rank, &cross_comm);
    } else {
      MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL,
                          &local_comm);
      int local_rank = 0;
      int local_size = 0;
      MPI_Comm_rank(local_comm, &local_rank);
      MPI_Comm_size(local_comm, &local_size);
      // The hierarchical plane needs the same number of ranks on every host.
      int smallest = 0;
      int largest = 0;
      MPI_Allreduce(&local_size, &smallest, 1, MPI_INT, MPI_MIN, world);
      MPI_Allreduce(&local_size, &largest, 1, MPI_INT, MPI_MAX, world);
      if (smallest != largest) {
        MPI_Comm_free(&local_comm);
        return Status::InvalidArgument(
            "--hierarchical needs as many ranks on every host");
      }
      MPI_Comm_split(world, local_rank, rank, &cross_comm);
    }
    std::unique_ptr<Transport> local;
    std::unique_ptr<Transport> cross;
    Status s = MpiTransport::Create(local_comm, &local);
    if (s.ok()) s = MpiTransport::Create(cross_comm, &cross);
    MPI_Comm_free(&local_comm);
    MPI_Comm_free(&cross_comm);
    MPISTRATEGY_RETURN_IF_ERROR(s);
    plane->reset(new HierarchicalPlane(
        std::move(all),
        std::make_unique<StagingPlane>(
            std::make_unique<HostPlane>(std::move(local))),
        std::make_unique<StagingPlane>(
            std::make_unique<HostPlane>(std::move(cross)), size)));
    return Status::Ok();
  }

 private:
  const std::shared_ptr<Stream> stream_;
  const int ranks_per_host_;
};

Status NewContext(const Options& options, Transport* /*control*/,
                  std::shared_ptr<DeviceContext>* context) {
  // Rank 0's stream runs at once, the others' late.
  *context = std::make_shared<CheckContext>(
      std::make_shared<FakeStream>(g_check_rank == 0 ? 0 : 500),
      options.ranks_per_host);
  return Status::Ok();
}

#endif

// ---- helpers -------------------------------------------------------------

// Device memory of `count` floats.
struct Buffer {
  Buffer(Stream* stream, int64_t count) : stream(stream), count(count) {
    CHECK_OK(stream->Allocate(std::max<int64_t>(count, 1) * 4, &holder));
  }
  float* data() const { return static_cast<float*>(holder.get()); }
  void Write(const std::vector<float>& values) {
    host = values;
    CHECK_OK(stream->Memcpy(data(), host.data(), count * 4,
                            CopyKind::kHostToDevice));
  }
  std::vector<float> Read() {
    std::vector<float> out(count);
    CHECK_OK(stream->Memcpy(out.data(), data(), count * 4,
                            CopyKind::kDeviceToHost));
    CHECK_OK(stream->Synchronize());
    return out;
  }
  Stream* stream;
  int64_t count;
  std::shared_ptr<void> holder;
  std::vector<float> host;  // kept until the copy ran
};

TensorEntry Entry(CollectiveType type, const std::string& name,
                  const Shape& shape,
                  const std::shared_ptr<DeviceContext>& context) {
  TensorEntry e;
  e.type = type;
  e.name = name;
  e.dtype = DataType::kFloat32;
  e.shape = shape;
  e.device = 0;
  e.device_context = context;
  return e;
}

std::future<Status> Hook(TensorEntry* e) {
  auto p = std::make_shared<std::promise<Status>>();
  e->done = [p](const Status& s) { p->set_value(s); };
  return p->get_future();
}

Status Wait(std::future<Status>* f, const DeviceContext& context) {
  MPISTRATEGY_RETURN_IF_ERROR(f->get());
  MPISTRATEGY_RETURN_IF_ERROR(context.stream()->Synchronize());
  if (context.async_status() != nullptr) return context.async_status()->Get();
  return Status::Ok();
}

// ---- checks --------------------------------------------------------------

// Allreduce of single tensors (sum and mean) and of a fused group.
void CheckAllreduce(Engine* engine, const std::shared_ptr<DeviceContext>& ctx,
                    int round) {
  Stream* stream = ctx->stream().get();
  const int n = engine->size();
  const int r = engine->rank();
  for (int64_t count : {int64_t{1}, int64_t{1023}, int64_t{1} << 20}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean}) {
      Buffer in(stream, count), out(stream, count);
      std::vector<float> v(count);
      for (int64_t i = 0; i < count; ++i) v[i] = r + (i % 7) + round;
      in.Write(v);
      TensorEntry e = Entry(CollectiveType::kAllreduce,
                            "ar." + std::to_string(count) +
                                (op == ReduceOp::kMean ? ".mean" : ".sum"),
                            {count}, ctx);
      e.reduce_op = op;
      e.input = in.data();
      e.output = out.data();
      auto f = Hook(&e);
      engine->Enqueue(std::move(e));
      CHECK_OK(Wait(&f, *ctx));
      const std::vector<float> got = out.Read();
      for (int64_t i = 0; i < count; i += 1 + count / 97) {
        const float sum = n * (n - 1) / 2.0f + n * ((i % 7) + round);
        const float want = op == ReduceOp::kMean ? sum / n : sum;
        CHECK_TRUE(std::fabs(got[i] - want) <= 1e-4f * std::fabs(want),
                   "allreduce count %ld [%ld] = %g, want %g",
                   static_cast<long>(count), static_cast<long>(i), got[i],
                   want);
      }
    }
  }
  // Fusion: 16 tensors enqueued together.
  const int kTensors = 16;
  std::vector<std::unique_ptr<Buffer>> ins, outs;
  std::vector<TensorEntry> group;
  std::vector<std::future<Status>> fs;
  for (int t = 0; t < kTensors; ++t) {
    const int64_t count = 100 + 37 * t;
    ins.emplace_back(new Buffer(stream, count));
    outs.emplace_back(new Buffer(stream, count));
    ins.back()->Write(std::vector<float>(count, r * 10.0f + t + round));
    TensorEntry e = Entry(CollectiveType::kAllreduce,
                          "fused." + std::to_string(t), {count}, ctx);
    e.input = ins.back()->data();
    e.output = outs.back()->data();
    fs.push_back(Hook(&e));
    group.push_back(std::move(e));
  }
  CHECK_OK(engine->EnqueueGroup(std::move(group)));
  for (auto& f : fs) CHECK_OK(Wait(&f, *ctx));
  for (int t = 0; t < kTensors; ++t) {
    const std::vector<float> got = outs[t]->Read();
    const float want = 10.0f * n * (n - 1) / 2 + n * (t + round);
    CHECK_TRUE(got.front() == want && got.back() == want,
               "fused tensor %d = %g..%g, want %g", t, got.front(),
               got.back(), want);
  }
}

// Allgather, reducescatter, alltoall, broadcast.
void CheckOthers(Engine* engine, const std::shared_ptr<DeviceContext>& ctx) {
  Stream* stream = ctx->stream().get();
  const int n = engine->size();
  const int r = engine->rank();
  std::vector<std::shared_ptr<void>> keep;
  Shape out_shape;
  float* out = nullptr;
  auto allocate = [&](const Shape& shape, void** data) -> Status {
    std::shared_ptr<void> h;
    MPISTRATEGY_RETURN_IF_ERROR(
        stream->Allocate(std::max<int64_t>(NumElements(shape), 1) * 4, &h));
    keep.push_back(h);
    out_shape = shape;
    out = static_cast<float*>(h.get());
    *data = h.get();
    return Status::Ok();
  };
  auto read = [&](int64_t count) {
    std::vector<float> v(count);
    CHECK_OK(stream->Memcpy(v.data(), out, count * 4, CopyKind::kDeviceToHost));
    CHECK_OK(stream->Synchronize());
    return v;
  };
  {  // allgather: r + 1 rows of 3
    Buffer in(stream, (r + 1) * 3);
    std::vector<float> v((r + 1) * 3);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 100.0f * r + i;
    in.Write(v);
    TensorEntry e = Entry(CollectiveType::kAllgather, "gather", {r + 1, 3}, ctx);
    e.input = in.data();
    e.allocate_output = allocate;
    auto f = Hook(&e);
    engine->Enqueue(std::move(e));
    CHECK_OK(Wait(&f, *ctx));
    const int64_t rows = n * (n + 1) / 2;
    CHECK_TRUE(out_shape == (Shape{rows, 3}), "allgather shape %s",
               ShapeString(out_shape).c_str());
    const std::vector<float> got = read(rows * 3);
    int64_t k = 0;
    for (int q = 0; q < n; ++q) {
      for (int i = 0; i < (q + 1) * 3; ++i, ++k) {
        CHECK_TRUE(got[k] == 100.0f * q + i, "allgather [%ld] = %g",
                   static_cast<long>(k), got[k]);
      }
    }
  }
  {  // reducescatter (sum) of 2n + 1 rows of 2
    const int64_t rows = 2 * n + 1;
    Buffer in(stream, rows * 2);
    std::vector<float> v(rows * 2);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i + r);
    in.Write(v);
    TensorEntry e =
        Entry(CollectiveType::kReducescatter, "rs", {rows, 2}, ctx);
    e.input = in.data();
    e.allocate_output = allocate;
    auto f = Hook(&e);
    engine->Enqueue(std::move(e));
    CHECK_OK(Wait(&f, *ctx));
    const int64_t mine = 2 + (r == 0 ? 1 : 0);
    const int64_t first = r == 0 ? 0 : 3 + 2 * (r - 1);
    CHECK_TRUE(out_shape == (Shape{mine, 2}), "reducescatter shape %s",
               ShapeString(out_shape).c_str());
    const std::vector<float> got = read(mine * 2);
    for (int64_t i = 0; i < mine * 2; ++i) {
      const float want = n * (first * 2 + i) + n * (n - 1) / 2.0f;
      CHECK_TRUE(got[i] == want, "reducescatter [%ld] = %g, want %g",
                 static_cast<long>(i), got[i], want);
    }
  }
  {  // alltoall: r + j rows of 1 to rank j
    std::vector<int64_t> splits;
    std::vector<float> v;
    for (int j = 0; j < n; ++j) {
      splits.push_back(r + j);
      for (int i = 0; i < r + j; ++i) v.push_back(100.0f * r + 10 * j + i);
    }
    Buffer in(stream, static_cast<int64_t>(v.size()));
    in.Write(v);
    TensorEntry e = Entry(CollectiveType::kAlltoall, "a2a",
                          {static_cast<int64_t>(v.size()), 1}, ctx);
    e.splits = splits;
    e.input = in.data();
    e.allocate_output = allocate;
    auto f = Hook(&e);
    engine->Enqueue(std::move(e));
    CHECK_OK(Wait(&f, *ctx));
    int64_t rows = 0;
    for (int q = 0; q < n; ++q) rows += q + r;
    const std::vector<float> got = read(rows);
    int64_t k = 0;
    for (int q = 0; q < n; ++q) {
      for (int i = 0; i < q + r; ++i, ++k) {
        CHECK_TRUE(got[k] == 100.0f * q + 10 * r + i, "alltoall [%ld] = %g",
                   static_cast<long>(k), got[k]);
      }
    }
  }
  {  // broadcast from the last rank, out of place
    Buffer in(stream, 1000), o(stream, 1000);
    in.Write(std::vector<float>(1000, 1.0f + r));
    TensorEntry e = Entry(CollectiveType::kBroadcast, "bcast", {1000}, ctx);
    e.root_rank = n - 1;
    e.input = in.data();
    e.output = o.data();
    auto f = Hook(&e);
    engine->Enqueue(std::move(e));
    CHECK_OK(Wait(&f, *ctx));
    const std::vector<float> got = o.Read();
    CHECK_TRUE(got.front() == n && got.back() == n, "broadcast = %g..%g",
               got.front(), got.back());
  }
}

#if MPISTRATEGY_ENGINE_CHECK_CUDA
double Seconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Engine allreduce against raw ncclAllReduce and cudaMemcpy (1 rank), in
// GB/s of the buffer's bytes.
void Bench(Engine* engine, const std::shared_ptr<DeviceContext>& ctx) {
  auto* stream = static_cast<CudaStream*>(ctx->stream().get());
  cudaStream_t s = static_cast<cudaStream_t>(stream->native_handle());
  ncclComm_t comm = nullptr;
  int dev = stream->ordinal();
  if (ncclCommInitAll(&comm, 1, &dev) != ncclSuccess) {
    CHECK_TRUE(false, "ncclCommInitAll failed");
    return;
  }
  std::printf("%10s %14s %14s %14s %8s\n", "bytes", "engine GB/s",
              "nccl GB/s", "memcpy GB/s", "eng/nccl");
  for (int64_t bytes = int64_t{4} << 20; bytes <= int64_t{1} << 30;
       bytes *= 4) {
    const int64_t count = bytes / 4;
    Buffer a(stream, count), b(stream, count);
    const int iters = bytes >= (int64_t{256} << 20) ? 5 : 20;
    auto time = [&](auto&& body) {
      body();  // warm-up
      cudaStreamSynchronize(s);
      const double t0 = Seconds();
      for (int i = 0; i < iters; ++i) body();
      cudaStreamSynchronize(s);
      return (Seconds() - t0) / iters;
    };
    const double engine_s = time([&] {
      TensorEntry e = Entry(CollectiveType::kAllreduce, "bench", {count}, ctx);
      e.input = a.data();
      e.output = b.data();
      auto f = Hook(&e);
      engine->Enqueue(std::move(e));
      CHECK_OK(f.get());
    });
    const double nccl_s = time([&] {
      ncclAllReduce(a.data(), b.data(), count, ncclFloat32, ncclSum, comm, s);
    });
    const double copy_s = time([&] {
      cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s);
    });
    std::printf("%10ld %14.1f %14.1f %14.1f %7.0f%%\n",
                static_cast<long>(bytes), bytes / engine_s / 1e9,
                bytes / nccl_s / 1e9, bytes / copy_s / 1e9,
                100.0 * nccl_s / engine_s);
  }
  ncclCommDestroy(comm);
}
#endif

int Main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bench") {
      options.bench = true;
    } else if (a.rfind("--ranks-per-host=", 0) == 0) {
      options.ranks_per_host = std::atoi(a.c_str() + 17);
      options.hierarchical = options.ranks_per_host > 0;
    } else if (a == "--hierarchical") {
      options.hierarchical = true;
    } else {
      std::fprintf(stderr, "engine_check: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  bool we_initialized = false;
  Status s = EnsureMpiInitialized(&we_initialized);
  if (!s.ok()) {
    std::fprintf(stderr, "engine_check: %s\n", s.ToString().c_str());
    return 1;
  }
  std::unique_ptr<Transport> transport;
  s = MpiTransport::Create(MPI_COMM_WORLD, &transport);
  if (!s.ok()) {
    std::fprintf(stderr, "engine_check: %s\n", s.ToString().c_str());
    return 1;
  }
  g_check_rank = transport->rank();
  std::shared_ptr<DeviceContext> context;
  s = NewContext(options, transport.get(), &context);
  if (!s.ok()) {
    std::fprintf(stderr, "[rank %d] engine_check: %s\n", g_check_rank,
                 s.ToString().c_str());
    return 1;
  }
  EngineConfig config;
  config.hierarchical_allreduce = options.hierarchical;
  {
    std::unique_ptr<Engine> engine;
    CHECK_OK(Engine::Create(config, std::move(transport), &engine));
    if (engine != nullptr) {
      for (int round = 0; round < 2; ++round) {
        CheckAllreduce(engine.get(), context, round);
      }
      CheckOthers(engine.get(), context);
#if MPISTRATEGY_ENGINE_CHECK_CUDA
      if (options.bench && g_check_failures == 0) Bench(engine.get(), context);
#endif
    }
  }
  context.reset();
  std::printf("engine_check rank %d: %s\n", g_check_rank,
              g_check_failures == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);
  FinalizeMpiIfWeInitialized();
  return g_check_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mpistrategy

int main(int argc, char** argv) { return mpistrategy::Main(argc, argv); }
