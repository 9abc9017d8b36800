#include "cc/transport/shm_plane.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "cc/common/checks.h"
#include "cc/common/reduce_kernels.h"
#include "cc/common/streaming_copy.h"
#include "cc/transport/peer_wait.h"

namespace mpistrategy {

namespace {

constexpr int64_t kPage = 4096;
// Allreduces up to this size take the one-barrier path (RunAllreduce);
// below kShmMinBytesPerRank, so they always fit one slot.
constexpr int64_t kSmallAllreduceBytes = 16 << 10;
// Reductions run in blocks of this many bytes, small enough that a block
// and its sources stay in the L1 cache between the passes.
constexpr int64_t kBlockBytes = 8 << 10;

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// With non-temporal stores when `streaming` (streaming_copy.h), else
// memcpy.
void Copy(char* dst, const char* src, int64_t bytes, bool streaming) {
  if (streaming) {
    StreamingCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

Status NeedHost(const Stream* stream) {
  if (stream == nullptr || !stream->host_synchronous()) {
    return Status::Internal(
        "the shared-memory data plane was given buffers of a device stream");
  }
  return Status::Ok();
}

Status CheckMean(DataType dtype, ReduceOp op) {
  if (op == ReduceOp::kMean && !IsFloatingDataType(dtype)) {
    return Status::InvalidArgument(std::string("cannot average ") +
                                   DataTypeName(dtype) +
                                   " values (mean needs a floating dtype)");
  }
  return Status::Ok();
}

std::string Errno(const std::string& what, int error) {
  return what + ": " + std::strerror(error);
}

// What the host's first rank tells the others.
struct Offer {
  int32_t ok = 0;
  char name[64] = {0};
  char why[400] = {0};
};

// Maps `bytes` of the open segment `fd` into *base; "" on success.
std::string MapSegment(int fd, int64_t bytes, void** base) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Errno("mmap of the shared-memory segment", errno);
  *base = p;
  return "";
}

// Creates, sizes and maps the segment `name`; "" on success, else why not
// (nothing is left behind then).
std::string CreateSegment(const std::string& name, int64_t bytes,
                          void** base, bool* name_taken) {
  *base = nullptr;
  *name_taken = false;
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) == 0) {
    const int64_t free_bytes =
        static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    if (free_bytes < bytes) {
      return "/dev/shm has " + std::to_string(free_bytes) +
             " bytes free, the segment needs " + std::to_string(bytes) +
             " (a container may need a larger --shm-size, or lower "
             "shm_bytes)";
    }
  }
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *name_taken = errno == EEXIST;
    return Errno("shm_open(\"" + name + "\")", errno);
  }
  std::string why;
  // posix_fallocate reserves the pages now: a segment larger than what
  // /dev/shm holds would otherwise fail later with SIGBUS on first touch.
  if (ftruncate(fd, bytes) != 0) {
    why = Errno("ftruncate of the shared-memory segment", errno);
  } else if (int rc = posix_fallocate(fd, 0, bytes); rc != 0) {
    why = Errno("reserving " + std::to_string(bytes) +
                    " bytes in /dev/shm (posix_fallocate)",
                rc);
  } else {
    why = MapSegment(fd, bytes, base);
  }
  close(fd);
  if (!why.empty()) shm_unlink(name.c_str());
  return why;
}

// Maps the existing segment `name` of `bytes`; "" on success.
std::string OpenSegment(const std::string& name, int64_t bytes, void** base) {
  *base = nullptr;
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return Errno("shm_open(\"" + name + "\")", errno);
  std::string why;
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size != bytes) {
    why = "the shared-memory segment \"" + name + "\" has an unexpected size";
  } else {
    why = MapSegment(fd, bytes, base);
  }
  close(fd);
  return why;
}

// Where the word with the way of the next large allreduce lies in the
// segment (shm_plane.h): on a line of its own after the rendezvous' area.
int64_t HandoffWordOffset(int size) {
  return HostRounds::kBytes +
         RoundUp(HostRendezvous::AreaBytes(size), kCacheLineBytes);
}

// Every segment's name starts with this, then the creator's PID and a '-'.
constexpr char kSegmentPrefix[] = "mpistrategy-";

// A name no other job on the host uses at the moment (the creator retries
// with another on EEXIST).
std::string SegmentName(int attempt) {
  static std::atomic<int> counter{0};
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  return "/" + std::string(kSegmentPrefix) + std::to_string(getpid()) + "-" +
         std::to_string(counter.fetch_add(1)) + "-" +
         std::to_string(
             std::chrono::duration_cast<std::chrono::nanoseconds>(now)
                 .count() %
             1000000007) +
         "-" + std::to_string(attempt);
}

// The creator's PID in a segment's file name, or 0 if it is not one.
pid_t CreatorPid(const char* file_name) {
  const size_t prefix = sizeof(kSegmentPrefix) - 1;
  if (std::strncmp(file_name, kSegmentPrefix, prefix) != 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(file_name + prefix, &end, 10);
  if (end == file_name + prefix || *end != '-' || pid <= 0) return 0;
  return static_cast<pid_t>(pid);
}

}  // namespace

std::vector<std::string> RemoveAbandonedShmSegments(const std::string& dir,
                                                    int min_age_seconds) {
  std::vector<std::string> removed;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return removed;
  const time_t now = std::time(nullptr);
  while (const dirent* e = readdir(d)) {
    const pid_t pid = CreatorPid(e->d_name);
    if (pid == 0) continue;
    const std::string path = dir + "/" + e->d_name;
    struct stat st;
    // Another user's, or too young: its creator may still be setting it up.
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || now - st.st_mtime < min_age_seconds) {
      continue;
    }
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // the creator lives
    if (unlink(path.c_str()) == 0) removed.push_back(path);
  }
  closedir(d);
  return removed;
}

Status ShmPlane::Create(MPI_Comm comm, int64_t segment_bytes,
                        DataPlane* fallback, std::unique_ptr<ShmPlane>* out,
                        std::string* why_not) {
  out->reset();
  why_not->clear();
  int rank = 0;
  int size = 1;
  MPISTRATEGY_MPI_CHECK(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  const int64_t header =
      RoundUp(HandoffWordOffset(size) + kCacheLineBytes, kPage);
  const int64_t slot =
      std::max<int64_t>(0, segment_bytes - header) / (2 * size) / kPage * kPage;
  const int64_t total = header + 2 * size * slot;

  Offer offer;
  void* base = nullptr;
  std::string name;
  if (rank == 0) {
    std::string why;
    if (segment_bytes < kShmMinBytesPerRank * size) {
      why = "shm_bytes is " + std::to_string(segment_bytes) + ", less than " +
            std::to_string(kShmMinBytesPerRank) + " per rank of the host (" +
            std::to_string(size) + " ranks)";
    } else {
      bool name_taken = true;
      for (int attempt = 0; attempt < 8 && name_taken; ++attempt) {
        name = SegmentName(attempt);
        why = CreateSegment(name, total, &base, &name_taken);
      }
    }
    if (base != nullptr) {
      offer.ok = 1;
      std::snprintf(offer.name, sizeof(offer.name), "%s", name.c_str());
    } else {
      std::snprintf(offer.why, sizeof(offer.why), "%s", why.c_str());
    }
  }
  int rc = MPI_Bcast(&offer, sizeof(offer), MPI_BYTE, 0, comm);
  std::string why;
  if (rc == MPI_SUCCESS && offer.ok && rank != 0) {
    why = OpenSegment(offer.name, total, &base);
  }
  int mapped = base != nullptr ? 1 : 0;
  if (rc == MPI_SUCCESS) {
    rc = MPI_Allreduce(MPI_IN_PLACE, &mapped, 1, MPI_INT, MPI_MIN, comm);
  }
  // Every rank has it mapped (or gave up): the name can go, so that the
  // segment vanishes with the last process that maps it.
  if (rank == 0 && offer.ok) shm_unlink(offer.name);
  if (rc != MPI_SUCCESS || !offer.ok || !mapped) {
    if (base != nullptr) munmap(base, total);
    if (rc != MPI_SUCCESS) return MpiError(rc, "setting up shared memory");
    if (!offer.ok) {
      *why_not = offer.why;
    } else if (!why.empty()) {
      *why_not = why;
    } else {
      *why_not = "a rank of this host could not map the shared-memory segment";
    }
    return Status::Ok();
  }
  out->reset(new ShmPlane(rank, size, base, total, header, slot, fallback));
  return Status::Ok();
}

ShmPlane::ShmPlane(int rank, int size, void* base, int64_t mapped_bytes,
                   int64_t header_bytes, int64_t slot_bytes,
                   DataPlane* fallback)
    : rank_(rank),
      size_(size),
      mapping_(base, [mapped_bytes](void* p) { munmap(p, mapped_bytes); }),
      base_(base),
      barriers_(static_cast<char*>(base), size),
      header_bytes_(header_bytes),
      slot_bytes_(slot_bytes),
      round_bytes_(std::min(slot_bytes, kShmMaxRoundBytes)),
      fallback_(fallback),
      handoff_word_(reinterpret_cast<uint32_t*>(static_cast<char*>(base) +
                                                HandoffWordOffset(size))),
      block_(kBlockBytes) {
  SetHandoffTuning(HandoffTunerSettings());
}

ShmPlane::~ShmPlane() = default;

void ShmPlane::SetHandoffTuning(const HandoffTunerSettings& settings) {
  timed_bytes_ = settings.min_bytes;
  next_timed_way_ = settings.initial;
  untimed_way_ = settings.initial;
  last_handoff_ = settings.initial;
  last_bytes_ = 0;
  tuner_.reset(rank_ == 0 ? new HandoffTuner(settings) : nullptr);
}

std::unique_ptr<HostRendezvous> ShmPlane::CreateRendezvous() const {
  // After the barrier's words.
  return std::make_unique<HostRendezvous>(
      mapping_, static_cast<char*>(base_) + HostRounds::kBytes, rank_, size_);
}

char* ShmPlane::Slot(int rank) const {
  return static_cast<char*>(base_) + header_bytes_ +
         (static_cast<int64_t>(set_) * size_ + rank) * slot_bytes_;
}

Status ShmPlane::Barrier() {
  barriers_.Arrive();
  bool passed = false;
  return barriers_.Wait(PeerWait::Clock::time_point::max(), wait_hook_,
                        &passed);
}

void ShmPlane::ReduceSlots(const char* const* srcs, char* dst, int64_t count,
                           DataType dtype, ReduceOp op, bool streaming,
                           char* also_to) {
  const int64_t esize = DataTypeSize(dtype);
  const int64_t per_block = kBlockBytes / esize;
  char* block = block_.data();
  // MEAN divides in the last pass over the block, not in one of its own.
  const int64_t divisor = op == ReduceOp::kMean ? size_ : 1;
  for (int64_t i = 0; i < count; i += per_block) {
    const int64_t n = std::min(per_block, count - i);
    const int64_t offset = i * esize;
    // One pass per further rank: the first combines two slots into the
    // block.  Checked by the caller (CheckMean; size_ > 1): cannot fail.
    for (int q = 1; q < size_; ++q) {
      ReducePair(dtype, op, q == 1 ? srcs[0] + offset : block,
                 srcs[q] + offset, block, n, q == size_ - 1 ? divisor : 1);
    }
    Copy(dst + offset, block, n * esize, streaming);
    if (also_to != nullptr) std::memcpy(also_to + offset, block, n * esize);
  }
}

namespace {

// Calls fn(part, first element in the part, first element in the range,
// elements) for every non-empty piece of the range [begin, begin + n) of
// the parts laid end to end; `starts` holds each part's first element and
// the total last.
template <typename Fn>
void ForEachPiece(const std::vector<int64_t>& starts, int64_t begin,
                  int64_t n, Fn fn) {
  const int num_parts = static_cast<int>(starts.size()) - 1;
  int k = static_cast<int>(
      std::upper_bound(starts.begin(), starts.end() - 1, begin) -
      starts.begin() - 1);
  for (int64_t at = begin; at < begin + n && k < num_parts; ++k) {
    const int64_t end = std::min(starts[k + 1], begin + n);
    if (end > at) fn(k, at - starts[k], at - begin, end - at);
    at = std::max(at, end);
  }
}

}  // namespace

void ShmPlane::CopyIn(const AllreducePart* parts, int64_t begin, int64_t n,
                      int64_t esize, char* to, bool streaming) const {
  ForEachPiece(starts_, begin, n,
               [&](int k, int64_t in_part, int64_t in_range, int64_t count) {
                 Copy(to + in_range * esize,
                      static_cast<const char*>(parts[k].in) + in_part * esize,
                      count * esize, streaming);
               });
}

void ShmPlane::CopyOut(const AllreducePart* parts, int64_t begin, int64_t n,
                       int64_t esize, const char* from) const {
  ForEachPiece(starts_, begin, n,
               [&](int k, int64_t in_part, int64_t in_range, int64_t count) {
                 std::memcpy(static_cast<char*>(parts[k].out) +
                                 in_part * esize,
                             from + in_range * esize, count * esize);
               });
}

Status ShmPlane::Allreduce(const void* in, void* out, int64_t count,
                           DataType dtype, ReduceOp op, Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  const AllreducePart part = {in, out, count};
  return RunAllreduce(&part, 1, dtype, op);
}

Status ShmPlane::AllreduceParts(const std::vector<AllreducePart>& parts,
                                DataType dtype, ReduceOp op, Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  return RunAllreduce(parts.data(), static_cast<int>(parts.size()), dtype,
                     op);
}

Status ShmPlane::RunAllreduce(const AllreducePart* parts, int num_parts,
                             DataType dtype, ReduceOp op) {
  last_was_large_ = false;
  MPISTRATEGY_RETURN_IF_ERROR(CheckMean(dtype, op));
  const int64_t esize = DataTypeSize(dtype);
  starts_.assign(1, 0);
  for (int k = 0; k < num_parts; ++k) {
    starts_.push_back(starts_.back() + parts[k].count);
  }
  const int64_t count = starts_.back();
  if (size_ == 1) {
    for (int k = 0; k < num_parts; ++k) {
      if (parts[k].in != parts[k].out && parts[k].count > 0) {
        std::memcpy(parts[k].out, parts[k].in, parts[k].count * esize);
      }
    }
    return Status::Ok();
  }
  srcs_.resize(size_);
  if (count * esize <= kSmallAllreduceBytes) {
    // Small: every rank reduces the whole vector from every slot.  One
    // barrier instead of two, and no copy out; the two slot sets alternate,
    // so a rank may write its next slot while a slower one still reads this
    // one (it cannot pass the next barrier before that one is done).
    CopyIn(parts, 0, count, esize, Slot(rank_), /*streaming=*/false);
    MPISTRATEGY_RETURN_IF_ERROR(Barrier());
    ForEachPiece(
        starts_, 0, count,
        [&](int k, int64_t in_part, int64_t in_range, int64_t elements) {
          for (int q = 0; q < size_; ++q) {
            srcs_[q] = Slot(q) + in_range * esize;
          }
          ReduceSlots(srcs_.data(),
                      static_cast<char*>(parts[k].out) + in_part * esize,
                      elements, dtype, op);
        });
    NextSet();
    return Status::Ok();
  }
  return RunLargeAllreduce(parts, count, dtype, op);
}

Status ShmPlane::RunLargeAllreduce(const AllreducePart* parts, int64_t count,
                                   DataType dtype, ReduceOp op) {
  const int64_t esize = DataTypeSize(dtype);
  const int64_t bytes = count * esize;
  const bool timed = bytes >= timed_bytes_;
  const Handoff way = timed ? next_timed_way_ : untimed_way_;
  const bool streaming = way == Handoff::kStreaming;
  // Rank 0 times this rank's copying and reducing, without the barriers'
  // waits (whose length is the other ranks' and the scheduler's).
  const bool timing = timed && tuner_ != nullptr;
  using Clock = std::chrono::steady_clock;
  Clock::duration working{};
  Clock::time_point began;
  auto start_work = [&] {
    if (timing) began = Clock::now();
  };
  auto end_work = [&] {
    if (timing) working += Clock::now() - began;
  };
  if (timing) {
    if (last_bytes_ > 0) {
      tuner_->Record(last_timed_way_, last_bytes_, last_seconds_);
    }
    const uint32_t word =
        static_cast<uint32_t>(tuner_->Next()) |
        static_cast<uint32_t>(tuner_->incumbent()) << 1;
    __atomic_store_n(handoff_word_, word, __ATOMIC_RELAXED);
  }
  const int64_t chunk = round_bytes_ / esize;
  // Shares start on cache lines, so no two ranks write one line.
  const int64_t align = kCacheLineBytes / esize;
  for (int64_t done = 0; done < count; done += chunk) {
    const int64_t n = std::min(chunk, count - done);
    const int64_t share = RoundUp((n + size_ - 1) / size_, align);
    const int64_t lo = std::min(n, rank_ * share);
    const int64_t hi = std::min(n, lo + share);
    // This rank's own share skips its slot: the peers only read the other
    // shares from it, and this rank reduces its share straight from its
    // input into its output and into the slot (for the peers).  That saves
    // a copy in and a copy out of 1/size of the bytes.  What goes into the
    // slot is read by the other ranks' cores next: it is written the way
    // rank 0's tuner picked (shm_plane.h).
    start_work();
    CopyIn(parts, done, lo, esize, Slot(rank_), streaming);
    CopyIn(parts, done + hi, n - hi, esize, Slot(rank_) + hi * esize,
           streaming);
    end_work();
    MPISTRATEGY_RETURN_IF_ERROR(Barrier());
    if (timed && done == 0) {
      // Written by rank 0 before it arrived (shm_plane.h).
      const uint32_t word = __atomic_load_n(handoff_word_, __ATOMIC_RELAXED);
      next_timed_way_ = static_cast<Handoff>(word & 1);
      untimed_way_ = static_cast<Handoff>((word >> 1) & 1);
    }
    start_work();
    ForEachPiece(
        starts_, done + lo, hi - lo,
        [&](int k, int64_t in_part, int64_t in_range, int64_t elements) {
          const int64_t at = (lo + in_range) * esize;  // byte in the slots
          for (int q = 0; q < size_; ++q) srcs_[q] = Slot(q) + at;
          srcs_[rank_] =
              static_cast<const char*>(parts[k].in) + in_part * esize;
          ReduceSlots(srcs_.data(), Slot(rank_) + at, elements, dtype, op,
                      streaming,
                      static_cast<char*>(parts[k].out) + in_part * esize);
        });
    end_work();
    MPISTRATEGY_RETURN_IF_ERROR(Barrier());
    start_work();
    for (int q = 0; q < size_; ++q) {
      const int64_t qlo = std::min(n, q * share);
      const int64_t qhi = std::min(n, qlo + share);
      if (q != rank_ && qhi > qlo) {
        CopyOut(parts, done + qlo, qhi - qlo, esize, Slot(q) + qlo * esize);
      }
    }
    end_work();
    NextSet();
  }
  if (timing) {
    last_timed_way_ = way;
    last_bytes_ = bytes;
    last_seconds_ = std::chrono::duration<double>(working).count();
  }
  last_handoff_ = way;
  last_was_large_ = true;
  return Status::Ok();
}

Status ShmPlane::Allgatherv(const void* in, void* out,
                            const std::vector<int64_t>& bytes_per_rank,
                            Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  if (static_cast<int>(bytes_per_rank.size()) != size_) {
    return Status::Internal("shared-memory allgather: wrong number of blocks");
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t most =
      *std::max_element(bytes_per_rank.begin(), bytes_per_rank.end());
  for (int64_t done = 0; done < most; done += round_bytes_) {
    const int64_t mine =
        std::clamp<int64_t>(bytes_per_rank[rank_] - done, 0, round_bytes_);
    if (mine > 0) std::memcpy(Slot(rank_), src + done, mine);
    MPISTRATEGY_RETURN_IF_ERROR(Barrier());
    int64_t offset = 0;
    for (int q = 0; q < size_; ++q) {
      const int64_t n =
          std::clamp<int64_t>(bytes_per_rank[q] - done, 0, round_bytes_);
      char* to = dst + offset + done;
      // In place (our block already where it belongs): nothing to copy.
      if (n > 0 && !(q == rank_ && to == src + done)) {
        std::memcpy(to, Slot(q), n);
      }
      offset += bytes_per_rank[q];
    }
    NextSet();
  }
  return Status::Ok();
}

Status ShmPlane::Broadcast(void* buffer, int64_t bytes, int root_rank,
                           Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  if (root_rank < 0 || root_rank >= size_) {
    return Status::Internal("shared-memory broadcast: bad root rank " +
                            std::to_string(root_rank));
  }
  if (size_ == 1) return Status::Ok();
  char* data = static_cast<char*>(buffer);
  // Only the root writes, so a round may take every rank's share of the
  // set: the set's slots are contiguous, and round_bytes_ * size_ bytes
  // from Slot(0) on stay inside it.
  const int64_t round = round_bytes_ * size_;
  for (int64_t done = 0; done < bytes; done += round) {
    const int64_t n = std::min(round, bytes - done);
    if (rank_ == root_rank) std::memcpy(Slot(0), data + done, n);
    MPISTRATEGY_RETURN_IF_ERROR(Barrier());
    if (rank_ != root_rank) std::memcpy(data + done, Slot(0), n);
    NextSet();
  }
  return Status::Ok();
}

Status ShmPlane::Reducescatter(const void* in, void* out,
                               const std::vector<int64_t>& counts,
                               DataType dtype, ReduceOp op, Stream* stream) {
  MPISTRATEGY_RETURN_IF_ERROR(NeedHost(stream));
  MPISTRATEGY_RETURN_IF_ERROR(CheckMean(dtype, op));
  if (static_cast<int>(counts.size()) != size_) {
    return Status::Internal(
        "shared-memory reducescatter: wrong number of blocks");
  }
  const int64_t esize = DataTypeSize(dtype);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // Elements of each block per round, a whole number of cache lines.
  const int64_t align = kCacheLineBytes / esize;
  const int64_t per = round_bytes_ / size_ / esize / align * align;
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  srcs_.resize(size_);
  for (int64_t done = 0; done < most; done += per) {
    int64_t first = 0;  // block q's first element in `in`
    for (int q = 0; q < size_; ++q) {
      const int64_t n = std::clamp<int64_t>(counts[q] - done, 0, per);
      if (n > 0) {
        std::memcpy(Slot(rank_) + q * per * esize,
                    src + (first + done) * esize, n * esize);
      }
      first += counts[q];
    }
    MPISTRATEGY_RETURN_IF_ERROR(Barrier());
    const int64_t n = std::clamp<int64_t>(counts[rank_] - done, 0, per);
    if (n > 0) {
      for (int q = 0; q < size_; ++q) {
        srcs_[q] = Slot(q) + rank_ * per * esize;
      }
      ReduceSlots(srcs_.data(), dst + done * esize, n, dtype, op);
    }
    NextSet();
  }
  return Status::Ok();
}

Status ShmPlane::Alltoallv(const void* in,
                           const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes,
                           Stream* stream) {
  if (fallback_ == nullptr) {
    return Status::Internal(
        "alltoall is not available on this shared-memory plane");
  }
  return fallback_->Alltoallv(in, send_bytes, out, recv_bytes, stream);
}

}  // namespace mpistrategy
