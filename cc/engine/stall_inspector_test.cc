#include "cc/engine/stall_inspector.h"

#include <string>
#include <vector>

#include "cc/engine/negotiator.h"
#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

PendingCollective Make(const std::string& name, double t,
                       std::vector<bool> submitted) {
  PendingCollective p;
  p.name = name;
  p.first_seen_seconds = t;
  p.submitted = std::move(submitted);
  return p;
}

TEST(StallInspector, WarnsOncePerTensorWithRanks) {
  StallInspector inspector(60.0, 0.0);
  PendingCollective x = Make("X", 100.0, {true, false, true});
  std::vector<PendingCollective*> table = {&x};
  EXPECT_TRUE(inspector.Inspect(table, 159.0).warnings.empty());
  const std::vector<PeerInfo> peers = {{"a", 7}, {"b", 8}, {"a", 9}};
  StallReport r = inspector.Inspect(table, 161.0, peers);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0],
            "Stalled: collective \"X\" was submitted by rank 0 (host a, pid "
            "7), rank 2 (host a, pid 9) but not by rank 1 (host b, pid 8) for "
            "61 s");
  EXPECT_TRUE(r.timeouts.empty());
  EXPECT_TRUE(inspector.Inspect(table, 500.0).warnings.empty());
}

TEST(StallInspector, CapsTheWarningList) {
  StallInspector inspector(1.0, 0.0);
  std::vector<PendingCollective> all;
  for (int i = 0; i < 30; ++i) {
    all.push_back(Make("t" + std::to_string(i), 0.0, {true, false}));
  }
  std::vector<PendingCollective*> table;
  for (auto& p : all) table.push_back(&p);
  StallReport r = inspector.Inspect(table, 5.0);
  ASSERT_EQ(r.warnings.size(),
            static_cast<size_t>(StallInspector::kMaxStallWarningLines) + 1);
  EXPECT_EQ(r.warnings.back(), "... and 10 more stalled collectives");
}

TEST(StallInspector, TimeoutNamesMissingAndSubmittingRanks) {
  StallInspector inspector(0.0, 30.0);
  PendingCollective x = Make("X", 0.0, {false, true, true});
  std::vector<PendingCollective*> table = {&x};
  EXPECT_TRUE(inspector.Inspect(table, 29.9).timeouts.empty());
  StallReport r = inspector.Inspect(table, 30.0);
  ASSERT_EQ(r.timeouts.size(), 1u);
  EXPECT_EQ(r.timeouts[0].name, "X");
  EXPECT_EQ(r.timeouts[0].submitted_ranks, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.timeouts[0].status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(r.timeouts[0].status.message().rfind(
                "Collective \"X\" timed out after 30 s waiting for rank 0; "
                "rank 1, rank 2 submitted it",
                0),
            0u);
  // With the peers' identities, every rank is named with host and pid.
  PendingCollective y = Make("Y", 0.0, {false, true});
  std::vector<PendingCollective*> one = {&y};
  r = inspector.Inspect(one, 31.0, {{"h0", 10}, {"h1", 11}});
  ASSERT_EQ(r.timeouts.size(), 1u);
  EXPECT_EQ(r.timeouts[0].status.message().rfind(
                "Collective \"Y\" timed out after 30 s waiting for rank 0 "
                "(host h0, pid 10); rank 1 (host h1, pid 11) submitted it",
                0),
            0u) << r.timeouts[0].status.message();
  EXPECT_FALSE(inspector.enabled() == false);
  EXPECT_FALSE(StallInspector(0.0, 0.0).enabled());
}

TEST(Negotiator, StallTimeoutBecomesErrorResponseWithFakeClock) {
  double now = 0.0;
  Negotiator negotiator(3, StallInspector(1.0, 10.0), [&now] { return now; });
  RequestList list;
  Request q;
  q.name = "X";
  q.shape = {2};
  list.requests.push_back(q);
  negotiator.AddRequestList(0, list);
  negotiator.AddRequestList(2, list);
  std::vector<std::string> warnings;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  now = 2.0;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  ASSERT_EQ(warnings.size(), 1u);
  now = 11.0;
  ResponseList r = negotiator.ComputeResponses(&warnings);
  ASSERT_EQ(r.responses.size(), 1u);
  EXPECT_EQ(r.responses[0].type, ResponseType::kError);
  EXPECT_EQ(r.responses[0].error_code, StatusCode::kDeadlineExceeded);
  EXPECT_EQ(r.responses[0].error_ranks, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(negotiator.num_pending(), 0u);
}

Request Barrier(const std::string& name) {
  Request q;
  q.type = CollectiveType::kBarrier;
  q.name = name;
  return q;
}

RequestList ListOf(std::vector<Request> requests) {
  RequestList list;
  list.requests = std::move(requests);
  return list;
}

TEST(Negotiator, CrossedBlockingJoinFailsBothSides) {
  // Rank 0 waits in a checkpoint read's join; ranks 1 and 2 went on to a
  // broadcast that rank 0 will not submit until they join.  Stall
  // detection is off: the crossing alone decides.
  double now = 0.0;
  Negotiator negotiator(3, StallInspector(0.0, 0.0), [&now] { return now; });
  negotiator.SetPeers({{"h0", 10}, {"h1", 11}, {"h2", 12}});
  const std::string join = std::string(kBlockingJoinPrefix) + "restore";
  Request bcast;
  bcast.type = CollectiveType::kBroadcast;
  bcast.name = "bcast";
  bcast.shape = {2};
  negotiator.AddRequestList(0, ListOf({Barrier(join)}));
  negotiator.AddRequestList(1, ListOf({bcast}));
  std::vector<std::string> warnings;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  // Rank 2 is in no collective yet (it may be on its way to the join).
  now = 50.0;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  negotiator.AddRequestList(2, ListOf({bcast}));
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  now = 50.0 + kCrossedJoinSeconds - 0.01;  // the crossing began at 50
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  now = 50.0 + kCrossedJoinSeconds;
  ResponseList r = negotiator.ComputeResponses(&warnings);
  ASSERT_EQ(r.responses.size(), 2u);
  EXPECT_EQ(r.responses[0].names[0], join);
  EXPECT_EQ(r.responses[0].error_code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.responses[0].error_ranks, (std::vector<int32_t>{0}));
  EXPECT_EQ(r.responses[0].error_message,
            "Blocking join \"MPIBlockingJoin/restore\" cannot complete: rank "
            "1 (host h1, pid 11), rank 2 (host h2, pid 12) did not enter it; "
            "rank 1 (host h1, pid 11) waits in broadcast \"bcast\", which "
            "rank 0 (host h0, pid 10) did not submit; rank 2 (host h2, pid "
            "12) waits in broadcast \"bcast\", which rank 0 (host h0, pid "
            "10) did not submit. The ranks are crossed (they run different "
            "code): every rank must make the call that enters the join.");
  EXPECT_EQ(r.responses[1].names[0], "bcast");
  EXPECT_EQ(r.responses[1].error_code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.responses[1].error_ranks, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.responses[1].error_message,
            "broadcast \"bcast\" cannot complete: rank 0 (host h0, pid 10) "
            "will not submit it, being blocked in the blocking join "
            "\"MPIBlockingJoin/restore\", which rank 1 (host h1, pid 11), "
            "rank 2 (host h2, pid 12) did not enter. The ranks are crossed "
            "(they run different code): every rank must make the call that "
            "enters the join.");
  EXPECT_EQ(negotiator.num_pending(), 0u);
  EXPECT_TRUE(warnings.empty());
}

TEST(Negotiator, OnlyCrossedBlockingJoinsFail) {
  double now = 0.0;
  Negotiator negotiator(3, StallInspector(0.0, 0.0), [&now] { return now; });
  const std::string join = std::string(kBlockingJoinPrefix) + "read";
  Request x;
  x.name = "x";
  x.shape = {1};
  std::vector<std::string> warnings;
  // A plain barrier crossed with an allreduce is left alone (TF submits
  // asynchronously, so this is not a deadlock in general).
  negotiator.AddRequestList(0, ListOf({Barrier("plain")}));
  negotiator.AddRequestList(1, ListOf({x}));
  // A join whose missing rank 2 waits in no collective is not judged.
  negotiator.AddRequestList(0, ListOf({Barrier(join)}));
  negotiator.AddRequestList(1, ListOf({Barrier(join)}));
  now = 100.0;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  now = 200.0;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  // Rank 2 waits in "x", which rank 0 (in the join) has not submitted:
  // crossed from now on.
  negotiator.AddRequestList(2, ListOf({x}));
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  // Rank 0 submits "x" after all (e.g. asynchronously) before the crossing
  // lasted kCrossedJoinSeconds: "x" completes, nothing fails.
  now = 200.5;
  negotiator.AddRequestList(0, ListOf({x}));
  ResponseList r = negotiator.ComputeResponses(&warnings);
  ASSERT_EQ(r.responses.size(), 1u);
  EXPECT_EQ(r.responses[0].type, ResponseType::kAllreduce);
  EXPECT_EQ(r.responses[0].names[0], "x");
  now = 300.0;
  EXPECT_TRUE(negotiator.ComputeResponses(&warnings).responses.empty());
  // Rank 2 joins: the join completes.
  negotiator.AddRequestList(2, ListOf({Barrier(join)}));
  r = negotiator.ComputeResponses(&warnings);
  ASSERT_EQ(r.responses.size(), 1u);
  EXPECT_EQ(r.responses[0].type, ResponseType::kBarrier);
  EXPECT_EQ(negotiator.num_pending(), 1u);  // "plain"
  EXPECT_FALSE(IsBlockingJoin(Barrier("plain")));
  Request not_barrier = x;
  not_barrier.name = join;
  EXPECT_FALSE(IsBlockingJoin(not_barrier));
  EXPECT_TRUE(IsBlockingJoin(Barrier(join)));
}

TEST(Negotiator, CompletesInOrderAndReportsShutdown) {
  Negotiator negotiator(2, StallInspector(0.0, 0.0), [] { return 0.0; });
  RequestList a, b;
  for (const char* n : {"p", "q"}) {
    Request r;
    r.name = n;
    r.shape = {4};
    a.requests.push_back(r);
  }
  b.requests = {a.requests[1], a.requests[0]};
  b.shutdown = true;
  negotiator.AddRequestList(0, a);
  negotiator.AddRequestList(1, b);
  std::vector<std::string> warnings;
  ResponseList r = negotiator.ComputeResponses(&warnings);
  ASSERT_EQ(r.responses.size(), 2u);
  EXPECT_EQ(r.responses[0].names[0], "q");
  EXPECT_EQ(r.responses[1].names[0], "p");
  EXPECT_TRUE(r.shutdown);
  EXPECT_EQ(r.ShutdownString(), "rank 1: rank 1 shut down");
}

TEST(Negotiator, BuildResponseMessages) {
  Request a;
  a.rank = 0;
  a.name = "grad/dense_1";
  a.shape = {3, 4};
  Request b = a;
  b.rank = 1;
  b.shape = {5, 4};
  Response r = BuildResponse("grad/dense_1", {a, b});
  EXPECT_EQ(r.type, ResponseType::kError);
  EXPECT_EQ(r.error_code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.error_message,
            "Mismatched allreduce \"grad/dense_1\": rank 0 has shape [3, 4] "
            "but rank 1 has shape [5, 4]");
  b = a;
  b.rank = 1;
  b.type = CollectiveType::kAllgather;
  EXPECT_EQ(BuildResponse("grad/dense_1", {a, b}).error_message,
            "Mismatched collective \"grad/dense_1\": rank 0 called allreduce "
            "but rank 1 called allgather");
  b = a;
  b.rank = 1;
  b.device = 0;
  EXPECT_EQ(BuildResponse("grad/dense_1", {a, b}).error_message,
            "Mismatched allreduce \"grad/dense_1\": rank 0 has device cpu but "
            "rank 1 has device gpu:0");
  // A 16-bit float against a wider one asks about compression; two wide
  // floats do not.
  b = a;
  b.rank = 1;
  a.dtype = DataType::kFloat32;
  b.dtype = DataType::kBFloat16;
  EXPECT_EQ(BuildResponse("grad/dense_1", {a, b}).error_message,
            "Mismatched allreduce \"grad/dense_1\": rank 0 has dtype float32 "
            "but rank 1 has dtype bfloat16 (16-bit floats against wider "
            "ones: do all ranks use the same compression?)");
  b.dtype = DataType::kFloat64;
  EXPECT_EQ(BuildResponse("grad/dense_1", {a, b}).error_message,
            "Mismatched allreduce \"grad/dense_1\": rank 0 has dtype float32 "
            "but rank 1 has dtype float64");
  // Allgather: first dims may differ.
  a.type = b.type = CollectiveType::kAllgather;
  b = a;
  b.rank = 1;
  b.shape = {7, 4};
  r = BuildResponse("g", {a, b});
  EXPECT_EQ(r.type, ResponseType::kAllgather);
  EXPECT_EQ(r.first_dims, (std::vector<int64_t>{3, 7}));
}

}  // namespace
}  // namespace mpistrategy
