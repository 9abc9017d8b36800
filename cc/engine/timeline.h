// The engine timeline: a Chrome-trace JSON file (chrome://tracing, Perfetto)
// with one row per collective name (EngineConfig::timeline_path).
//
// File format: a JSON array of trace events.  pid is the rank; tid 0 is the
// "negotiation cycles" row (one "X" span per cycle that ran something), and
// every collective name gets its own row, named by a "thread_name" metadata
// ("M") event the first time the name is seen.  Per tensor the rows hold
// consecutive "X" (complete) spans:
//
//   NEGOTIATE                 Enqueue -> the response is known
//   QUEUE                     response -> its bucket starts executing
//   MEMCPY_IN_FUSION_BUFFER   fused allreduces through a fusion buffer
//   ALLREDUCE, ALLGATHER, ... the transport call (GPU: enqueueing the work)
//   MEMCPY_OUT_FUSION_BUFFER  fused allreduces through a fusion buffer
//
// (The shared-memory data plane gathers a fused bucket's tensors itself:
// its fused allreduces have no MEMCPY spans.)  The collective spans' args
// give the bucket's tensors, dtype and device; an allreduce's also its
// bytes, whether a lone tensor was reduced in place, and, where the plane
// chose it as it ran, how it handed the data to the other ranks' cores
// ("handoff": "cached" or "streaming" stores, handoff_tuner.h).
//
// plus "i" (instant) REQUEST events on the coordinator: when each rank's
// request for the name arrived in a slow cycle.  Complete events (not B/E
// pairs) make every event self-contained, so dropping one never unbalances
// a row.
//
// Threading: the engine thread records (Span, Instant, CycleSpan); a writer
// thread owned by the Timeline formats and writes.  Recording takes a mutex
// that the writer holds only to swap the queue out, never during I/O.  The
// queue is bounded: when the writer falls behind, events are dropped (never
// the row names) and the count is written as a final DROPPED_EVENTS instant.
// The file is valid JSON once the Timeline is destroyed; a crashed process
// leaves an array without its closing bracket, which the trace viewers
// accept.

#ifndef MPISTRATEGY_CC_ENGINE_TIMELINE_H_
#define MPISTRATEGY_CC_ENGINE_TIMELINE_H_

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cc/common/common.h"

namespace mpistrategy {

// Span and instant names.  Events keep the pointer: only these (or other
// string literals) may be passed as `activity` / `name` below.
extern const char kTimelineNegotiate[];        // "NEGOTIATE"
extern const char kTimelineQueue[];            // "QUEUE"
extern const char kTimelineMemcpyIn[];         // "MEMCPY_IN_FUSION_BUFFER"
extern const char kTimelineMemcpyOut[];        // "MEMCPY_OUT_FUSION_BUFFER"
extern const char kTimelineCycle[];            // "CYCLE"
extern const char kTimelineRequest[];          // "REQUEST"
// "ALLREDUCE", "ALLGATHER", "BROADCAST", "REDUCESCATTER", "ALLTOALL",
// "BARRIER".
const char* TimelineCollectiveName(CollectiveType type);

// Appends `s` to *out as a JSON string literal (quoted and escaped).
void AppendJsonString(const std::string& s, std::string* out);

// Builds the "args" object of an event: {"key": value, ...}.
class TimelineArgs {
 public:
  TimelineArgs& Add(const char* key, int64_t value);
  TimelineArgs& Add(const char* key, const std::string& value);
  TimelineArgs& Add(const char* key, const char* value) {
    return Add(key, std::string(value));
  }
  // "{...}", or "" when nothing was added.
  std::string Json() const;

 private:
  std::string body_;
};

class Timeline {
 public:
  struct Options {
    // Events waiting for the writer; beyond this they are dropped.
    size_t max_queued_events = size_t{1} << 16;
    // The writer wakes this often (and when the queue overflows, and at
    // destruction) to write and flush what was queued.
    double flush_interval_seconds = 0.1;
    // The process row's name; empty: "rank N".
    std::string process_name;
  };

  // The file `rank` writes for EngineConfig::timeline_path `path`, or "" when
  // it writes none.  Only rank 0 writes `path`, unless the path contains
  // "{rank}": then every rank writes it with each "{rank}" replaced by its
  // rank (e.g. "/tmp/trace.{rank}.json").
  static std::string PathForRank(const std::string& path, int rank);

  // Creates (truncates) `file` and starts the writer thread.
  //
  // Returns InvalidArgument naming the file and the OS error when it cannot
  // be opened for writing.
  static Status Open(const std::string& file, int rank, const Options& options,
                     std::unique_ptr<Timeline>* timeline);

  // Writes everything queued (and the DROPPED_EVENTS instant, if any were
  // dropped), closes the JSON array and the file, joins the writer.  Once
  // only: later calls do nothing, and events recorded after it are
  // dropped.  The engine calls it as soon as it stops, so that a job that
  // ends in MPI_Abort still leaves a complete file.
  void Close();
  // Close().
  ~Timeline();

  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // The clock of every timestamp below: SteadyClockSeconds
  // (stall_inspector.h), in seconds.  Thread-safe.
  double Now() const;

  // Recording.  Engine thread only (the row table is not synchronised).
  // Never waits for I/O.
  //
  // A complete span from `start` to `end` on the row of collective `row`.
  void Span(const std::string& row, const char* activity, double start,
            double end, std::string args = std::string());
  // An instant event on the row of collective `row`.
  void Instant(const std::string& row, const char* name, double at,
               std::string args = std::string());
  // A span on the "negotiation cycles" row.
  void CycleSpan(double start, double end, std::string args);

  // True if `file` names the file this timeline writes: its path, or
  // another link to it (opening it again would truncate it under the
  // writer).  False where `file` does not exist.  Thread-safe.
  bool Writes(const std::string& file) const;

  // Events dropped so far because the queue was full.  Thread-safe.
  int64_t dropped_events() const;
  const std::string& file() const { return file_; }

 private:
  struct Event {
    char phase = 'X';             // 'X', 'i' or 'M'
    const char* name = nullptr;   // a string literal
    int64_t tid = 0;
    int64_t ts_ns = 0;            // since the Timeline was opened
    int64_t dur_ns = 0;           // 'X' only
    std::string args;             // a JSON object, or empty
  };

  Timeline(std::FILE* out, std::string file, int rank, const Options& options);

  int64_t Row(const std::string& name);
  int64_t SinceOpen(double seconds) const;
  void Push(Event event);
  void WriterLoop();
  void Format(const Event& event, std::string* out);
  void Write(const std::string& text);

  std::FILE* const out_;
  const std::string file_;
  const int rank_;
  const Options options_;
  const double origin_;  // Now() at Open

  // Engine thread only.
  std::unordered_map<std::string, int64_t> rows_;

  // Guards the queue and the flags; never held during I/O.
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Event> queue_;
  size_t queued_bounded_ = 0;  // queued events other than 'M'
  bool overflowed_ = false;    // wakes the writer early
  bool stop_ = false;
  int64_t dropped_ = 0;

  // Close() only.
  std::once_flag closed_;

  // Writer thread only.
  bool first_event_ = true;
  bool write_failed_ = false;

  std::thread writer_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_TIMELINE_H_
