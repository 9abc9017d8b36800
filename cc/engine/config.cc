#include "cc/engine/config.h"

#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <system_error>

namespace mpistrategy {

namespace {

// The longest cycle_time_ms accepted (see Validate).
constexpr double kMaxCycleTimeMs = 1000.0;

// The shortest text that reads back as `v` ("0.5", "1500", "inf", "nan");
// std::to_chars is locale-independent.
std::string Num(double v) {
  char buffer[64];
  const std::to_chars_result result =
      std::to_chars(buffer, buffer + sizeof(buffer), v);
  return std::string(buffer, result.ptr);
}

Status OutOfRange(const char* key, const char* accepted,
                  const std::string& got) {
  return Status::InvalidArgument(std::string("Options.") + key + " must be " +
                                 accepted + ", got " + got);
}

// Shared by Validate and by the parser, which checks the range before it
// narrows the parsed 64-bit value to the field's 32 bits.
Status CheckCacheCapacity(int64_t value) {
  if (value < 0 || value > INT32_MAX) {
    return OutOfRange("cache_capacity",
                      "an integer in [0, 2147483647] (0 disables the "
                      "response cache)",
                      std::to_string(value));
  }
  return Status::Ok();
}

// A number that must be finite and >= 0 (> 0 when `positive`).
Status CheckSeconds(const char* key, double value, bool positive,
                    const char* accepted) {
  if (!std::isfinite(value) || value < 0.0 || (positive && value == 0.0)) {
    return OutOfRange(key, accepted, Num(value));
  }
  return Status::Ok();
}

// std::from_chars: locale-independent (a program may set LC_NUMERIC).
Status ParseInt64(const char* key, const std::string& text, int64_t* out) {
  const char* end = text.data() + text.size();
  const std::from_chars_result result =
      std::from_chars(text.data(), end, *out);
  if (result.ec == std::errc::result_out_of_range && result.ptr == end) {
    return Status::InvalidArgument(std::string("Options.") + key +
                                   " must be an integer that fits in 64 "
                                   "bits, got " +
                                   text);
  }
  if (text.empty() || result.ec != std::errc() || result.ptr != end) {
    return Status::InvalidArgument(std::string("Options.") + key +
                                   " must be a decimal integer, got '" +
                                   text + "'");
  }
  return Status::Ok();
}

// Accepts what Python's repr(float) writes, "inf" and "nan" included.
Status ParseDouble(const char* key, const std::string& text, double* out) {
  const char* end = text.data() + text.size();
  const std::from_chars_result result =
      std::from_chars(text.data(), end, *out);
  if (text.empty() || result.ec != std::errc() || result.ptr != end) {
    return Status::InvalidArgument(std::string("Options.") + key +
                                   " must be a decimal number, got '" + text +
                                   "'");
  }
  return Status::Ok();
}

Status ParseBool(const char* key, const std::string& text, bool* out) {
  if (text != "0" && text != "1") {
    return Status::InvalidArgument(std::string("Options.") + key +
                                   " must be 0 or 1, got '" + text + "'");
  }
  *out = text == "1";
  return Status::Ok();
}

// The one table from configuration keys (mpistrategy.Options' field names)
// to EngineConfig fields.  A new option is one line here, one range check
// in Validate (if it has a range) and one field in Options.
struct ConfigField {
  const char* key;
  Status (*set)(const char* key, const std::string& text,
                EngineConfig* config);
};

const ConfigField kConfigFields[] = {
    {"fusion_threshold_bytes",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseInt64(k, t, &c->fusion_threshold_bytes);
     }},
    {"cycle_time_ms",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseDouble(k, t, &c->cycle_time_ms);
     }},
    {"fusion_wait_ms",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseDouble(k, t, &c->fusion_wait_ms);
     }},
    {"autotune",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseBool(k, t, &c->autotune);
     }},
    {"autotune_log",
     [](const char*, const std::string& t, EngineConfig* c) {
       c->autotune_log = t;
       return Status::Ok();
     }},
    {"cache_capacity",
     [](const char* k, const std::string& t, EngineConfig* c) {
       int64_t value = 0;
       MPISTRATEGY_RETURN_IF_ERROR(ParseInt64(k, t, &value));
       MPISTRATEGY_RETURN_IF_ERROR(CheckCacheCapacity(value));
       c->cache_capacity = static_cast<int32_t>(value);
       return Status::Ok();
     }},
    {"stall_warning_seconds",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseDouble(k, t, &c->stall_warning_seconds);
     }},
    {"stall_timeout_seconds",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseDouble(k, t, &c->stall_timeout_seconds);
     }},
    {"peer_timeout_seconds",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseDouble(k, t, &c->peer_timeout_seconds);
     }},
    {"timeline",
     [](const char*, const std::string& t, EngineConfig* c) {
       c->timeline_path = t;
       return Status::Ok();
     }},
    {"hierarchical_allreduce",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseBool(k, t, &c->hierarchical_allreduce);
     }},
    {"checkpoint_read_timeout_seconds",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseDouble(k, t, &c->checkpoint_read_timeout_seconds);
     }},
    {"data_plane",
     [](const char* k, const std::string& t, EngineConfig* c) {
       for (HostDataPlane p : {HostDataPlane::kAuto, HostDataPlane::kMpi,
                               HostDataPlane::kShm}) {
         if (t == HostDataPlaneName(p)) {
           c->data_plane = p;
           return Status::Ok();
         }
       }
       return Status::InvalidArgument(std::string("Options.") + k +
                                      " must be \"auto\", \"mpi\" or \"shm\", got '" +
                                      t + "'");
     }},
    {"shm_bytes",
     [](const char* k, const std::string& t, EngineConfig* c) {
       return ParseInt64(k, t, &c->shm_bytes);
     }},
};

}  // namespace

Status EngineConfig::Validate() const {
  if (fusion_threshold_bytes < 0) {
    return OutOfRange("fusion_threshold_bytes",
                      "an integer >= 0 (0 disables fusion)",
                      std::to_string(fusion_threshold_bytes));
  }
  if (!std::isfinite(cycle_time_ms) || !(cycle_time_ms > 0.0)) {
    return OutOfRange("cycle_time_ms", "a finite number > 0",
                      Num(cycle_time_ms));
  }
  // An idle rank joins the negotiation only this often, and the stall
  // inspector sees a late rank's submission only then: longer periods
  // would delay stall warnings and timeouts by as much.
  if (cycle_time_ms > kMaxCycleTimeMs) {
    return OutOfRange("cycle_time_ms",
                      "at most 1000 (an idle rank joins the negotiation this "
                      "often, so a longer period delays stall warnings and "
                      "timeouts)",
                      Num(cycle_time_ms));
  }
  if (!(fusion_wait_ms >= 0.0 && fusion_wait_ms <= 1000.0)) {
    return OutOfRange("fusion_wait_ms",
                      "a number in [0, 1000] (0 negotiates at once)",
                      Num(fusion_wait_ms));
  }
  MPISTRATEGY_RETURN_IF_ERROR(CheckCacheCapacity(cache_capacity));
  MPISTRATEGY_RETURN_IF_ERROR(
      CheckSeconds("stall_warning_seconds", stall_warning_seconds, false,
                   "a finite number >= 0 (0 disables the warning)"));
  MPISTRATEGY_RETURN_IF_ERROR(
      CheckSeconds("stall_timeout_seconds", stall_timeout_seconds, false,
                   "a finite number >= 0 (0 waits forever)"));
  MPISTRATEGY_RETURN_IF_ERROR(CheckSeconds(
      "peer_timeout_seconds", peer_timeout_seconds, false,
      "a finite number >= 0 (0 waits for silent peers forever)"));
  MPISTRATEGY_RETURN_IF_ERROR(
      CheckSeconds("checkpoint_read_timeout_seconds",
                   checkpoint_read_timeout_seconds, true,
                   "a finite number > 0"));
  if (shm_bytes < kMinShmBytes) {
    return OutOfRange("shm_bytes", "an integer >= 1048576 (1 MiB)",
                      std::to_string(shm_bytes));
  }
  return Status::Ok();
}

Status ParseConfig(const char* text, size_t length, EngineConfig* config) {
  if (text == nullptr) length = 0;
  std::set<std::string> seen;
  size_t start = 0;
  while (start < length) {
    const char* entry_begin = text + start;
    const size_t entry_length = strnlen(entry_begin, length - start);
    const std::string entry(entry_begin, entry_length);
    start += entry_length + 1;
    const size_t equals = entry.find('=');
    if (equals == std::string::npos) {
      return Status::InvalidArgument("configuration entry '" + entry +
                                     "' is not key=value");
    }
    const std::string key = entry.substr(0, equals);
    const ConfigField* field = nullptr;
    for (const ConfigField& candidate : kConfigFields) {
      if (key == candidate.key) field = &candidate;
    }
    if (field == nullptr) {
      return Status::InvalidArgument("unknown configuration key '" + key +
                                     "'");
    }
    // A key given twice is a caller's bug that would otherwise hide one of
    // the two values.
    if (!seen.insert(key).second) {
      return Status::InvalidArgument("configuration key '" + key +
                                     "' is given twice");
    }
    MPISTRATEGY_RETURN_IF_ERROR(
        field->set(field->key, entry.substr(equals + 1), config));
  }
  return Status::Ok();
}

Status ParseAndValidateConfig(const char* text, size_t length,
                              EngineConfig* config) {
  MPISTRATEGY_RETURN_IF_ERROR(ParseConfig(text, length, config));
  return config->Validate();
}

}  // namespace mpistrategy
