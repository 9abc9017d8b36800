#include "cc/kernels/engine_holder.h"

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

namespace mpistrategy {
namespace {

// "cycle_time_ms (running: 1, requested: 5)" for every field that differs;
// empty when the configs are equal.
std::string ConfigDifferences(const EngineConfig& running,
                              const EngineConfig& requested) {
  std::ostringstream out;
  auto field = [&out](const char* name, const auto& a, const auto& b) {
    if (a == b) return;
    if (out.tellp() > 0) out << ", ";
    out << name << " (running: " << a << ", requested: " << b << ")";
  };
  field("fusion_threshold_bytes", running.fusion_threshold_bytes,
        requested.fusion_threshold_bytes);
  field("cycle_time_ms", running.cycle_time_ms, requested.cycle_time_ms);
  field("fusion_wait_ms", running.fusion_wait_ms, requested.fusion_wait_ms);
  field("autotune", running.autotune, requested.autotune);
  field("autotune_log", "'" + running.autotune_log + "'",
        "'" + requested.autotune_log + "'");
  field("cache_capacity", running.cache_capacity, requested.cache_capacity);
  field("stall_warning_seconds", running.stall_warning_seconds,
        requested.stall_warning_seconds);
  field("stall_timeout_seconds", running.stall_timeout_seconds,
        requested.stall_timeout_seconds);
  field("timeline", "'" + running.timeline_path + "'",
        "'" + requested.timeline_path + "'");
  field("hierarchical_allreduce", running.hierarchical_allreduce,
        requested.hierarchical_allreduce);
  return out.str();
}

}  // namespace

EngineHolder& EngineHolder::Instance() {
  // Leaked on purpose; see the header.
  static EngineHolder* holder = new EngineHolder();
  return *holder;
}

std::shared_ptr<Engine> EngineHolder::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_;
}

Status EngineHolder::Init(const EngineConfig& config,
                          const TransportFactory& factory) {
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  if (std::shared_ptr<Engine> running = Get(); running && running->stopped()) {
    running.reset();
    ShutdownLocked();
  }
  if (std::shared_ptr<Engine> running = Get()) {
    const std::string diff = ConfigDifferences(running->config(), config);
    if (diff.empty()) return Status::Ok();
    return Status::FailedPrecondition(
        "mpistrategy is already initialized with a different configuration: " +
        diff + "; call mpistrategy.shutdown() first");
  }
  MPISTRATEGY_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<Transport> transport;
  MPISTRATEGY_RETURN_IF_ERROR(factory(&transport));
  std::unique_ptr<Engine> engine;
  MPISTRATEGY_RETURN_IF_ERROR(
      Engine::Create(config, std::move(transport), &engine));
  std::lock_guard<std::mutex> lock(mu_);
  engine_ = std::move(engine);
  return Status::Ok();
}

void EngineHolder::Shutdown() {
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  ShutdownLocked();
}

void EngineHolder::ShutdownLocked() {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine.swap(engine_);
  }
  if (engine == nullptr) return;
  // Kernels hold a reference only while they call Enqueue, so this wait is
  // short.  Waiting here (instead of letting the last kernel destroy the
  // engine) guarantees the engine, its thread and its communicator are gone
  // when Shutdown returns, so a following Init never overlaps with them.
  while (engine.use_count() > 1) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  engine.reset();
}

void EngineHolder::Abort(const std::string& reason, double timeout_seconds) {
  if (std::shared_ptr<Engine> engine = Get()) {
    engine->Abort(reason, timeout_seconds);
  }
}

}  // namespace mpistrategy
