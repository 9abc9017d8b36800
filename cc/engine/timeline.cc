#include "cc/engine/timeline.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <system_error>
#include <utility>

#include <sys/stat.h>

#include "cc/common/logging.h"
#include "cc/engine/stall_inspector.h"

namespace mpistrategy {

const char kTimelineNegotiate[] = "NEGOTIATE";
const char kTimelineQueue[] = "QUEUE";
const char kTimelineMemcpyIn[] = "MEMCPY_IN_FUSION_BUFFER";
const char kTimelineMemcpyOut[] = "MEMCPY_OUT_FUSION_BUFFER";
const char kTimelineCycle[] = "CYCLE";
const char kTimelineRequest[] = "REQUEST";

namespace {

constexpr char kThreadName[] = "thread_name";
constexpr char kThreadSortIndex[] = "thread_sort_index";
constexpr char kProcessName[] = "process_name";
constexpr char kDroppedEvents[] = "DROPPED_EVENTS";
constexpr char kCyclesRow[] = "negotiation cycles";
constexpr int64_t kCyclesTid = 0;

// "12.345": microseconds (the trace format's unit) with nanosecond digits,
// printed from integers so that adjacent spans share exact boundaries.
void AppendMicros(int64_t ns, std::string* out) {
  char text[32];
  const char* sign = ns < 0 ? "-" : "";
  const int64_t a = ns < 0 ? -ns : ns;
  std::snprintf(text, sizeof(text), "%s%" PRId64 ".%03" PRId64, sign,
                a / 1000, a % 1000);
  out->append(text);
}

}  // namespace

const char* TimelineCollectiveName(CollectiveType type) {
  switch (type) {
    case CollectiveType::kAllreduce: return "ALLREDUCE";
    case CollectiveType::kAllgather: return "ALLGATHER";
    case CollectiveType::kBroadcast: return "BROADCAST";
    case CollectiveType::kReducescatter: return "REDUCESCATTER";
    case CollectiveType::kAlltoall: return "ALLTOALL";
    case CollectiveType::kBarrier: return "BARRIER";
  }
  return "COLLECTIVE";
}

void AppendJsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char text[8];
          std::snprintf(text, sizeof(text), "\\u%04x",
                        static_cast<unsigned>(static_cast<unsigned char>(c)));
          out->append(text);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

TimelineArgs& TimelineArgs::Add(const char* key, int64_t value) {
  if (!body_.empty()) body_.push_back(',');
  AppendJsonString(key, &body_);
  body_.push_back(':');
  body_.append(std::to_string(value));
  return *this;
}

TimelineArgs& TimelineArgs::Add(const char* key, const std::string& value) {
  if (!body_.empty()) body_.push_back(',');
  AppendJsonString(key, &body_);
  body_.push_back(':');
  AppendJsonString(value, &body_);
  return *this;
}

std::string TimelineArgs::Json() const {
  return body_.empty() ? std::string() : "{" + body_ + "}";
}

std::string Timeline::PathForRank(const std::string& path, int rank) {
  static constexpr char kRank[] = "{rank}";
  const size_t first = path.find(kRank);
  if (first == std::string::npos) return rank == 0 ? path : std::string();
  const std::string r = std::to_string(rank);
  std::string result = path;
  for (size_t at = first; at != std::string::npos;
       at = result.find(kRank, at + r.size())) {
    result.replace(at, sizeof(kRank) - 1, r);
  }
  return result;
}

Status Timeline::Open(const std::string& file, int rank,
                      const Options& options,
                      std::unique_ptr<Timeline>* timeline) {
  std::FILE* out = std::fopen(file.c_str(), "w");
  if (out == nullptr) {
    const int error = errno;
    return Status::InvalidArgument(
        "cannot open the timeline file \"" + file + "\" for writing: " +
        std::generic_category().message(error));
  }
  timeline->reset(new Timeline(out, file, rank, options));
  return Status::Ok();
}

Timeline::Timeline(std::FILE* out, std::string file, int rank,
                   const Options& options)
    : out_(out),
      file_(std::move(file)),
      rank_(rank),
      options_(options),
      origin_(Now()) {
  Event process;
  process.phase = 'M';
  process.name = kProcessName;
  process.args = TimelineArgs()
                     .Add("name", options.process_name.empty()
                                      ? "rank " + std::to_string(rank)
                                      : options.process_name)
                     .Json();
  Push(std::move(process));
  Event cycles;
  cycles.phase = 'M';
  cycles.name = kThreadName;
  cycles.tid = kCyclesTid;
  cycles.args = TimelineArgs().Add("name", kCyclesRow).Json();
  Push(std::move(cycles));
  writer_ = std::thread([this] { WriterLoop(); });
}

void Timeline::Close() {
  std::call_once(closed_, [this] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_one();
    writer_.join();
    std::fclose(out_);
  });
}

Timeline::~Timeline() { Close(); }

bool Timeline::Writes(const std::string& file) const {
  struct stat named, written;
  return stat(file.c_str(), &named) == 0 &&
         fstat(fileno(out_), &written) == 0 &&
         named.st_dev == written.st_dev && named.st_ino == written.st_ino;
}

double Timeline::Now() const { return SteadyClockSeconds(); }

int64_t Timeline::SinceOpen(double seconds) const {
  return std::llround((seconds - origin_) * 1e9);
}

int64_t Timeline::Row(const std::string& name) {
  auto it = rows_.find(name);
  if (it != rows_.end()) return it->second;
  const int64_t tid = static_cast<int64_t>(rows_.size()) + 1;
  rows_.emplace(name, tid);
  Event label;
  label.phase = 'M';
  label.name = kThreadName;
  label.tid = tid;
  label.args = TimelineArgs().Add("name", name).Json();
  Push(std::move(label));
  // Rows in first-seen order (viewers otherwise sort them by name).
  Event order;
  order.phase = 'M';
  order.name = kThreadSortIndex;
  order.tid = tid;
  order.args = TimelineArgs().Add("sort_index", tid).Json();
  Push(std::move(order));
  return tid;
}

void Timeline::Span(const std::string& row, const char* activity,
                    double start, double end, std::string args) {
  Event e;
  e.phase = 'X';
  e.name = activity;
  e.tid = Row(row);
  e.ts_ns = SinceOpen(start);
  e.dur_ns = std::max<int64_t>(0, SinceOpen(end) - e.ts_ns);
  e.args = std::move(args);
  Push(std::move(e));
}

void Timeline::Instant(const std::string& row, const char* name, double at,
                       std::string args) {
  Event e;
  e.phase = 'i';
  e.name = name;
  e.tid = Row(row);
  e.ts_ns = SinceOpen(at);
  e.args = std::move(args);
  Push(std::move(e));
}

void Timeline::CycleSpan(double start, double end, std::string args) {
  Event e;
  e.phase = 'X';
  e.name = kTimelineCycle;
  e.tid = kCyclesTid;
  e.ts_ns = SinceOpen(start);
  e.dur_ns = std::max<int64_t>(0, SinceOpen(end) - e.ts_ns);
  e.args = std::move(args);
  Push(std::move(e));
}

int64_t Timeline::dropped_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

void Timeline::Push(Event event) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;  // closed: nothing writes the queue any more
    // Row names are never dropped (one per name); everything else is
    // bounded so that a stalled disk cannot grow the engine's memory.
    if (event.phase != 'M') {
      if (queued_bounded_ >= options_.max_queued_events) {
        ++dropped_;
        wake = !overflowed_;
        overflowed_ = true;
      } else {
        ++queued_bounded_;
        queue_.push_back(std::move(event));
      }
    } else {
      queue_.push_back(std::move(event));
    }
  }
  if (wake) wake_.notify_one();
}

void Timeline::WriterLoop() {
  Write("[\n");
  std::vector<Event> batch;
  std::string text;
  bool stop = false;
  while (!stop) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(
          lock,
          std::chrono::duration<double>(options_.flush_interval_seconds),
          [this] { return stop_ || overflowed_; });
      batch.swap(queue_);
      queued_bounded_ = 0;
      overflowed_ = false;
      stop = stop_;
    }
    text.clear();
    for (const Event& e : batch) Format(e, &text);
    batch.clear();
    Write(text);
  }
  int64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped = dropped_;
  }
  text.clear();
  if (dropped > 0) {
    Event e;
    e.phase = 'i';
    e.name = kDroppedEvents;
    e.tid = kCyclesTid;
    e.ts_ns = SinceOpen(Now());
    e.args = TimelineArgs().Add("dropped_events", dropped).Json();
    Format(e, &text);
    LogLine(rank_, "timeline " + file_ + ": dropped " +
                       std::to_string(dropped) +
                       " events because the writer could not keep up");
  }
  text.append("\n]\n");
  Write(text);
}

void Timeline::Format(const Event& e, std::string* out) {
  out->append(first_event_ ? "" : ",\n");
  first_event_ = false;
  out->append("{\"name\":\"");
  out->append(e.name);  // a literal without characters to escape
  out->append("\",\"ph\":\"");
  out->push_back(e.phase);
  out->append("\",\"pid\":");
  out->append(std::to_string(rank_));
  out->append(",\"tid\":");
  out->append(std::to_string(e.tid));
  if (e.phase != 'M') {
    out->append(",\"ts\":");
    AppendMicros(e.ts_ns, out);
  }
  if (e.phase == 'X') {
    out->append(",\"dur\":");
    AppendMicros(e.dur_ns, out);
  } else if (e.phase == 'i') {
    out->append(",\"s\":\"t\"");
  }
  if (!e.args.empty()) {
    out->append(",\"args\":");
    out->append(e.args);
  }
  out->push_back('}');
}

void Timeline::Write(const std::string& text) {
  if (write_failed_ || text.empty()) return;
  if (std::fwrite(text.data(), 1, text.size(), out_) != text.size() ||
      std::fflush(out_) != 0) {
    const int error = errno;
    write_failed_ = true;
    LogLine(rank_, "timeline " + file_ + ": writing failed (" +
                       std::generic_category().message(error) +
                       "); no further events are written");
  }
}

}  // namespace mpistrategy
