#include "cc/engine/fusion.h"

#include <vector>

#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

Response Allreduce(const std::string& name, DataType dtype = DataType::kFloat32,
                   ReduceOp op = ReduceOp::kSum, int32_t device = kCpuDevice) {
  Response r;
  r.type = ResponseType::kAllreduce;
  r.names = {name};
  r.dtype = dtype;
  r.reduce_op = op;
  r.device = device;
  return r;
}

Response Other(const std::string& name, ResponseType type) {
  Response r;
  r.type = type;
  r.names = {name};
  return r;
}

std::vector<std::vector<int>> Members(const std::vector<FusionBucket>& b) {
  std::vector<std::vector<int>> out;
  for (const FusionBucket& x : b) out.push_back(x.members);
  return out;
}

using Groups = std::vector<std::vector<int>>;

TEST(Fusion, MixedDtypePackedGroupsStandAlone) {
  // uint8 byte buffers of mixed-dtype groups are reduced per segment, never
  // together with each other or with plain uint8 allreduces.
  Response mixed = Allreduce("mixed", DataType::kUint8);
  mixed.packed_shapes = {{1}, {1}};
  mixed.packed_dtypes = {DataType::kFloat32, DataType::kInt32};
  std::vector<Response> rs = {Allreduce("a", DataType::kUint8), mixed,
                              Allreduce("b", DataType::kUint8), mixed};
  auto plan = PlanFusion(rs, {8, 68, 8, 68}, 1000);
  EXPECT_EQ(Members(plan), (Groups{{0, 2}, {1}, {3}}));
}

TEST(Fusion, PacksUpToThreshold) {
  std::vector<Response> rs = {Allreduce("a"), Allreduce("b"), Allreduce("c"),
                              Allreduce("d")};
  std::vector<int64_t> bytes = {40, 40, 30, 10};
  auto plan = PlanFusion(rs, bytes, 100);
  EXPECT_EQ(Members(plan), (Groups{{0, 1}, {2, 3}}));
  EXPECT_EQ(plan[0].bytes, 80);
  EXPECT_EQ(plan[1].bytes, 40);
  // Exactly at the threshold still fits.
  plan = PlanFusion(rs, {50, 50, 100, 1}, 100);
  EXPECT_EQ(Members(plan), (Groups{{0, 1}, {2}, {3}}));
}

TEST(Fusion, ZeroThresholdDisables) {
  std::vector<Response> rs = {Allreduce("a"), Allreduce("b")};
  auto plan = PlanFusion(rs, {1, 1}, 0);
  EXPECT_EQ(Members(plan), (Groups{{0}, {1}}));
}

TEST(Fusion, OversizeTensorsRunAloneAndKeepBucketOpen) {
  std::vector<Response> rs = {Allreduce("a"), Allreduce("big"), Allreduce("b")};
  auto plan = PlanFusion(rs, {10, 1000, 10}, 100);
  EXPECT_EQ(Members(plan), (Groups{{0, 2}, {1}}));
}

TEST(Fusion, MixedDtypesOpsAndDevicesDoNotMix) {
  std::vector<Response> rs = {
      Allreduce("f32"),
      Allreduce("i64", DataType::kInt64),
      Allreduce("f32b"),
      Allreduce("f32max", DataType::kFloat32, ReduceOp::kMax),
      Allreduce("i64b", DataType::kInt64),
      Allreduce("gpu", DataType::kFloat32, ReduceOp::kSum, 0),
      Allreduce("f32mean", DataType::kFloat32, ReduceOp::kMean),
      Allreduce("f32c"),
  };
  auto plan = PlanFusion(rs, std::vector<int64_t>(rs.size(), 8), 1 << 20);
  EXPECT_EQ(Members(plan), (Groups{{0, 2, 7}, {1, 4}, {3}, {5}, {6}}));
}

TEST(Fusion, OrderIsFirstMemberOrderAndOthersAlone) {
  std::vector<Response> rs = {
      Other("g", ResponseType::kAllgather), Allreduce("a"),
      Other("err", ResponseType::kError),   Other("bc", ResponseType::kBroadcast),
      Allreduce("b"),                       Other("bar", ResponseType::kBarrier),
  };
  auto plan = PlanFusion(rs, {0, 4, 0, 0, 4, 0}, 64);
  EXPECT_EQ(Members(plan), (Groups{{0}, {1, 4}, {2}, {3}, {5}}));
}

TEST(Fusion, FullBucketClosesAndNewOneOpens) {
  std::vector<Response> rs;
  std::vector<int64_t> bytes;
  for (int i = 0; i < 7; ++i) {
    rs.push_back(Allreduce("t" + std::to_string(i)));
    bytes.push_back(30);
  }
  auto plan = PlanFusion(rs, bytes, 100);
  EXPECT_EQ(Members(plan), (Groups{{0, 1, 2}, {3, 4, 5}, {6}}));
}

TEST(Fusion, Empty) {
  EXPECT_TRUE(PlanFusion(std::vector<Response>{}, {}, 100).empty());
}

}  // namespace
}  // namespace mpistrategy
