// Tests of the timeline: the file format and its bounded queue (Timeline
// alone), and the spans the engine records (engines over FakeTransport).

#include "cc/engine/timeline.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cc/engine/engine.h"
#include <gtest/gtest.h>
#include "cc/transport/fake_transport.h"

namespace mpistrategy {
namespace {

// ---- a minimal JSON parser (strict enough to catch malformed output) ----

struct Json {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0.0;
  std::string str;
  std::vector<Json> items;
  std::map<std::string, Json> fields;

  bool Has(const std::string& key) const { return fields.count(key) > 0; }
  const Json& operator[](const std::string& key) const {
    static const Json* null = new Json;
    auto it = fields.find(key);
    return it == fields.end() ? *null : it->second;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : t_(text) {}

  bool Parse(Json* out) {
    Space();
    if (!Value(out)) return false;
    Space();
    return i_ == t_.size();
  }

 private:
  void Space() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' ||
                              t_[i_] == '\r' || t_[i_] == '\t')) {
      ++i_;
    }
  }
  bool Literal(const char* word) {
    const std::string w(word);
    if (t_.compare(i_, w.size(), w) != 0) return false;
    i_ += w.size();
    return true;
  }
  bool Value(Json* v) {
    if (i_ >= t_.size()) return false;
    const char c = t_[i_];
    if (c == '{') return Object(v);
    if (c == '[') return Array(v);
    if (c == '"') {
      v->kind = Json::Kind::kString;
      return String(&v->str);
    }
    if (c == 't' || c == 'f') {
      v->kind = Json::Kind::kBool;
      v->boolean = c == 't';
      return Literal(c == 't' ? "true" : "false");
    }
    if (c == 'n') return Literal("null");
    return Number(v);
  }
  bool Number(Json* v) {
    const size_t start = i_;
    if (i_ < t_.size() && t_[i_] == '-') ++i_;
    size_t digits = 0;
    while (i_ < t_.size() && isdigit(static_cast<unsigned char>(t_[i_]))) {
      ++i_;
      ++digits;
    }
    if (digits == 0) return false;
    if (i_ < t_.size() && t_[i_] == '.') {
      ++i_;
      digits = 0;
      while (i_ < t_.size() && isdigit(static_cast<unsigned char>(t_[i_]))) {
        ++i_;
        ++digits;
      }
      if (digits == 0) return false;
    }
    v->kind = Json::Kind::kNumber;
    v->number = std::stod(t_.substr(start, i_ - start));
    return true;
  }
  bool String(std::string* s) {
    ++i_;  // '"'
    while (i_ < t_.size() && t_[i_] != '"') {
      const char c = t_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c != '\\') {
        s->push_back(c);
        continue;
      }
      if (i_ >= t_.size()) return false;
      const char e = t_[i_++];
      switch (e) {
        case '"': s->push_back('"'); break;
        case '\\': s->push_back('\\'); break;
        case '/': s->push_back('/'); break;
        case 'n': s->push_back('\n'); break;
        case 'r': s->push_back('\r'); break;
        case 't': s->push_back('\t'); break;
        case 'b': s->push_back('\b'); break;
        case 'f': s->push_back('\f'); break;
        case 'u': {
          if (i_ + 4 > t_.size()) return false;
          const int code = std::stoi(t_.substr(i_, 4), nullptr, 16);
          if (code >= 0x80) return false;  // not produced by the timeline
          s->push_back(static_cast<char>(code));
          i_ += 4;
          break;
        }
        default:
          return false;
      }
    }
    if (i_ >= t_.size()) return false;
    ++i_;  // '"'
    return true;
  }
  bool Array(Json* v) {
    v->kind = Json::Kind::kArray;
    ++i_;
    Space();
    if (i_ < t_.size() && t_[i_] == ']') {
      ++i_;
      return true;
    }
    for (;;) {
      v->items.emplace_back();
      Space();
      if (!Value(&v->items.back())) return false;
      Space();
      if (i_ >= t_.size()) return false;
      if (t_[i_] == ']') {
        ++i_;
        return true;
      }
      if (t_[i_++] != ',') return false;
    }
  }
  bool Object(Json* v) {
    v->kind = Json::Kind::kObject;
    ++i_;
    Space();
    if (i_ < t_.size() && t_[i_] == '}') {
      ++i_;
      return true;
    }
    for (;;) {
      Space();
      std::string key;
      if (i_ >= t_.size() || t_[i_] != '"' || !String(&key)) return false;
      Space();
      if (i_ >= t_.size() || t_[i_++] != ':') return false;
      Space();
      if (!Value(&v->fields[key])) return false;
      Space();
      if (i_ >= t_.size()) return false;
      if (t_[i_] == '}') {
        ++i_;
        return true;
      }
      if (t_[i_++] != ',') return false;
    }
  }

  const std::string& t_;
  size_t i_ = 0;
};

// ---- helpers ------------------------------------------------------------

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The events of a closed timeline file; fails the test when it is not a
// JSON array.
std::vector<Json> ReadEvents(const std::string& path) {
  const std::string text = ReadFile(path);
  Json root;
  EXPECT_TRUE(JsonParser(text).Parse(&root)) << path << ":\n" << text;
  EXPECT_TRUE(root.kind == Json::Kind::kArray) << text;
  return root.items;
}

// A fresh directory for one test's files.
class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "timeline_testXXXXXX")
            .string();
    path_ = mkdtemp(&pattern[0]) == nullptr ? "/tmp" : pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (path_ != "/tmp") std::filesystem::remove_all(path_, ignored);
  }
  std::string File(const std::string& name) const {
    return path_ + "/" + name;
  }
  int NumFiles() const {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) {
      static_cast<void>(entry);
      ++n;
    }
    return n;
  }

 private:
  std::string path_;
};

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// One row of a timeline: its name and its events in file order.
struct Row {
  std::string name;
  std::vector<const Json*> events;
};

// Rows by tid, from the "thread_name" metadata events.
// The rows point into `events`, which must outlive them (a temporary would
// leave them dangling: hence the deleted overload).
std::map<int64_t, Row> Rows(std::vector<Json>&& events) = delete;
std::map<int64_t, Row> Rows(const std::vector<Json>& events) {
  std::map<int64_t, Row> rows;
  for (const Json& e : events) {
    if (e["ph"].str == "M" && e["name"].str == "thread_name") {
      rows[static_cast<int64_t>(e["tid"].number)].name = e["args"]["name"].str;
    }
  }
  for (const Json& e : events) {
    if (e["ph"].str == "M") continue;
    rows[static_cast<int64_t>(e["tid"].number)].events.push_back(&e);
  }
  return rows;
}

const Row* FindRow(const std::map<int64_t, Row>& rows,
                   const std::string& name) {
  for (const auto& kv : rows) {
    if (kv.second.name == name) return &kv.second;
  }
  return nullptr;
}

// The names of the row's complete spans, ordered by start time, after
// checking that they do not overlap.
std::vector<std::string> SpanSequence(const Row& row) {
  std::vector<const Json*> spans;
  for (const Json* e : row.events) {
    if (e->operator[]("ph").str == "X") spans.push_back(e);
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const Json* a, const Json* b) {
                     return (*a)["ts"].number < (*b)["ts"].number;
                   });
  std::vector<std::string> names;
  double end = -1.0;
  for (const Json* e : spans) {
    const double ts = (*e)["ts"].number;
    EXPECT_GE((*e)["dur"].number, 0.0) << row.name;
    // Millisecond-scale values printed with 3 decimals: exact boundaries up
    // to double rounding.
    EXPECT_GE(ts + 1e-6, end) << row.name << ": " << (*e)["name"].str
                              << " starts before the previous span ends";
    end = ts + (*e)["dur"].number;
    names.push_back((*e)["name"].str);
  }
  return names;
}

// ---- Timeline alone -----------------------------------------------------

TEST(Timeline, PathForRank) {
  EXPECT_EQ(Timeline::PathForRank("", 0), "");
  EXPECT_EQ(Timeline::PathForRank("", 3), "");
  EXPECT_EQ(Timeline::PathForRank("/t/trace.json", 0), "/t/trace.json");
  EXPECT_EQ(Timeline::PathForRank("/t/trace.json", 1), "");
  EXPECT_EQ(Timeline::PathForRank("/t/trace.{rank}.json", 0),
            "/t/trace.0.json");
  EXPECT_EQ(Timeline::PathForRank("/t/trace.{rank}.json", 12),
            "/t/trace.12.json");
  EXPECT_EQ(Timeline::PathForRank("/t/{rank}/trace.{rank}.json", 1),
            "/t/1/trace.1.json");
  EXPECT_EQ(Timeline::PathForRank("/t/{rank}", 0), "/t/0");
}

TEST(Timeline, OpenFailureNamesFileAndError) {
  TempDir dir;
  const std::string file = dir.File("no-such-dir/trace.json");
  std::unique_ptr<Timeline> timeline;
  Status s = Timeline::Open(file, 0, Timeline::Options(), &timeline);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "\"" + file + "\"")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "No such file or directory"))
      << s.message();
  EXPECT_TRUE(timeline == nullptr);
}

TEST(Timeline, WritesValidJsonWithRowsSpansAndEscapedNames) {
  TempDir dir;
  const std::string file = dir.File("trace.json");
  const std::string odd = "a \"quoted\"\\name\nwith\ttabs\x01";
  {
    std::unique_ptr<Timeline> t;
    ASSERT_TRUE(Timeline::Open(file, 2, Timeline::Options(), &t).ok());
    const double t0 = t->Now();
    t->Span("x", kTimelineNegotiate, t0, t0 + 0.001,
            TimelineArgs().Add("shape", "[2]").Json());
    t->Span("x", "ALLREDUCE", t0 + 0.001, t0 + 0.003);
    t->Instant(odd, kTimelineRequest, t0 + 0.002,
               TimelineArgs().Add("rank", 1).Json());
    t->CycleSpan(t0, t0 + 0.004, TimelineArgs().Add("tensors", 1).Json());
    EXPECT_EQ(t->dropped_events(), 0);
  }
  const std::vector<Json> events = ReadEvents(file);
  ASSERT_FALSE(events.empty());
  int process_names = 0;
  for (const Json& e : events) {
    EXPECT_EQ(e["pid"].number, 2.0);
    if (e["name"].str == "process_name") {
      ++process_names;
      EXPECT_EQ(e["args"]["name"].str, "rank 2");
    }
    if (e["name"].str == "DROPPED_EVENTS") ADD_FAILURE() << "dropped events";
  }
  EXPECT_EQ(process_names, 1);
  const std::map<int64_t, Row> rows = Rows(events);
  const Row* x = FindRow(rows, "x");
  ASSERT_TRUE(x != nullptr);
  EXPECT_EQ(SpanSequence(*x),
            (std::vector<std::string>{"NEGOTIATE", "ALLREDUCE"}));
  EXPECT_EQ((*x->events[0])["args"]["shape"].str, "[2]");
  EXPECT_NEAR((*x->events[0])["dur"].number, 1000.0, 0.01);  // microseconds
  const Row* odd_row = FindRow(rows, odd);
  ASSERT_TRUE(odd_row != nullptr) << "escaped row name did not round-trip";
  ASSERT_EQ(odd_row->events.size(), 1u);
  EXPECT_EQ((*odd_row->events[0])["ph"].str, "i");
  EXPECT_EQ((*odd_row->events[0])["args"]["rank"].number, 1.0);
  const Row* cycles = FindRow(rows, "negotiation cycles");
  ASSERT_TRUE(cycles != nullptr);
  EXPECT_EQ(SpanSequence(*cycles), (std::vector<std::string>{"CYCLE"}));
  EXPECT_EQ((*cycles->events[0])["args"]["tensors"].number, 1.0);
}

TEST(Timeline, FullQueueDropsEventsAndRecordsTheCount) {
  TempDir dir;
  const std::string file = dir.File("trace.json");
  Timeline::Options options;
  options.max_queued_events = 4;
  options.flush_interval_seconds = 3600;  // only an overflow wakes it
  constexpr int kEvents = 50;
  int64_t dropped = 0;
  {
    std::unique_ptr<Timeline> t;
    ASSERT_TRUE(Timeline::Open(file, 0, options, &t).ok());
    const double t0 = t->Now();
    for (int i = 0; i < kEvents; ++i) {
      // Row names are never dropped, so use a new row each time.
      t->Span("row" + std::to_string(i), "ALLREDUCE", t0 + i * 1e-6,
              t0 + (i + 1) * 1e-6);
    }
    dropped = t->dropped_events();
  }
  // The writer sleeps until the fifth event overflows the queue.
  EXPECT_GE(dropped, 1);
  const std::vector<Json> events = ReadEvents(file);
  int spans = 0;
  int named_rows = 0;
  int64_t recorded = -1;
  for (const Json& e : events) {
    if (e["ph"].str == "X") ++spans;
    if (e["name"].str == "thread_name") ++named_rows;
    if (e["name"].str == "DROPPED_EVENTS") {
      recorded = static_cast<int64_t>(e["args"]["dropped_events"].number);
    }
  }
  EXPECT_EQ(spans + dropped, kEvents);
  EXPECT_EQ(recorded, dropped);
  EXPECT_EQ(named_rows, kEvents + 1);  // + the cycles row
}

TEST(Timeline, WriterFlushesWhileOpen) {
  TempDir dir;
  const std::string file = dir.File("trace.json");
  Timeline::Options options;
  options.flush_interval_seconds = 0.01;
  std::unique_ptr<Timeline> t;
  ASSERT_TRUE(Timeline::Open(file, 0, options, &t).ok());
  const double now = t->Now();
  t->Span("early", "BARRIER", now, now);
  bool seen = false;
  for (int i = 0; i < 500 && !seen; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = Contains(ReadFile(file), "\"BARRIER\"");
  }
  EXPECT_TRUE(seen) << "the writer did not flush within 5 s";
  t.reset();
  EXPECT_EQ(ReadEvents(file).size(), 5u);  // process, 2 rows x 2 M, span
}

TEST(Timeline, CloseCompletesTheFileOnceAndDropsLaterEvents) {
  TempDir dir;
  const std::string file = dir.File("trace.json");
  std::unique_ptr<Timeline> t;
  ASSERT_TRUE(Timeline::Open(file, 0, Timeline::Options(), &t).ok());
  const double now = t->Now();
  t->Span("before", "BARRIER", now, now);
  t->Close();
  // Complete while the Timeline lives (a process may end in MPI_Abort).
  EXPECT_EQ(ReadEvents(file).size(), 5u);  // process, 2 rows x 2 M, span
  t->Span("after", "BARRIER", now, now);
  t->Close();
  t.reset();
  const std::string text = ReadFile(file);
  EXPECT_EQ(ReadEvents(file).size(), 5u) << text;
  EXPECT_FALSE(Contains(text, "after")) << text;
}

// ---- engine spans -------------------------------------------------------

EngineConfig TimelineConfig(const std::string& path) {
  EngineConfig c;
  c.cycle_time_ms = 1.0;
  c.stall_warning_seconds = 0.0;
  c.timeline_path = path;
  return c;
}

std::future<Status> Watch(TensorEntry* entry) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  entry->done = [promise](const Status& s) { promise->set_value(s); };
  return future;
}

Status Await(std::future<Status>* f) {
  if (f->wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    return Status::Internal("test: collective did not complete");
  }
  return f->get();
}

TensorEntry Allreduce(const std::string& name, std::vector<float>* in,
                      std::vector<float>* out) {
  TensorEntry e;
  e.type = CollectiveType::kAllreduce;
  e.name = name;
  e.dtype = DataType::kFloat32;
  e.shape = {static_cast<int64_t>(in->size())};
  e.input = in->data();
  e.output = out->data();
  return e;
}

// One engine per rank of `world`, each writing `timeline_path`; false (with
// the failure reported) when one cannot be created.
bool CreateEngines(FakeWorld* world, const std::string& timeline_path,
                   std::vector<std::unique_ptr<Engine>>* engines) {
  engines->resize(world->size());
  for (int r = 0; r < world->size(); ++r) {
    Status s = Engine::Create(TimelineConfig(timeline_path),
                              world->CreateTransport(r), &(*engines)[r]);
    EXPECT_TRUE(s.ok()) << s.ToString();
    if (!s.ok()) return false;
  }
  return true;
}

// Per rank: a grouped allreduce of three tensors (one fused bucket), a
// plain allreduce, an allgather, a broadcast and a barrier, then destroys
// the engines (which closes the files).
void RunWorkload(const std::string& timeline_path, int size) {
  auto world = FakeWorld::Create(size, 0, 30.0);
  std::vector<std::unique_ptr<Engine>> engines;
  ASSERT_TRUE(CreateEngines(world.get(), timeline_path, &engines));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&engines, r, size] {
      Engine* engine = engines[r].get();
      std::vector<std::vector<float>> in(4, std::vector<float>(8, r + 1.0f));
      std::vector<std::vector<float>> out(4, std::vector<float>(8));
      std::vector<TensorEntry> group;
      std::vector<std::future<Status>> done;
      for (int k = 0; k < 3; ++k) {
        group.push_back(Allreduce("group/" + std::to_string(k), &in[k],
                                  &out[k]));
        done.push_back(Watch(&group.back()));
      }
      engine->EnqueueGroup(std::move(group));
      for (auto& f : done) EXPECT_TRUE(Await(&f).ok());
      EXPECT_EQ(out[0][0], size * (size + 1) / 2.0f);

      TensorEntry single = Allreduce("single", &in[3], &out[3]);
      auto f1 = Watch(&single);
      engine->Enqueue(std::move(single));
      EXPECT_TRUE(Await(&f1).ok());

      std::vector<float> gathered;
      TensorEntry gather;
      gather.type = CollectiveType::kAllgather;
      gather.name = "gather";
      gather.shape = {2};
      gather.input = in[0].data();
      gather.allocate_output = [&gathered](const Shape& shape, void** data) {
        gathered.resize(NumElements(shape));
        *data = gathered.data();
        return Status::Ok();
      };
      auto f2 = Watch(&gather);
      engine->Enqueue(std::move(gather));
      EXPECT_TRUE(Await(&f2).ok());

      std::vector<float> bcast(4, static_cast<float>(r));
      TensorEntry broadcast;
      broadcast.type = CollectiveType::kBroadcast;
      broadcast.name = "bcast";
      broadcast.shape = {4};
      broadcast.input = bcast.data();
      broadcast.output = bcast.data();
      auto f3 = Watch(&broadcast);
      engine->Enqueue(std::move(broadcast));
      EXPECT_TRUE(Await(&f3).ok());

      TensorEntry barrier;
      barrier.type = CollectiveType::kBarrier;
      barrier.name = "barrier";
      auto f4 = Watch(&barrier);
      engine->Enqueue(std::move(barrier));
      EXPECT_TRUE(Await(&f4).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  // Concurrently: every destructor runs a last cycle with the others.
  threads.clear();
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&engines, r] { engines[r].reset(); });
  }
  for (std::thread& t : threads) t.join();
}

TEST(TimelineEngine, RecordsEveryPhaseOnRankZero) {
  TempDir dir;
  const std::string file = dir.File("trace.json");
  RunWorkload(file, 2);
  EXPECT_EQ(dir.NumFiles(), 1) << "without \"{rank}\" only rank 0 writes";
  const std::vector<Json> events = ReadEvents(file);
  const std::map<int64_t, Row> rows = Rows(events);
  for (const auto& kv : rows) {
    EXPECT_FALSE(kv.second.name.empty()) << "row " << kv.first << " unnamed";
  }
  const std::vector<std::string> fused = {
      "NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
      "MEMCPY_OUT_FUSION_BUFFER"};
  for (int k = 0; k < 3; ++k) {
    const Row* row = FindRow(rows, "group/" + std::to_string(k));
    ASSERT_TRUE(row != nullptr) << k;
    EXPECT_EQ(SpanSequence(*row), fused) << k;
    int requests = 0;
    for (const Json* e : row->events) {
      if ((*e)["name"].str == "REQUEST") ++requests;
      if ((*e)["name"].str == "ALLREDUCE") {
        EXPECT_EQ((*e)["args"]["bucket_tensors"].number, 3.0);
        EXPECT_EQ((*e)["args"]["bucket_bytes"].number, 3.0 * 8 * 4);
      }
    }
    EXPECT_EQ(requests, 2) << "one REQUEST instant per rank";
  }
  const std::map<std::string, std::string> single = {
      {"single", "ALLREDUCE"}, {"gather", "ALLGATHER"},
      {"bcast", "BROADCAST"}, {"barrier", "BARRIER"}};
  for (const auto& kv : single) {
    const Row* row = FindRow(rows, kv.first);
    ASSERT_TRUE(row != nullptr) << kv.first;
    EXPECT_EQ(SpanSequence(*row),
              (std::vector<std::string>{"NEGOTIATE", "QUEUE", kv.second}))
        << kv.first;
  }
  const Row* cycles = FindRow(rows, "negotiation cycles");
  ASSERT_TRUE(cycles != nullptr);
  bool saw_group_cycle = false;
  for (const Json* e : cycles->events) {
    if ((*e)["name"].str != "CYCLE") continue;
    EXPECT_GE((*e)["args"]["tensors"].number, 1.0);
    if ((*e)["args"]["tensors"].number == 3.0 &&
        (*e)["args"]["fused_buckets"].number == 1.0) {
      saw_group_cycle = true;
      EXPECT_EQ((*e)["args"]["buckets"].number, 1.0);
      EXPECT_EQ((*e)["args"]["path"].str, "slow");
    }
  }
  EXPECT_TRUE(saw_group_cycle);
}

TEST(TimelineEngine, RankPlaceholderWritesOneFilePerRank) {
  TempDir dir;
  RunWorkload(dir.File("trace.{rank}.json"), 3);
  for (int r = 0; r < 3; ++r) {
    const std::string file = dir.File("trace." + std::to_string(r) + ".json");
    ASSERT_TRUE(std::filesystem::exists(file)) << file;
    const std::vector<Json> events = ReadEvents(file);
    const std::map<int64_t, Row> rows = Rows(events);
    const Row* row = FindRow(rows, "group/1");
    ASSERT_TRUE(row != nullptr) << file;
    EXPECT_EQ(SpanSequence(*row).size(), 5u) << file;
    EXPECT_EQ(events[0]["pid"].number, static_cast<double>(r));
    // Only the coordinator sees the other ranks' requests.
    int requests = 0;
    for (const Json* e : row->events) {
      if ((*e)["name"].str == "REQUEST") ++requests;
    }
    EXPECT_EQ(requests, r == 0 ? 3 : 0) << file;
  }
}

TEST(TimelineEngine, AbortReturnsWithEveryFileComplete) {
  // What a rank's unhandled exception does (runtime.py's excepthook): Abort,
  // then MPI_Abort, which ends every process without destructors.  Each
  // rank's file must be whole once its engine stopped.
  TempDir dir;
  const int size = 2;
  auto world = FakeWorld::Create(size, 0, 30.0);
  std::vector<std::unique_ptr<Engine>> engines;
  ASSERT_TRUE(CreateEngines(world.get(), dir.File("trace.{rank}.json"),
                            &engines));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&engines, r] {
      std::vector<float> in(8, 1.0f), out(8);
      TensorEntry e = Allreduce("before_abort", &in, &out);
      auto f = Watch(&e);
      engines[r]->Enqueue(std::move(e));
      EXPECT_TRUE(Await(&f).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  // Rank 1 raised: its engine tells rank 0's, and both stop.
  engines[1]->Abort("rank 1 raised RuntimeError: boom", 20.0);
  EXPECT_TRUE(engines[1]->stopped());
  engines[0]->Abort("rank 0 raised AbortedError", 20.0);
  EXPECT_TRUE(engines[0]->stopped());
  for (int r = 0; r < size; ++r) {
    const std::string file =
        dir.File("trace." + std::to_string(r) + ".json");
    const std::vector<Json> events = ReadEvents(file);
    EXPECT_TRUE(FindRow(Rows(events), "before_abort") != nullptr) << file;
  }
  for (auto& engine : engines) engine.reset();
}

// Per rank: an allreduce named `name`; true when it completed.
bool AllreduceOnEveryRank(std::vector<std::unique_ptr<Engine>>* engines,
                          const std::string& name) {
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (size_t r = 0; r < engines->size(); ++r) {
    threads.emplace_back([engines, r, &name, &ok] {
      std::vector<float> in(4, 1.0f);
      std::vector<float> out(4);
      TensorEntry entry = Allreduce(name, &in, &out);
      auto f = Watch(&entry);
      (*engines)[r]->Enqueue(std::move(entry));
      if (Await(&f).ok()) ++ok;
    });
  }
  for (std::thread& t : threads) t.join();
  return ok == static_cast<int>(engines->size());
}

TEST(TimelineEngine, SetTimelineRecordsAWindowOfTheRun) {
  TempDir dir;
  const int size = 2;
  auto world = FakeWorld::Create(size, 0, 30.0);
  std::vector<std::unique_ptr<Engine>> engines;
  ASSERT_TRUE(CreateEngines(world.get(), "", &engines));
  ASSERT_TRUE(AllreduceOnEveryRank(&engines, "before"));
  // A file that cannot be opened is named, and nothing changes.
  const std::string missing = dir.File("missing/trace.json");
  Status s = engines[0]->SetTimeline(missing);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), missing)) << s.message();
  const std::string first = dir.File("first.{rank}.json");
  for (auto& e : engines) ASSERT_TRUE(e->SetTimeline(first).ok());
  ASSERT_TRUE(AllreduceOnEveryRank(&engines, "during"));
  // Switching closes the first file whole and opens the next.
  const std::string second = dir.File("second.json");
  for (auto& e : engines) ASSERT_TRUE(e->SetTimeline(second).ok());
  ASSERT_TRUE(AllreduceOnEveryRank(&engines, "later"));
  for (auto& e : engines) ASSERT_TRUE(e->SetTimeline("").ok());
  ASSERT_TRUE(AllreduceOnEveryRank(&engines, "after"));
  for (int r = 0; r < size; ++r) {
    const std::vector<Json> events =
        ReadEvents(dir.File("first." + std::to_string(r) + ".json"));
    const std::map<int64_t, Row> rows = Rows(events);
    const Row* during = FindRow(rows, "during");
    ASSERT_TRUE(during != nullptr) << r;
    EXPECT_EQ(SpanSequence(*during),
              (std::vector<std::string>{"NEGOTIATE", "QUEUE", "ALLREDUCE"}));
    EXPECT_TRUE(FindRow(rows, "before") == nullptr) << r;
    EXPECT_TRUE(FindRow(rows, "later") == nullptr) << r;
  }
  const std::vector<Json> second_events = ReadEvents(second);
  const std::map<int64_t, Row> rows = Rows(second_events);
  EXPECT_TRUE(FindRow(rows, "later") != nullptr);
  EXPECT_TRUE(FindRow(rows, "during") == nullptr);
  EXPECT_TRUE(FindRow(rows, "after") == nullptr);
  EXPECT_EQ(dir.NumFiles(), 3) << "second.json: rank 0 only";
  // After the engine stopped, a switch is refused.
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&engines, r] {
      engines[r]->Abort("test", 10.0);
    });
  }
  for (std::thread& t : threads) t.join();
  s = engines[0]->SetTimeline(dir.File("late.json"));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(dir.File("late.json")));
}

TEST(TimelineEngine, CreateFailsWhenTheFileCannotBeCreated) {
  TempDir dir;
  const std::string file = dir.File("missing/trace.json");
  auto world = FakeWorld::Create(1);
  std::unique_ptr<Engine> engine;
  Status s = Engine::Create(TimelineConfig(file), world->CreateTransport(0),
                            &engine);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), file)) << s.message();
  EXPECT_TRUE(Contains(s.message(), "No such file or directory"))
      << s.message();
  EXPECT_TRUE(engine == nullptr);
  // A rank that writes nothing does not open (or check) the path.
  auto world2 = FakeWorld::Create(2, 0, 0.2);
  s = Engine::Create(TimelineConfig(file), world2->CreateTransport(1),
                     &engine);
  EXPECT_TRUE(s.ok()) << s.ToString();
  engine.reset();
}

TEST(TimelineEngine, ARankThatCannotStartFailsTheOthersInsteadOfHanging) {
  TempDir dir;
  const std::string file = dir.File("missing/trace.json");
  auto world = FakeWorld::Create(2, 0, 30.0);
  // Rank 1 writes no timeline and starts; rank 0 cannot create the file.
  std::unique_ptr<Engine> rank1;
  ASSERT_TRUE(Engine::Create(TimelineConfig(file), world->CreateTransport(1),
                             &rank1)
                  .ok());
  std::unique_ptr<Engine> rank0;
  Status s = Engine::Create(TimelineConfig(file), world->CreateTransport(0),
                            &rank0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(rank0 == nullptr);

  std::promise<Status> done;
  std::future<Status> result = done.get_future();
  std::vector<float> in(4, 1.0f), out(4);
  TensorEntry e;
  e.name = "x";
  e.shape = {4};
  e.input = in.data();
  e.output = out.data();
  e.done = [&done](const Status& status) { done.set_value(status); };
  rank1->Enqueue(std::move(e));
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)),
            std::future_status::ready);
  const Status got = result.get();
  EXPECT_EQ(got.code(), StatusCode::kFailedPrecondition) << got.ToString();
  EXPECT_TRUE(Contains(got.message(),
                       "rank 0 (host host0, pid 1000) could not start"))
      << got.message();
  EXPECT_TRUE(Contains(got.message(), file)) << got.message();
}

}  // namespace
}  // namespace mpistrategy
