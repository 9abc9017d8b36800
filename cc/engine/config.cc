#include "cc/engine/config.h"

#include <cmath>
#include <string>

namespace mpistrategy {

namespace {

std::string Num(double v) {
  std::string s = std::to_string(v);
  // Trim "1.500000" -> "1.5", "2.000000" -> "2".
  if (s.find('.') != std::string::npos) {
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
  }
  return s;
}

}  // namespace

Status EngineConfig::Validate() const {
  if (fusion_threshold_bytes < 0) {
    return Status::InvalidArgument(
        "EngineConfig.fusion_threshold_bytes must be >= 0 (0 disables "
        "fusion), got " +
        std::to_string(fusion_threshold_bytes));
  }
  if (!(cycle_time_ms > 0.0) || !std::isfinite(cycle_time_ms)) {
    return Status::InvalidArgument(
        "EngineConfig.cycle_time_ms must be a finite number > 0, got " +
        Num(cycle_time_ms));
  }
  if (!(fusion_wait_ms >= 0.0) || !std::isfinite(fusion_wait_ms) ||
      fusion_wait_ms > 1000.0) {
    return Status::InvalidArgument(
        "EngineConfig.fusion_wait_ms must be a number in [0, 1000] (0 "
        "negotiates at once), got " +
        Num(fusion_wait_ms));
  }
  if (cache_capacity < 0) {
    return Status::InvalidArgument(
        "EngineConfig.cache_capacity must be >= 0 (0 disables the response "
        "cache), got " +
        std::to_string(cache_capacity));
  }
  if (!(stall_warning_seconds >= 0.0)) {
    return Status::InvalidArgument(
        "EngineConfig.stall_warning_seconds must be >= 0 (0 disables the "
        "warning), got " +
        Num(stall_warning_seconds));
  }
  if (!(stall_timeout_seconds >= 0.0)) {
    return Status::InvalidArgument(
        "EngineConfig.stall_timeout_seconds must be >= 0 (0 waits forever), "
        "got " +
        Num(stall_timeout_seconds));
  }
  if (!(peer_timeout_seconds >= 0.0) || !std::isfinite(peer_timeout_seconds)) {
    return Status::InvalidArgument(
        "EngineConfig.peer_timeout_seconds must be a finite number >= 0 (0 "
        "waits for silent peers forever), got " +
        Num(peer_timeout_seconds));
  }
  if (shm_bytes < kMinShmBytes) {
    return Status::InvalidArgument(
        "EngineConfig.shm_bytes must be >= " + std::to_string(kMinShmBytes) +
        ", got " + std::to_string(shm_bytes));
  }
  return Status::Ok();
}

}  // namespace mpistrategy
