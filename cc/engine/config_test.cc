#include "cc/engine/config.h"

#include <gtest/gtest.h>

#include "cc/common/common.h"

namespace mpistrategy {
namespace {

TEST(Config, Validation) {
  EXPECT_TRUE(EngineConfig().Validate().ok());
  EngineConfig c;
  c.cycle_time_ms = -1;
  Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "EngineConfig.cycle_time_ms must be a finite number > 0, got -1");
}

}  // namespace
}  // namespace mpistrategy
