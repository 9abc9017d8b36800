#include "cc/engine/message.h"

#include <string>

#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

RequestList SampleRequests() {
  RequestList list;
  Request a;
  a.rank = 2;
  a.type = CollectiveType::kAlltoall;
  a.name = "grad/dense_1/kernel";
  a.dtype = DataType::kBFloat16;
  a.shape = {6, 4, 2};
  a.reduce_op = ReduceOp::kMax;
  a.root_rank = 1;
  a.device = 3;
  a.splits = {1, 2, 3};
  a.packed_shapes = {{2, 3}, {}, {0}};
  a.packed_dtypes = {DataType::kFloat32, DataType::kInt64, DataType::kBool};
  a.grouped = true;
  list.requests.push_back(a);
  Request b;
  b.name = "";  // empty name and shape survive too
  list.requests.push_back(b);
  Request c;
  c.name = "bad/alltoall";
  c.invalid = "alltoall \"bad/alltoall\": splits [1] sum to 1 but ...";
  list.requests.push_back(c);
  list.shutdown = true;
  list.shutdown_reason = "rank 2 raised ValueError: \xe2\x9c\x97 bad";
  return list;
}

ResponseList SampleResponses() {
  ResponseList list;
  Response r;
  r.type = ResponseType::kAllgather;
  r.names = {"x", "y"};
  r.dtype = DataType::kFloat16;
  r.reduce_op = ReduceOp::kProduct;
  r.root_rank = 2;
  r.device = kCpuDevice;
  r.shapes = {{3, 4}, {}};
  r.first_dims = {3, 5, 0};
  r.splits = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  r.packed_shapes = {{7}, {1, 1}};
  r.packed_dtypes = {DataType::kInt8, DataType::kBFloat16};
  list.responses.push_back(r);
  Response e;
  e.type = ResponseType::kError;
  e.names = {"bad"};
  e.error_code = StatusCode::kDeadlineExceeded;
  e.error_message = "Collective \"bad\" timed out";
  e.error_ranks = {0, 2};
  list.responses.push_back(e);
  list.shutdown = true;
  list.shutdown_rank = 1;
  list.shutdown_reason = "rank 1 shut down";
  list.has_parameters = true;
  list.parameters.fusion_threshold_bytes = 16 << 20;
  list.parameters.fusion_wait_ms = 0.25;
  list.parameters.final = true;
  return list;
}

TEST(Message, RequestListRoundTrip) {
  RequestList in = SampleRequests();
  std::string bytes;
  SerializeRequestList(in, &bytes);
  RequestList out;
  Status s = ParseRequestList(bytes, &out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(out.requests.size(), in.requests.size());
  EXPECT_TRUE(out.requests[0] == in.requests[0]);
  EXPECT_TRUE(out.requests[1] == in.requests[1]);
  EXPECT_EQ(out.shutdown, true);
  EXPECT_EQ(out.shutdown_reason, in.shutdown_reason);
}

TEST(Message, ResponseListRoundTrip) {
  ResponseList in = SampleResponses();
  std::string bytes;
  SerializeResponseList(in, &bytes);
  ResponseList out;
  Status s = ParseResponseList(bytes, &out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(out.responses.size(), 2u);
  EXPECT_TRUE(out.responses[0] == in.responses[0]);
  EXPECT_TRUE(out.responses[1] == in.responses[1]);
  EXPECT_EQ(out.shutdown_rank, 1);
  EXPECT_EQ(out.ShutdownString(), "rank 1: rank 1 shut down");
  EXPECT_TRUE(out.has_parameters);
  EXPECT_TRUE(out.parameters == in.parameters);
}

TEST(Message, EmptyListsRoundTrip) {
  std::string bytes;
  SerializeRequestList(RequestList(), &bytes);
  RequestList q;
  EXPECT_TRUE(ParseRequestList(bytes, &q).ok());
  EXPECT_TRUE(q.requests.empty());
  SerializeResponseList(ResponseList(), &bytes);
  ResponseList p;
  EXPECT_TRUE(ParseResponseList(bytes, &p).ok());
  EXPECT_FALSE(p.shutdown);
  EXPECT_FALSE(p.has_parameters);
}

TEST(Message, EveryTruncationIsAnError) {
  std::string bytes;
  SerializeRequestList(SampleRequests(), &bytes);
  for (size_t n = 0; n < bytes.size(); ++n) {
    RequestList out;
    Status s = ParseRequestList(bytes.substr(0, n), &out);
    EXPECT_FALSE(s.ok()) << "prefix " << n;
  }
  SerializeResponseList(SampleResponses(), &bytes);
  for (size_t n = 0; n < bytes.size(); ++n) {
    ResponseList out;
    Status s = ParseResponseList(bytes.substr(0, n), &out);
    EXPECT_FALSE(s.ok()) << "prefix " << n;
    if (n == 3) {
      EXPECT_EQ(s.code(), StatusCode::kInternal);
    }
  }
}

TEST(Message, TrailingBytesBadEnumsAndWrongKindAreErrors) {
  std::string bytes;
  SerializeRequestList(SampleRequests(), &bytes);
  RequestList q;
  EXPECT_FALSE(ParseRequestList(bytes + "x", &q).ok());
  ResponseList p;
  EXPECT_FALSE(ParseResponseList(bytes, &p).ok());  // wrong magic
  // Corrupt the first request's collective type (after magic, flag, reason,
  // count and rank).
  std::string bad = bytes;
  const size_t reason_len = SampleRequests().shutdown_reason.size();
  const size_t type_at = 4 + 1 + 4 + reason_len + 4 + 4;
  bad[type_at] = 42;
  EXPECT_FALSE(ParseRequestList(bad, &q).ok());
  // A huge element count must not allocate or crash.
  bad = bytes;
  const size_t count_at = 4 + 1 + 4 + reason_len;
  bad[count_at] = '\xff';
  bad[count_at + 1] = '\xff';
  bad[count_at + 2] = '\xff';
  bad[count_at + 3] = '\x7f';
  EXPECT_FALSE(ParseRequestList(bad, &q).ok());
  // A packed dtype out of range (the last byte of a one-request list).
  RequestList one;
  one.requests.emplace_back();
  one.requests[0].packed_shapes = {{1}};
  one.requests[0].packed_dtypes = {DataType::kFloat64};
  SerializeRequestList(one, &bad);
  ASSERT_TRUE(ParseRequestList(bad, &q).ok());
  bad.back() = 42;
  EXPECT_FALSE(ParseRequestList(bad, &q).ok());
}

}  // namespace
}  // namespace mpistrategy
