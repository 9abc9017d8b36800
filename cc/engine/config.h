// Engine configuration, and the one place where mpistrategy's options are
// parsed and range-checked.
//
// Python (mpistrategy/options.py) resolves defaults and MPISTRATEGY_*
// environment overrides and sends the values as text, "key=value" entries
// each ended by a NUL byte, parsed by one table (kConfigFields in config.cc)
// and checked by EngineConfig::Validate.  The same two functions serve
// mpistrategy_init (cc/kernels/c_api.cc) and the TF-free
// mpistrategy_validate_config (config_c_api.cc, built as mpistrategy/
// _config.so), which Options calls before anything starts, so every caller
// gets the same messages.  C++ never reads the environment.

#ifndef MPISTRATEGY_CC_ENGINE_CONFIG_H_
#define MPISTRATEGY_CC_ENGINE_CONFIG_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/engine/autotuner.h"
#include "cc/common/common.h"

namespace mpistrategy {

struct EngineConfig {
  // Ready allreduces of the same kind are packed into one buffer of at most
  // this many bytes.  0 disables fusion.
  int64_t fusion_threshold_bytes = 64 << 20;

  // How long the background thread sleeps when it has nothing to do before it
  // joins an (empty) negotiation cycle anyway.  Enqueueing a tensor wakes it
  // immediately, so this is not a latency floor; it bounds how stale the
  // stall inspector's view of other ranks can get.  While the rank stays
  // idle the period doubles after each empty cycle, up to 16 ms (or this,
  // if larger).
  double cycle_time_ms = 1.0;

  // After the first tensor arrives at an idle engine, wait this long for
  // more before negotiating, so that tensors arriving a little apart share
  // a fusion bucket.  0 (the default) negotiates at once: no latency floor.
  double fusion_wait_ms = 0.0;

  // Rank 0 tunes fusion_threshold_bytes and fusion_wait_ms online (see
  // autotuner.h) and publishes its choices to every rank through the
  // negotiation.  The configured values are the starting point.
  bool autotune = false;
  // Rank 0 appends the autotuner's samples and decisions (CSV) here; empty
  // disables the log.
  std::string autotune_log;
  // Search space and sample lengths (tests shorten them; not exposed to
  // Python).
  AutotuneSettings autotune_settings;

  // Number of negotiated collectives remembered for the bit-vector fast path
  // (least recently used ones are forgotten first; 0 disables the cache).
  int32_t cache_capacity = 1024;

  // A tensor some ranks submitted and others did not for this long is logged
  // with the missing ranks.  0 disables the warning.
  double stall_warning_seconds = 60.0;

  // ... and after this long it fails with DeadlineExceeded on the ranks that
  // submitted it.  0 (the default) waits forever, as MPI does.
  double stall_timeout_seconds = 0.0;

  // Liveness: a rank that has heard nothing from a peer for this long
  // (every rank's engine sends heartbeats several times a second, whatever
  // its Python code is doing, so silence means the peer's process is frozen,
  // dead or cut off by the network, or its engine stopped) fails every
  // pending and future collective with Unavailable naming the silent ranks,
  // and the embedding ends the job (see PeerMonitor, peer_monitor.h).  The
  // waiting ranks log the silent ones after stall_warning_seconds.  0
  // disables it: a silent peer is then waited for forever, as MPI does.
  double peer_timeout_seconds = 120.0;

  // Chrome-trace JSON (chrome://tracing, Perfetto) written by rank 0's
  // engine: per-tensor negotiation, queue, copy and collective spans and one
  // span per cycle (timeline.h).  When the path contains "{rank}", every rank
  // writes its own file with "{rank}" replaced by its rank.  Empty disables
  // it.  Engine::Create fails with InvalidArgument when the file cannot be
  // created.
  std::string timeline_path;

  // GPU tensors: NCCL inside a node, MPI between nodes.
  bool hierarchical_allreduce = false;

  // CPU tensors: shared memory among the ranks of a host (and MPI across
  // hosts), or MPI only (HostDataPlane, common.h; MpiTransport's
  // CreateHostPlane decides).
  HostDataPlane data_plane = HostDataPlane::kAuto;
  // The shared-memory segment of each host, in bytes: larger moves a big
  // tensor in fewer rounds.  At least kMinShmBytes.
  int64_t shm_bytes = 16 << 20;
  static constexpr int64_t kMinShmBytes = 1 << 20;

  // Not used by the engine: how long Python's checkpoint reads wait for the
  // other ranks (mpistrategy/checkpoint.py).  Here so that every option's
  // range is checked in one place.
  double checkpoint_read_timeout_seconds = 120.0;

  // Checks every field's range.  The message names the option as
  // "Options.<key>" (the key of kConfigFields, mpistrategy.Options' field
  // name), what it accepts and the value it got.
  Status Validate() const;
};

// Fills `config` from `length` bytes of "key=value" entries, each ended by a
// NUL byte; the keys are mpistrategy.Options' field names and a key not
// given keeps its default.  Unknown or repeated keys, and values that do not
// parse as the field's type, are InvalidArgument errors.  Ranges are not
// checked here (see ParseAndValidateConfig).
Status ParseConfig(const char* text, size_t length, EngineConfig* config);

// ParseConfig, then EngineConfig::Validate.
Status ParseAndValidateConfig(const char* text, size_t length,
                              EngineConfig* config);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_CONFIG_H_
