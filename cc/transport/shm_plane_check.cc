// Checks ShmPlane under mpirun (every rank of one host):
//
//   mpirun -np 2 shm_plane_check [--large]
//   mpirun -np 3 shm_plane_check
//
// Every collective's result is compared element by element on every rank
// with the reduction done here in rank order (the plane's order), for every
// dtype and op, in place and not, on unaligned buffers, for counts of 0, 1,
// odd, on both sides of the small-allreduce border, and across round
// borders (a plane with the smallest segment makes those cheap; one with
// slots larger than kShmMaxRoundBytes checks that rounds stop there).
// --large adds an allreduce of more than 2^31 bytes.  Every rank prints
// "rank R: PASS" (exit 0) or the failures (exit 1).

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/common/common.h"
#include "cc/common/float16.h"
#include "cc/common/reduce_kernels.h"
#include "cc/common/stream.h"
#include "cc/testing/mpi_check.h"
#include "cc/transport/host_plane.h"
#include "cc/transport/host_rendezvous.h"
#include "cc/transport/mpi_transport.h"
#include "cc/transport/shm_plane.h"

namespace mpistrategy {
namespace {

const DataType kDtypes[] = {
    DataType::kUint8,   DataType::kInt8,     DataType::kBool,
    DataType::kInt32,   DataType::kInt64,    DataType::kFloat16,
    DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMin,
                         ReduceOp::kMax, ReduceOp::kProduct};

// Rank r's element i of `dtype`, written into `p` (small values whose sums
// and products wrap for the 8-bit types, some NaNs for the floats).
void Fill(DataType dtype, int r, int64_t seed, void* p, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = (i * 7919 + seed * 31 + r * 104729) % 251;
    const double v = static_cast<double>(k % 13) - 6.0 + 0.25 * r;
    const bool nan = (k % 97) == 5 && r == 1;
    switch (dtype) {
      case DataType::kUint8:
        static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(k + 200 * r);
        break;
      case DataType::kInt8:
        static_cast<int8_t*>(p)[i] = static_cast<int8_t>(k - 125 + r * 100);
        break;
      case DataType::kBool:
        static_cast<uint8_t*>(p)[i] = (k + r) % 3 == 0;
        break;
      case DataType::kInt32:
        static_cast<int32_t*>(p)[i] =
            static_cast<int32_t>(k * 17000000 - 2000000000 + r);
        break;
      case DataType::kInt64:
        static_cast<int64_t*>(p)[i] = (k - 100) * (int64_t{1} << 40) + r;
        break;
      case DataType::kFloat16:
        static_cast<uint16_t*>(p)[i] =
            FloatToHalf(nan ? NAN : static_cast<float>(v));
        break;
      case DataType::kBFloat16:
        static_cast<uint16_t*>(p)[i] =
            FloatToBFloat16(nan ? NAN : static_cast<float>(v));
        break;
      case DataType::kFloat32:
        static_cast<float*>(p)[i] = nan ? NAN : static_cast<float>(v);
        break;
      case DataType::kFloat64:
        static_cast<double*>(p)[i] = nan ? NAN : v;
        break;
    }
  }
}

// The reduction of every rank's Fill, in rank order, as the plane does it.
std::vector<char> Expected(DataType dtype, ReduceOp op, int n, int64_t seed,
                           int64_t count) {
  const int64_t esize = DataTypeSize(dtype);
  std::vector<char> acc(count * esize + 1), other(count * esize + 1);
  Fill(dtype, 0, seed, acc.data(), count);
  for (int r = 1; r < n; ++r) {
    Fill(dtype, r, seed, other.data(), count);
    ReduceInto(dtype, op, other.data(), acc.data(), count);
  }
  if (op == ReduceOp::kMean) DivideInPlace(dtype, acc.data(), count, n);
  return acc;
}

// Bytes equal, NaN or not (a NaN's payload may differ: compare as values).
bool SameElement(DataType dtype, const char* a, const char* b) {
  const int64_t esize = DataTypeSize(dtype);
  if (std::memcmp(a, b, esize) == 0) return true;
  auto is_nan = [dtype](const char* p) {
    uint16_t h;
    switch (dtype) {
      case DataType::kFloat16:
        std::memcpy(&h, p, 2);
        return std::isnan(HalfToFloat(h));
      case DataType::kBFloat16:
        std::memcpy(&h, p, 2);
        return std::isnan(BFloat16ToFloat(h));
      case DataType::kFloat32: {
        float f;
        std::memcpy(&f, p, 4);
        return std::isnan(f);
      }
      case DataType::kFloat64: {
        double d;
        std::memcpy(&d, p, 8);
        return std::isnan(d);
      }
      default:
        return false;
    }
  };
  return is_nan(a) && is_nan(b);
}

int64_t FirstMismatch(DataType dtype, const char* got, const char* want,
                      int64_t count) {
  const int64_t esize = DataTypeSize(dtype);
  for (int64_t i = 0; i < count; ++i) {
    if (!SameElement(dtype, got + i * esize, want + i * esize)) return i;
  }
  return -1;
}

void CheckAllreduce(ShmPlane* plane, Stream* stream, int64_t count,
                    const char* label) {
  const int n = plane->size();
  const int r = plane->rank();
  for (DataType dtype : kDtypes) {
    const int64_t esize = DataTypeSize(dtype);
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::kMean && !IsFloatingDataType(dtype)) {
        std::vector<char> buf(esize * 4);
        Status s = plane->Allreduce(buf.data(), buf.data(), 4, dtype, op,
                                    stream);
        CHECK_TRUE(s.code() == StatusCode::kInvalidArgument,
                   "%s mean of %s: %s", label, DataTypeName(dtype),
                   s.ToString().c_str());
        continue;
      }
      const int64_t seed = count + static_cast<int64_t>(op) * 3 +
                           static_cast<int64_t>(dtype);
      const std::vector<char> want = Expected(dtype, op, n, seed, count);
      for (int in_place = 0; in_place < 2; ++in_place) {
        // One element past an aligned start: the plane must not assume
        // aligned buffers.
        std::vector<char> in_buf((count + 1) * esize + 8);
        std::vector<char> out_buf((count + 1) * esize + 8);
        char* in = in_buf.data() + esize;
        char* out = in_place ? in : out_buf.data() + esize;
        Fill(dtype, r, seed, in, count);
        CHECK_OK(plane->Allreduce(in, out, count, dtype, op, stream));
        const int64_t bad = FirstMismatch(dtype, out, want.data(), count);
        CHECK_TRUE(bad < 0,
                   "%s allreduce %s %s count %lld in_place %d: element %lld",
                   label, DataTypeName(dtype), ReduceOpName(op),
                   static_cast<long long>(count), in_place,
                   static_cast<long long>(bad));
      }
    }
  }
}

// A fused bucket handed over unpacked: parts of `counts` elements, each in
// its own (misaligned) buffers, every other one in place; the result must be
// Allreduce's on the parts laid end to end.
void CheckAllreduceParts(ShmPlane* plane, Stream* stream,
                         const std::vector<int64_t>& counts,
                         const char* label) {
  const int n = plane->size();
  const int r = plane->rank();
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  for (DataType dtype : kDtypes) {
    const int64_t esize = DataTypeSize(dtype);
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::kMean && !IsFloatingDataType(dtype)) continue;
      const int64_t seed = total + static_cast<int64_t>(op) * 5 +
                           static_cast<int64_t>(dtype);
      const std::vector<char> want = Expected(dtype, op, n, seed, total);
      std::vector<char> mine(total * esize + 1);
      Fill(dtype, r, seed, mine.data(), total);
      std::vector<std::vector<char>> ins(counts.size());
      std::vector<std::vector<char>> outs(counts.size());
      std::vector<AllreducePart> parts;
      int64_t first = 0;
      for (size_t k = 0; k < counts.size(); ++k) {
        ins[k].resize((counts[k] + 2) * esize);
        outs[k].resize((counts[k] + 2) * esize);
        char* in = ins[k].data() + (k % 2 + 1) * esize;
        char* out = k % 2 == 0 ? in : outs[k].data() + esize;
        std::memcpy(in, mine.data() + first * esize, counts[k] * esize);
        parts.push_back({in, out, counts[k]});
        first += counts[k];
      }
      CHECK_OK(plane->AllreduceParts(parts, dtype, op, stream));
      first = 0;
      for (size_t k = 0; k < counts.size(); ++k) {
        const int64_t bad =
            FirstMismatch(dtype, static_cast<const char*>(parts[k].out),
                          want.data() + first * esize, counts[k]);
        CHECK_TRUE(bad < 0, "%s allreduce parts %s %s part %zu: element %lld",
                   label, DataTypeName(dtype), ReduceOpName(op), k,
                   static_cast<long long>(bad));
        first += counts[k];
      }
    }
  }
}

// The two ways of handing lines over (handoff_tuner.h): large allreduces
// right with either one fixed, and with the way changing from one
// allreduce to the next, every rank using the way rank 0 picked each time.
void CheckHandoffs(ShmPlane* plane, Stream* stream, MPI_Comm comm) {
  for (Handoff way : {Handoff::kCached, Handoff::kStreaming}) {
    HandoffTunerSettings fixed;
    fixed.initial = way;
    fixed.min_probe_gap = fixed.max_probe_gap = 1 << 30;  // never probes
    plane->SetHandoffTuning(fixed);
    // Several rounds for every dtype.
    CheckAllreduce(plane, stream, 5 * kShmMaxRoundBytes / 4 + 3,
                   HandoffName(way));
    CHECK_TRUE(plane->last_handoff() == way, "%s: the plane used %s",
               HandoffName(way), HandoffName(plane->last_handoff()));
  }
  // Timed allreduces (32 KiB and more here) between untimed ones, probes
  // of two timed ones after every other, and every probe wins and
  // switches.
  HandoffTunerSettings flipping;
  flipping.min_probe_gap = flipping.max_probe_gap = 2;
  flipping.settle = 1;
  flipping.wins_to_switch = 1;
  flipping.min_gain = -1e9;
  flipping.min_bytes = 32 << 10;
  plane->SetHandoffTuning(flipping);
  const int n = plane->size();
  int used[2] = {0, 0};
  for (int i = 0; i < 96; ++i) {
    const DataType dtype = DataType::kFloat32;
    // Large (above 16 KiB); untimed (20 KB) at every third.
    const int64_t count = i % 3 == 0 ? 5000 : 9000 + 97 * i;
    const std::vector<char> want =
        Expected(dtype, ReduceOp::kSum, n, i, count);
    std::vector<char> buf(count * 4);
    Fill(dtype, plane->rank(), i, buf.data(), count);
    CHECK_OK(plane->Allreduce(buf.data(), buf.data(), count, dtype,
                              ReduceOp::kSum, stream));
    const int64_t bad = FirstMismatch(dtype, buf.data(), want.data(), count);
    CHECK_TRUE(bad < 0, "flipping hand-offs, allreduce %d: element %lld", i,
               static_cast<long long>(bad));
    const int mine = static_cast<int>(plane->last_handoff());
    std::vector<int> ways(n);
    MPI_Allgather(&mine, 1, MPI_INT, ways.data(), 1, MPI_INT, comm);
    for (int q = 0; q < n; ++q) {
      CHECK_TRUE(ways[q] == ways[0],
                 "allreduce %d: rank %d used %s, rank 0 %s", i, q,
                 HandoffName(static_cast<Handoff>(ways[q])),
                 HandoffName(static_cast<Handoff>(ways[0])));
    }
    ++used[mine];
  }
  CHECK_TRUE(used[0] > 16 && used[1] > 16,
             "flipping hand-offs: %d cached, %d streaming", used[0], used[1]);
  plane->SetHandoffTuning(HandoffTunerSettings());
}

void CheckAllgatherv(ShmPlane* plane, Stream* stream, int64_t base) {
  const int n = plane->size();
  const int r = plane->rank();
  std::vector<int64_t> bytes(n);
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    // Rank 1's block is empty; the others differ in size.
    bytes[q] = q == 1 ? 0 : base + 13 * q + 1;
    total += bytes[q];
  }
  std::vector<char> in(bytes[r] + 1), out(total + 1), want(total + 1);
  int64_t offset = 0;
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < bytes[q]; ++i) {
      want[offset + i] = static_cast<char>(i * 31 + q * 7 + 1);
    }
    offset += bytes[q];
  }
  offset = 0;
  for (int q = 0; q < r; ++q) offset += bytes[q];
  std::memcpy(in.data() + 1, want.data() + offset, bytes[r]);
  CHECK_OK(plane->Allgatherv(in.data() + 1, out.data() + 1, bytes, stream));
  CHECK_TRUE(std::memcmp(out.data() + 1, want.data(), total) == 0,
             "allgatherv base %lld", static_cast<long long>(base));
  // In place: our block already sits in the output.
  std::vector<char> io(total);
  std::memcpy(io.data() + offset, want.data() + offset, bytes[r]);
  CHECK_OK(plane->Allgatherv(io.data() + offset, io.data(), bytes, stream));
  CHECK_TRUE(std::memcmp(io.data(), want.data(), total) == 0,
             "in-place allgatherv base %lld", static_cast<long long>(base));
}

void CheckBroadcast(ShmPlane* plane, Stream* stream, int64_t bytes) {
  for (int root = 0; root < plane->size(); ++root) {
    std::vector<char> buf(bytes + 1), want(bytes + 1);
    for (int64_t i = 0; i < bytes; ++i) {
      want[i + 1] = static_cast<char>(i * 13 + root);
    }
    if (plane->rank() == root) buf = want;
    CHECK_OK(plane->Broadcast(buf.data() + 1, bytes, root, stream));
    CHECK_TRUE(std::memcmp(buf.data() + 1, want.data() + 1, bytes) == 0,
               "broadcast of %lld bytes from %d",
               static_cast<long long>(bytes), root);
  }
}

void CheckReducescatter(ShmPlane* plane, Stream* stream, int64_t base) {
  const int n = plane->size();
  const int r = plane->rank();
  std::vector<int64_t> counts(n);
  int64_t total = 0;
  for (int q = 0; q < n; ++q) {
    counts[q] = q == n - 1 ? 0 : base + 5 * q + 3;  // the last block empty
    total += counts[q];
  }
  int64_t first = 0;
  for (int q = 0; q < r; ++q) first += counts[q];
  for (DataType dtype : {DataType::kFloat32, DataType::kInt8,
                         DataType::kBFloat16, DataType::kFloat64}) {
    const int64_t esize = DataTypeSize(dtype);
    for (ReduceOp op : kOps) {
      if (op == ReduceOp::kMean && !IsFloatingDataType(dtype)) continue;
      const int64_t seed = base + static_cast<int64_t>(op);
      const std::vector<char> want = Expected(dtype, op, n, seed, total);
      std::vector<char> in((total + 1) * esize), out((counts[r] + 1) * esize);
      Fill(dtype, r, seed, in.data() + esize, total);
      CHECK_OK(plane->Reducescatter(in.data() + esize, out.data() + esize,
                                    counts, dtype, op, stream));
      const int64_t bad = FirstMismatch(dtype, out.data() + esize,
                                        want.data() + first * esize,
                                        counts[r]);
      CHECK_TRUE(bad < 0, "reducescatter %s %s base %lld: element %lld",
                 DataTypeName(dtype), ReduceOpName(op),
                 static_cast<long long>(base), static_cast<long long>(bad));
    }
  }
}

void CheckAlltoall(ShmPlane* plane, Stream* stream) {
  const int n = plane->size();
  const int r = plane->rank();
  std::vector<int64_t> send(n), recv(n);
  for (int q = 0; q < n; ++q) {
    send[q] = r + q + 1;  // bytes from r to q
    recv[q] = q + r + 1;
  }
  std::vector<char> in, out, want;
  for (int q = 0; q < n; ++q) {
    for (int64_t i = 0; i < send[q]; ++i) in.push_back(char(r * 10 + q));
    for (int64_t i = 0; i < recv[q]; ++i) want.push_back(char(q * 10 + r));
  }
  out.resize(want.size());
  CHECK_OK(plane->Alltoallv(in.data(), send, out.data(), recv, stream));
  CHECK_TRUE(out == want, "alltoallv");
}

// A wait hook that counts its calls in *calls and, from 200 ms after it
// was made, fails with Unavailable("peer gone (test)") as the engine's peer
// deadline would.
std::function<Status()> PeerGoneAfter200Ms(int* calls) {
  const auto start = std::chrono::steady_clock::now();
  return [calls, start]() -> Status {
    ++*calls;
    if (std::chrono::steady_clock::now() - start >
        std::chrono::milliseconds(200)) {
      return Status::Unavailable("peer gone (test)");
    }
    return Status::Ok();
  };
}

// Rank 0 waits in a collective the others never enter: the wait hook ends
// it.  The plane is out of step afterwards.
void CheckWaitHook(ShmPlane* plane, Stream* stream, MPI_Comm comm) {
  int calls = 0;
  plane->SetWaitHook(PeerGoneAfter200Ms(&calls));
  if (plane->rank() == 0) {
    float x = 1;
    Status s = plane->Allreduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum,
                                stream);
    CHECK_TRUE(s.code() == StatusCode::kUnavailable &&
                   s.message() == "peer gone (test)",
               "%s", s.ToString().c_str());
    CHECK_TRUE(calls >= 20, "the hook ran %d times in 200 ms", calls);
  }
  MPI_Barrier(comm);
}

// Voluntary context switches of the calling thread so far.
long VoluntarySwitches() {
  struct rusage usage;
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_nvcsw;
}

// Each rank in turn arrives 100 ms late at an allreduce, small (one
// barrier) and over shares (two): the others sleep until it arrives, waking
// about once a millisecond (when the wait hook is due), not polling.
void CheckLatePeerSleeps(ShmPlane* plane, Stream* stream, MPI_Comm comm) {
  const int rank = plane->rank();
  const int n = plane->size();
  for (int late = 0; late < n; ++late) {
    for (int64_t count : {int64_t{1}, int64_t{1} << 16}) {
      std::vector<float> x(count, static_cast<float>(rank + 1));
      MPI_Barrier(comm);
      if (rank == late) usleep(100000);
      const long before = VoluntarySwitches();
      CHECK_OK(plane->Allreduce(x.data(), x.data(), count,
                                DataType::kFloat32, ReduceOp::kSum, stream));
      const long switches = VoluntarySwitches() - before;
      const float want = n * (n + 1) / 2.0f;
      CHECK_TRUE(x[0] == want && x[count - 1] == want,
                 "late rank %d, %lld floats: got %g want %g", late,
                 static_cast<long long>(count), x[0], want);
      if (rank != late) {
        CHECK_TRUE(switches <= 150,
                   "waiting 100 ms for rank %d (%lld floats) took %ld "
                   "voluntary context switches (about 100 expected)",
                   late, static_cast<long long>(count), switches);
      }
    }
  }
}

// The negotiation's AND through the segment (HostRendezvous): vectors of
// every length it takes, ranks arriving late in turn, compared with MPI's
// AND; a bounded wait reports "not yet" while a rank is late, and a wait
// hook's error ends a wait that no rank will end.
void CheckRendezvous(ShmPlane* plane, MPI_Comm comm) {
  std::unique_ptr<HostRendezvous> rendezvous = plane->CreateRendezvous();
  const int rank = plane->rank();
  const int n = plane->size();
  for (int it = 0; it < 300; ++it) {
    const int64_t words = 1 + it % HostRendezvous::kMaxWords;
    std::vector<uint64_t> bits(words), want(words);
    uint64_t x = 0x9e3779b97f4a7c15ull * (it + 1) + rank;
    for (int64_t i = 0; i < words; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      bits[i] = x | (i % 3 == 0 ? ~uint64_t{0} >> 4 : 0);
    }
    MPI_Allreduce(bits.data(), want.data(), static_cast<int>(words),
                  MPI_UINT64_T, MPI_BAND, comm);
    if (it % (n + 1) == rank) usleep(it % 2 ? 50 : 2000);  // one rank late
    CHECK_OK(rendezvous->Start(&bits));
    bool done = false;
    CHECK_OK(rendezvous->Finish(-1.0, &done));
    CHECK_TRUE(done && bits == want, "AND %d (%lld words) differs", it,
               static_cast<long long>(words));
  }
  // Rank n-1 starts 100 ms late: the others' bounded waits say "not yet".
  std::vector<uint64_t> bits(5, ~uint64_t{0});
  bits[rank % 5] = 0;
  bool done = false;
  if (rank == n - 1) usleep(100000);
  CHECK_OK(rendezvous->Start(&bits));
  CHECK_OK(rendezvous->Finish(0.0005, &done));
  if (rank != n - 1) CHECK_TRUE(!done, "done while rank %d was late", n - 1);
  if (!done) CHECK_OK(rendezvous->Finish(-1.0, &done));
  for (int i = 0; i < 5; ++i) {
    const uint64_t want = i < n ? 0 : ~uint64_t{0};
    CHECK_TRUE(done && bits[i] == want, "late AND: word %d", i);
  }
  MPI_Barrier(comm);
  // Only rank 0 starts one: its hook ends the wait after 200 ms.
  if (rank == 0) {
    int calls = 0;
    rendezvous->SetWaitHook(PeerGoneAfter200Ms(&calls));
    CHECK_OK(rendezvous->Start(&bits));
    const Status s = rendezvous->Finish(-1.0, &done);
    CHECK_TRUE(s.code() == StatusCode::kUnavailable && !done, "%s",
               s.ToString().c_str());
    CHECK_TRUE(calls >= 20 && calls <= 400, "the hook ran %d times in 200 ms",
               calls);
  }
  MPI_Barrier(comm);
}

// Names in /dev/shm of segments that the process `pid` created.
int SegmentsLeft(int64_t pid) {
  const std::string prefix = "mpistrategy-" + std::to_string(pid) + "-";
  int found = 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) ++found;
  }
  closedir(dir);
  return found;
}

std::unique_ptr<ShmPlane> MakePlane(MPI_Comm comm, int64_t bytes,
                                    DataPlane* fallback) {
  std::unique_ptr<ShmPlane> plane;
  std::string why_not;
  CHECK_OK(ShmPlane::Create(comm, bytes, fallback, &plane, &why_not));
  CHECK_TRUE(plane != nullptr && why_not.empty(), "no plane: %s",
             why_not.c_str());
  return plane;
}

int Main(int argc, char** argv) {
  bool large = argc > 1 && std::string(argv[1]) == "--large";
  bool we_initialized = false;
  Status init = EnsureMpiInitialized(&we_initialized);
  if (!init.ok()) {
    std::fprintf(stderr, "%s\n", init.ToString().c_str());
    return 1;
  }
  std::unique_ptr<Transport> transport;
  CHECK_OK(MpiTransport::Create(MPI_COMM_WORLD, &transport));
  if (transport == nullptr) return 1;
  g_check_rank = transport->rank();
  const int n = transport->size();
  HostPlane mpi_plane(transport.get());
  HostStream stream;
  MPI_Comm comm = MPI_COMM_WORLD;
  // Rank 0 creates the segments.
  int64_t creator = getpid();
  MPI_Bcast(&creator, 1, MPI_INT64_T, 0, comm);
  {
    // The smallest segment: many rounds for small counts.
    std::unique_ptr<ShmPlane> small =
        MakePlane(comm, kShmMinBytesPerRank * n, &mpi_plane);
    // Slots larger than a round (kShmMaxRoundBytes) for any number of
    // ranks; the header takes far less than the extra MiB.
    std::unique_ptr<ShmPlane> plane =
        MakePlane(comm, 2 * n * (kShmMaxRoundBytes + (64 << 10)) + (1 << 20),
                  &mpi_plane);
    // Created, mapped everywhere and already unlinked.
    MPI_Barrier(comm);
    CHECK_TRUE(SegmentsLeft(creator) == 0, "segments left in /dev/shm: %d",
               SegmentsLeft(creator));
    if (small == nullptr || plane == nullptr) return 1;
    const int64_t round = small->round_bytes();
    // Up to 16 KiB one barrier (every rank reduces everything), above it
    // shares: both sides of that border for 1-, 2-, 4- and 8-byte dtypes.
    for (int64_t count : {0, 1, 5, 1031, 2048, 2049, 4096, 4097, 8193,
                          16384, 16385}) {
      CheckAllreduce(plane.get(), &stream, count, "large");
    }
    for (int64_t count :
         {int64_t{3} * round / 8 + 17, int64_t{2} * round + 3}) {
      CheckAllreduce(small.get(), &stream, count, "small");
    }
    // Its slots are larger than a round: rounds of kShmMaxRoundBytes per
    // rank, not a slot.
    CHECK_TRUE(plane->round_bytes() == kShmMaxRoundBytes,
               "large segment: rounds of %lld bytes",
               static_cast<long long>(plane->round_bytes()));
    CheckAllreduce(plane.get(), &stream, kShmMaxRoundBytes + 29, "large");
    // Parts smaller than a share, empty ones, and parts that span rounds.
    CheckAllreduceParts(plane.get(), &stream, {3, 0, 1, 1031, 0, 17},
                        "large");
    CheckAllreduceParts(small.get(), &stream,
                        {1, round / 3 + 5, 0, 2 * round + 9, 7, round - 1},
                        "small");
    for (int64_t base : {int64_t{0}, int64_t{5}, 2 * round + 7}) {
      CheckAllgatherv(small.get(), &stream, base);
      CheckAllgatherv(plane.get(), &stream, base);
    }
    for (int64_t bytes : {int64_t{0}, int64_t{3}, 5 * n * round + 11}) {
      CheckBroadcast(small.get(), &stream, bytes);
      CheckBroadcast(plane.get(), &stream, bytes);
    }
    for (int64_t base : {int64_t{0}, int64_t{9}, round / 2 + 1}) {
      CheckReducescatter(small.get(), &stream, base);
      CheckReducescatter(plane.get(), &stream, base);
    }
    CheckAlltoall(plane.get(), &stream);
    CheckHandoffs(plane.get(), &stream, comm);
    if (large) {
      // More than 2^31 elements, in place (sums of 1 + rank wrap in uint8).
      const int64_t count = (int64_t{1} << 31) + 4099;
      std::vector<uint8_t> big(count, static_cast<uint8_t>(g_check_rank + 1));
      CHECK_OK(plane->Allreduce(big.data(), big.data(), count,
                                DataType::kUint8, ReduceOp::kSum, &stream));
      const uint8_t want = static_cast<uint8_t>(n * (n + 1) / 2);
      int64_t bad = -1;
      for (int64_t i = 0; i < count && bad < 0; ++i) {
        if (big[i] != want) bad = i;
      }
      CHECK_TRUE(bad < 0, "large allreduce: element %lld",
                 static_cast<long long>(bad));
    }
    CheckLatePeerSleeps(plane.get(), &stream, comm);
    CheckRendezvous(plane.get(), comm);
    CheckWaitHook(small.get(), &stream, comm);
  }
  {
    // Too small a segment, or more than /dev/shm holds: no plane, on every
    // rank, with the reason.
    for (int64_t bytes : {kShmMinBytesPerRank * n - 1, int64_t{1} << 50}) {
      std::unique_ptr<ShmPlane> plane;
      std::string why_not;
      CHECK_OK(ShmPlane::Create(comm, bytes, &mpi_plane, &plane, &why_not));
      CHECK_TRUE(plane == nullptr && !why_not.empty(), "bytes %lld",
                 static_cast<long long>(bytes));
      if (g_check_rank == 0) {
        std::printf("no plane, as expected: %s\n", why_not.c_str());
      }
    }
  }
  MPI_Barrier(comm);
  CHECK_TRUE(SegmentsLeft(creator) == 0, "segments left in /dev/shm: %d",
             SegmentsLeft(creator));
  transport.reset();
  if (g_check_failures == 0) std::printf("rank %d: PASS\n", g_check_rank);
  std::fflush(stdout);
  FinalizeMpiIfWeInitialized();
  return g_check_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mpistrategy

int main(int argc, char** argv) { return mpistrategy::Main(argc, argv); }
