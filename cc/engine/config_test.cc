// The one place where options are parsed and range-checked: every field's
// range, the parser's errors, and the C ABI that Python calls.

#include "cc/engine/config.h"

#include <gtest/gtest.h>

#include <string>

#include "cc/common/common.h"

extern "C" int mpistrategy_validate_config(const char* config_text,
                                           size_t config_length,
                                           char* error_buf, int error_len);

namespace mpistrategy {
namespace {

// "key=value\0" for one entry.
std::string Entry(const std::string& key, const std::string& value) {
  return key + "=" + value + std::string(1, '\0');
}

// The message ParseAndValidateConfig gives for one entry ("" when valid).
std::string Check(const std::string& key, const std::string& value) {
  const std::string text = Entry(key, value);
  EngineConfig config;
  const Status status = ParseAndValidateConfig(text.data(), text.size(),
                                               &config);
  if (!status.ok()) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << key;
  }
  return status.message();
}

TEST(Config, DefaultsAreValid) {
  EXPECT_TRUE(EngineConfig().Validate().ok());
  EngineConfig config;
  EXPECT_TRUE(ParseAndValidateConfig("", 0, &config).ok());
  EXPECT_TRUE(ParseAndValidateConfig(nullptr, 10, &config).ok());
}

TEST(Config, ValidateNamesTheOptionWhatItAcceptsAndTheValue) {
  EngineConfig c;
  c.cycle_time_ms = -1;
  const Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "Options.cycle_time_ms must be a finite number > 0, got -1");
}

struct RangeCase {
  const char* key;
  const char* value;
  // Empty when the value is accepted, else the whole expected message.
  const char* message;
};

class ConfigRangeTest : public ::testing::TestWithParam<RangeCase> {};

TEST_P(ConfigRangeTest, AcceptsOrNamesTheRange) {
  const RangeCase& c = GetParam();
  EXPECT_EQ(Check(c.key, c.value), c.message) << c.key << "=" << c.value;
}

// Each ranged field at and beyond its bounds, and the non-finite values.
INSTANTIATE_TEST_SUITE_P(
    EveryField, ConfigRangeTest,
    ::testing::Values(
        RangeCase{"fusion_threshold_bytes", "0", ""},
        RangeCase{"fusion_threshold_bytes", "9223372036854775807", ""},
        RangeCase{"fusion_threshold_bytes", "-1",
                  "Options.fusion_threshold_bytes must be an integer >= 0 "
                  "(0 disables fusion), got -1"},
        RangeCase{"cycle_time_ms", "0.001", ""},
        RangeCase{"cycle_time_ms", "1000", ""},
        RangeCase{"cycle_time_ms", "4000",
                  "Options.cycle_time_ms must be at most 1000 (an idle rank "
                  "joins the negotiation this often, so a longer period "
                  "delays stall warnings and timeouts), got 4000"},
        RangeCase{"cycle_time_ms", "0.0",
                  "Options.cycle_time_ms must be a finite number > 0, got 0"},
        RangeCase{"cycle_time_ms", "-2.5",
                  "Options.cycle_time_ms must be a finite number > 0, got "
                  "-2.5"},
        RangeCase{"cycle_time_ms", "inf",
                  "Options.cycle_time_ms must be a finite number > 0, got "
                  "inf"},
        RangeCase{"cycle_time_ms", "nan",
                  "Options.cycle_time_ms must be a finite number > 0, got "
                  "nan"},
        RangeCase{"fusion_wait_ms", "0.0", ""},
        RangeCase{"fusion_wait_ms", "1000.0", ""},
        RangeCase{"fusion_wait_ms", "1000.5",
                  "Options.fusion_wait_ms must be a number in [0, 1000] (0 "
                  "negotiates at once), got 1000.5"},
        RangeCase{"fusion_wait_ms", "-0.1",
                  "Options.fusion_wait_ms must be a number in [0, 1000] (0 "
                  "negotiates at once), got -0.1"},
        RangeCase{"fusion_wait_ms", "nan",
                  "Options.fusion_wait_ms must be a number in [0, 1000] (0 "
                  "negotiates at once), got nan"},
        RangeCase{"cache_capacity", "0", ""},
        RangeCase{"cache_capacity", "2147483647", ""},
        RangeCase{"cache_capacity", "2147483648",
                  "Options.cache_capacity must be an integer in [0, "
                  "2147483647] (0 disables the response cache), got "
                  "2147483648"},
        RangeCase{"cache_capacity", "-3",
                  "Options.cache_capacity must be an integer in [0, "
                  "2147483647] (0 disables the response cache), got -3"},
        RangeCase{"stall_warning_seconds", "0.0", ""},
        RangeCase{"stall_warning_seconds", "-0.5",
                  "Options.stall_warning_seconds must be a finite number >= "
                  "0 (0 disables the warning), got -0.5"},
        RangeCase{"stall_warning_seconds", "inf",
                  "Options.stall_warning_seconds must be a finite number >= "
                  "0 (0 disables the warning), got inf"},
        RangeCase{"stall_timeout_seconds", "0.0", ""},
        RangeCase{"stall_timeout_seconds", "-1.0",
                  "Options.stall_timeout_seconds must be a finite number >= "
                  "0 (0 waits forever), got -1"},
        RangeCase{"stall_timeout_seconds", "nan",
                  "Options.stall_timeout_seconds must be a finite number >= "
                  "0 (0 waits forever), got nan"},
        RangeCase{"peer_timeout_seconds", "0.0", ""},
        RangeCase{"peer_timeout_seconds", "-1.0",
                  "Options.peer_timeout_seconds must be a finite number >= 0 "
                  "(0 waits for silent peers forever), got -1"},
        RangeCase{"peer_timeout_seconds", "inf",
                  "Options.peer_timeout_seconds must be a finite number >= 0 "
                  "(0 waits for silent peers forever), got inf"},
        RangeCase{"checkpoint_read_timeout_seconds", "0.5", ""},
        RangeCase{"checkpoint_read_timeout_seconds", "0.0",
                  "Options.checkpoint_read_timeout_seconds must be a finite "
                  "number > 0, got 0"},
        RangeCase{"checkpoint_read_timeout_seconds", "-inf",
                  "Options.checkpoint_read_timeout_seconds must be a finite "
                  "number > 0, got -inf"},
        RangeCase{"shm_bytes", "1048576", ""},
        RangeCase{"shm_bytes", "1048575",
                  "Options.shm_bytes must be an integer >= 1048576 (1 MiB), "
                  "got 1048575"},
        RangeCase{"data_plane", "shm", ""},
        RangeCase{"data_plane", "nccl",
                  "Options.data_plane must be \"auto\", \"mpi\" or "
                  "\"shm\", got 'nccl'"},
        // Fields without a range parse any value of their type.
        RangeCase{"autotune", "1", ""},
        RangeCase{"hierarchical_allreduce", "0", ""},
        RangeCase{"timeline", "/tmp/t.{rank}.json", ""},
        RangeCase{"autotune_log", "", ""}));

TEST(Config, ParserErrorsNameTheKeyAndTheText) {
  EXPECT_EQ(Check("fusion_threshold_bytes", "64MB"),
            "Options.fusion_threshold_bytes must be a decimal integer, got "
            "'64MB'");
  EXPECT_EQ(Check("fusion_threshold_bytes", ""),
            "Options.fusion_threshold_bytes must be a decimal integer, got "
            "''");
  EXPECT_EQ(Check("fusion_threshold_bytes", "18446744073709551616"),
            "Options.fusion_threshold_bytes must be an integer that fits in "
            "64 bits, got 18446744073709551616");
  EXPECT_EQ(Check("cycle_time_ms", "fast"),
            "Options.cycle_time_ms must be a decimal number, got 'fast'");
  EXPECT_EQ(Check("cycle_time_ms", "1.5ms"),
            "Options.cycle_time_ms must be a decimal number, got '1.5ms'");
  EXPECT_EQ(Check("autotune", "yes"),
            "Options.autotune must be 0 or 1, got 'yes'");
  EXPECT_EQ(Check("fusion_threshold", "1"),
            "unknown configuration key 'fusion_threshold'");
  const std::string twice = Entry("cycle_time_ms", "1") +
                            Entry("cycle_time_ms", "2");
  EngineConfig config;
  EXPECT_EQ(ParseConfig(twice.data(), twice.size(), &config).message(),
            "configuration key 'cycle_time_ms' is given twice");
  const std::string no_equals("cycle_time_ms\0", 14);
  EXPECT_EQ(ParseConfig(no_equals.data(), no_equals.size(), &config)
                .message(),
            "configuration entry 'cycle_time_ms' is not key=value");
}

TEST(Config, ParseFillsEveryField) {
  const std::string text =
      Entry("fusion_threshold_bytes", "1024") +
      Entry("cycle_time_ms", "2.5") + Entry("fusion_wait_ms", "0.5") +
      Entry("autotune", "1") + Entry("autotune_log", "/tmp/a.csv") +
      Entry("cache_capacity", "7") + Entry("stall_warning_seconds", "5.0") +
      Entry("stall_timeout_seconds", "30.0") +
      Entry("peer_timeout_seconds", "45.0") +
      Entry("timeline", "/tmp/t.json") +
      Entry("hierarchical_allreduce", "1") +
      Entry("checkpoint_read_timeout_seconds", "7.5") +
      Entry("data_plane", "mpi") + Entry("shm_bytes", "2097152");
  EngineConfig c;
  ASSERT_TRUE(ParseAndValidateConfig(text.data(), text.size(), &c).ok());
  EXPECT_EQ(c.fusion_threshold_bytes, 1024);
  EXPECT_EQ(c.cycle_time_ms, 2.5);
  EXPECT_EQ(c.fusion_wait_ms, 0.5);
  EXPECT_TRUE(c.autotune);
  EXPECT_EQ(c.autotune_log, "/tmp/a.csv");
  EXPECT_EQ(c.cache_capacity, 7);
  EXPECT_EQ(c.stall_warning_seconds, 5.0);
  EXPECT_EQ(c.stall_timeout_seconds, 30.0);
  EXPECT_EQ(c.peer_timeout_seconds, 45.0);
  EXPECT_EQ(c.timeline_path, "/tmp/t.json");
  EXPECT_TRUE(c.hierarchical_allreduce);
  EXPECT_EQ(c.checkpoint_read_timeout_seconds, 7.5);
  EXPECT_EQ(c.data_plane, HostDataPlane::kMpi);
  EXPECT_EQ(c.shm_bytes, 2097152);
}

// What Python's ctypes call gets: the same code and message, NUL-terminated
// and truncated to the buffer.
TEST(Config, CApiReturnsTheSameMessage) {
  const std::string text = Entry("cycle_time_ms", "0.0");
  char buffer[256];
  EXPECT_EQ(mpistrategy_validate_config(text.data(), text.size(), buffer,
                                        sizeof(buffer)),
            static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(std::string(buffer), Check("cycle_time_ms", "0.0"));
  char small[8];
  EXPECT_EQ(mpistrategy_validate_config(text.data(), text.size(), small,
                                        sizeof(small)),
            static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(std::string(small), "Options");
  const std::string good = Entry("cycle_time_ms", "3.0");
  buffer[0] = 'x';
  EXPECT_EQ(mpistrategy_validate_config(good.data(), good.size(), buffer,
                                        sizeof(buffer)),
            0);
  EXPECT_EQ(buffer[0], '\0');
  EXPECT_EQ(mpistrategy_validate_config(good.data(), good.size(), nullptr,
                                        0),
            0);
}

}  // namespace
}  // namespace mpistrategy
