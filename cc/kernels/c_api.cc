// C ABI for process control, called by mpistrategy/runtime.py through
// ctypes (signatures in mpistrategy/_library.py).  Python loads this same library with tf.load_op_library (for the
// ops) and ctypes.CDLL (for these functions); both get the same handle, so
// the kernels and these functions share one EngineHolder.
//
// MPI lifetime: MPI is initialized on the first mpistrategy_init unless
// someone (e.g. mpi4py) already did, and finalized at process exit only if we
// initialized it.  An MPI initialized by someone else is never finalized
// here; its owner must not finalize it before mpistrategy_shutdown
// (mpistrategy.init registers a Python atexit handler that shuts down first).

#include <mpi.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cc/common/common.h"
#include "cc/engine/config.h"
#include "cc/engine/engine.h"
#include "cc/kernels/engine_holder.h"
#include "cc/transport/mpi_transport.h"

#ifndef GOOGLE_CUDA
#define GOOGLE_CUDA 0
#endif

namespace mpistrategy {
namespace {

// Registered with atexit the first time EnsureMpiInitialized reports that
// we initialized MPI: stop the engine (its thread and communicator use MPI),
// then finalize.  Normally mpistrategy.shutdown (Python atexit) has already
// stopped the engine.
void FinalizeMpiAtExit() {
  // A fork child exiting normally must not finalize the parent's MPI.
  if (EngineHolder::Instance().IsForkedChild()) return;
  EngineHolder::Instance().Shutdown();
  FinalizeMpiIfWeInitialized();
}

// Exit status of a process ended by a peer timeout (StatusCode kUnavailable).
constexpr int kPeerTimeoutExitCode = 14;
// How long MPI_Abort may take before the process ends itself with _exit
// (MPI_Abort can hang when mpirun is unreachable, e.g. on the far side of
// a network partition).
constexpr double kAbortFallbackSeconds = 3.0;

// How long the launcher process that started this rank (mpirun, or the
// orted of this host) may outlive MPI_Abort before a peer-timeout exit ends
// it too.
constexpr unsigned kLauncherGraceSeconds = 4;

// True for the Open MPI / PRRTE processes that start ranks.  Never for a
// shell, srun/slurmstepd or a user's own supervisor.
bool IsOpenMpiLauncher(const std::string& comm) {
  for (const char* name : {"mpirun", "mpiexec", "orterun", "orted", "prterun",
                           "prted", "prte"}) {
    if (comm == name) return true;
  }
  return false;
}

// After a peer timeout the job is over, but Open MPI's launcher may not know
// it: after MPI_Abort, mpirun waits for every daemon of the job, and one
// that a network partition cut off never answers (until TCP gives up, about
// 15 minutes later), so mpirun and the far side's orted would outlive the
// job.  A detached watcher process therefore ends this rank's launcher
// (SIGTERM, then SIGKILL) if it is still there kLauncherGraceSeconds after
// the abort.  When mpirun ends the job normally, the watcher finds it gone
// and does nothing.
// Reads the command name and parent of `pid` from /proc/<pid>/stat
// ("pid (comm) state ppid ..."; comm may hold spaces and parentheses).
bool ReadProcess(pid_t pid, std::string* comm, pid_t* parent) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", static_cast<long>(pid));
  std::FILE* file = std::fopen(path, "r");
  if (file == nullptr) return false;
  char stat[512] = {0};
  const size_t n = std::fread(stat, 1, sizeof(stat) - 1, file);
  std::fclose(file);
  const std::string line(stat, n);
  const size_t open = line.find('(');
  const size_t close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos ||
      close < open) {
    return false;
  }
  *comm = line.substr(open + 1, close - open - 1);
  long ppid = 0;
  char state = 0;
  if (std::sscanf(line.c_str() + close + 1, " %c %ld", &state, &ppid) != 2) {
    return false;
  }
  *parent = static_cast<pid_t>(ppid);
  return true;
}

// The Open MPI launcher that started this rank: the parent, or a nearer
// ancestor's parent where the rank runs behind a wrapper (`python -m
// mpistrategy.quiet`, a shell).  Returns -1 if there is none within
// kLauncherSearchDepth generations (srun, a user's own supervisor).
constexpr int kLauncherSearchDepth = 3;
pid_t FindOpenMpiLauncher(std::string* name) {
  pid_t pid = getppid();
  for (int depth = 0; depth < kLauncherSearchDepth && pid > 1; ++depth) {
    pid_t parent = 0;
    if (!ReadProcess(pid, name, &parent)) return -1;
    if (IsOpenMpiLauncher(*name)) return pid;
    pid = parent;
  }
  return -1;
}

// The launcher reaper's program: $1 the launcher's pid, $2 the grace in
// seconds, $3 the note printed before ending it.
constexpr char kReaperScript[] =
    "i=0; while [ \"$i\" -lt \"$2\" ]; do sleep 1; "
    "kill -0 \"$1\" 2>/dev/null || exit 0; i=$((i + 1)); done; "
    "printf '%s' \"$3\" >&2; kill -TERM \"$1\" 2>/dev/null; sleep 2; "
    "kill -KILL \"$1\" 2>/dev/null; exit 0";

void ArmLauncherReaper() {
  std::string name;
  const pid_t launcher = FindOpenMpiLauncher(&name);
  if (launcher <= 1) return;
  // Everything the child needs is made before fork(): only
  // async-signal-safe calls after it in this multi-threaded process.
  const std::string pid_text = std::to_string(static_cast<long>(launcher));
  const std::string grace_text = std::to_string(kLauncherGraceSeconds);
  const std::string note =
      "[mpistrategy] " + name + " (pid " + pid_text + ") still runs " +
      grace_text + " s after MPI_Abort (a host it waits for is "
      "unreachable?): ending it\n";
  char* const argv[] = {const_cast<char*>("sh"), const_cast<char*>("-c"),
                        const_cast<char*>(kReaperScript),
                        const_cast<char*>("mpistrategy-launcher-reaper"),
                        const_cast<char*>(pid_text.c_str()),
                        const_cast<char*>(grace_text.c_str()),
                        const_cast<char*>(note.c_str()), nullptr};
  // The double fork detaches the watcher from this rank (not a zombie of
  // ours; its own session, so signals to the job's process group do not
  // reach it).  It runs a shell rather than staying a copy of this rank:
  // a copy kept the rank's MPI sockets and shared-memory mappings (Open
  // MPI's vader segments) alive, so that mpistrategyrun's clean-up saw
  // them mapped and left them in /dev/shm.
  const pid_t child = fork();
  if (child != 0) {
    if (child > 0) waitpid(child, nullptr, 0);
    return;
  }
  setsid();
  if (fork() != 0) _exit(0);
  // Only stderr (for the note) stays open.
  const int devnull = open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    dup2(devnull, STDIN_FILENO);
    dup2(devnull, STDOUT_FILENO);
  }
  if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
    for (int fd = 3; fd < 65536; ++fd) close(fd);
  }
  execv("/bin/sh", argv);
  _exit(0);  // no shell: the launcher is left to mpirun's own handling
}

// The engine's PeerTimeoutHandler: the engine has failed this rank's
// collectives and printed why; end the whole job even if Python caught the
// error.  MPI_Abort makes mpirun kill every rank it can reach; the launcher
// reaper ends mpirun (and a cut-off host's orted) if a daemon it waits for
// is unreachable.
void EndJobAfterPeerTimeout(const std::string& message) {
  (void)message;  // already printed by the engine
  ArmLauncherReaper();
  std::thread([] {
    std::this_thread::sleep_for(
        std::chrono::duration<double>(kAbortFallbackSeconds));
    std::fprintf(stderr,
                 "[mpistrategy] MPI_Abort did not end pid %ld within %.0f s "
                 "after the peer timeout; exiting\n",
                 static_cast<long>(getpid()), kAbortFallbackSeconds);
    std::fflush(stderr);
    std::_Exit(kPeerTimeoutExitCode);
  }).detach();
  MPI_Abort(MPI_COMM_WORLD, kPeerTimeoutExitCode);
  std::_Exit(kPeerTimeoutExitCode);
}

// Initializes MPI if needed (MpiTransport's EnsureMpiInitialized cooperates
// with an mpi4py that already did) and creates the world transport.
Status CreateWorldTransport(std::unique_ptr<Transport>* transport) {
  bool we_initialized = false;
  MPISTRATEGY_RETURN_IF_ERROR(EnsureMpiInitialized(&we_initialized));
  // True only for the call that initialized MPI, so registered once.
  if (we_initialized) std::atexit(FinalizeMpiAtExit);
  return MpiTransport::Create(MPI_COMM_WORLD, transport);
}

void CopyMessage(const std::string& message, char* buffer, int length) {
  if (buffer == nullptr || length <= 0) return;
  const size_t n =
      std::min(message.size(), static_cast<size_t>(length) - 1);
  std::memcpy(buffer, message.data(), n);
  buffer[n] = '\0';
}

// A property of the running engine, or -1 when not initialized.
template <typename Getter>
int EngineProperty(Getter getter) {
  std::shared_ptr<Engine> engine = EngineHolder::Instance().Get();
  return engine == nullptr ? -1 : getter(*engine);
}

}  // namespace
}  // namespace mpistrategy

extern "C" {

// Starts the engine over MPI_COMM_WORLD (initializing MPI if needed).
// `config` holds `config_length` bytes of "key=value" entries, each ended by
// a NUL byte; the keys are mpistrategy.Options' field names, parsed by the
// one table in cc/engine/config.cc (ParseConfig), and a key not given keeps
// EngineConfig's default.  EngineHolder::Init range-checks the result with
// EngineConfig::Validate, as mpistrategy_validate_config does.  Returns
// 0 on success, else a StatusCode (common.h) with the message copied
// (NUL-terminated, truncated to error_len) to error_buf.  A second call with
// the same configuration is a no-op.
int mpistrategy_init(const char* config_text, size_t config_length,
                     char* error_buf, int error_len) {
  mpistrategy::EngineConfig config;
  mpistrategy::Status status = mpistrategy::ParseConfig(
      config_text == nullptr ? "" : config_text,
      config_text == nullptr ? 0 : config_length, &config);
  if (!status.ok()) {
    mpistrategy::CopyMessage(status.message(), error_buf, error_len);
    return static_cast<int>(status.code());
  }
  // MPI_Init (first start) and MPI_Finalize (at exit) wait for every rank
  // outside the engine; they say so after the engine's stall warning time.
  mpistrategy::SetMpiWaitNoticeSeconds(config.stall_warning_seconds);
  status = mpistrategy::EngineHolder::Instance().Init(
      config, mpistrategy::CreateWorldTransport,
      mpistrategy::EndJobAfterPeerTimeout);
  mpistrategy::CopyMessage(status.message(), error_buf, error_len);
  return static_cast<int>(status.code());
}

// Stops the engine: pending collectives fail with Aborted and the other
// ranks' engines are told.  MPI stays initialized (see the file comment), so
// mpistrategy_init may be called again.  A no-op when not initialized.
void mpistrategy_shutdown() { mpistrategy::EngineHolder::Instance().Shutdown(); }

// Makes every rank's engine fail its pending and future collectives with
// Aborted carrying `reason`; returns once the others were told or after
// `timeout_seconds`.  A no-op when not initialized.
void mpistrategy_abort(const char* reason, double timeout_seconds) {
  mpistrategy::EngineHolder::Instance().Abort(reason == nullptr ? "" : reason,
                                              timeout_seconds);
}

// MPI_Abort(MPI_COMM_WORLD, code): ends every rank of the job (and, like a
// peer timeout, arms the launcher reaper, so an unreachable host cannot keep
// mpirun alive).  Without a usable MPI it ends only this process.
void mpistrategy_mpi_abort(int code) {
  // A fork child is no MPI process: end only itself.
  if (mpistrategy::EngineHolder::Instance().IsForkedChild()) std::_Exit(code);
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    mpistrategy::ArmLauncherReaper();
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  std::_Exit(code);
}

// Copies "rank N (host H, pid P)" for `rank` (as in the engine's messages)
// to buffer and returns 0, or returns -1 when not initialized.
int mpistrategy_describe_rank(int rank, char* buffer, int length) {
  std::shared_ptr<mpistrategy::Engine> engine =
      mpistrategy::EngineHolder::Instance().Get();
  if (engine == nullptr) return -1;
  mpistrategy::CopyMessage(engine->DescribeRank(rank), buffer, length);
  return 0;
}

// Waits until the engines have agreed at startup, then copies every rank's
// host name, one per line in rank order, to buffer and returns 0 (-1 when
// not initialized).  Returns the error's code and copies its message to
// buffer if the engine stopped first.
int mpistrategy_rank_hosts(char* buffer, int length) {
  std::shared_ptr<mpistrategy::Engine> engine =
      mpistrategy::EngineHolder::Instance().Get();
  if (engine == nullptr) return -1;
  std::vector<mpistrategy::PeerInfo> peers;
  const mpistrategy::Status status = engine->WaitForPeers(&peers);
  if (!status.ok()) {
    mpistrategy::CopyMessage(status.message(), buffer, length);
    return static_cast<int>(status.code());
  }
  std::string hosts;
  for (const mpistrategy::PeerInfo& peer : peers) hosts += peer.host + "\n";
  mpistrategy::CopyMessage(hosts, buffer, length);
  return 0;
}

// 1 in a process forked from the one that initialized mpistrategy (where
// collectives fail at once), else 0.
int mpistrategy_is_forked_child() {
  return mpistrategy::EngineHolder::Instance().IsForkedChild() ? 1 : 0;
}

int mpistrategy_is_initialized() {
  return mpistrategy::EngineHolder::Instance().Get() != nullptr ? 1 : 0;
}

// 1 when an engine exists but has stopped on an error (its collectives fail
// with that error; mpistrategy_init replaces it), else 0.
int mpistrategy_engine_stopped() {
  std::shared_ptr<mpistrategy::Engine> engine =
      mpistrategy::EngineHolder::Instance().Get();
  return engine != nullptr && engine->stopped() ? 1 : 0;
}

// -1 when not initialized.
int mpistrategy_rank() {
  return mpistrategy::EngineProperty([](const mpistrategy::Engine& e) {
    return e.rank();
  });
}
int mpistrategy_size() {
  return mpistrategy::EngineProperty([](const mpistrategy::Engine& e) {
    return e.size();
  });
}
int mpistrategy_local_rank() {
  return mpistrategy::EngineProperty([](const mpistrategy::Engine& e) {
    return e.local_rank();
  });
}
int mpistrategy_local_size() {
  return mpistrategy::EngineProperty([](const mpistrategy::Engine& e) {
    return e.local_size();
  });
}

// The fusion parameters in force (Engine::tuned_parameters): fills the three
// outputs and returns 0, or returns -1 when not initialized.
int mpistrategy_tuned_parameters(int64_t* fusion_threshold_bytes,
                                 double* fusion_wait_ms, int* final) {
  std::shared_ptr<mpistrategy::Engine> engine =
      mpistrategy::EngineHolder::Instance().Get();
  if (engine == nullptr) return -1;
  const mpistrategy::TunedParameters p = engine->tuned_parameters();
  *fusion_threshold_bytes = p.fusion_threshold_bytes;
  *fusion_wait_ms = p.fusion_wait_ms;
  *final = p.final ? 1 : 0;
  return 0;
}

// Engine::SetTimeline(path): 0, or a StatusCode (common.h) with the message
// copied to error_buf; FailedPrecondition when not initialized.
int mpistrategy_set_timeline(const char* path, char* error_buf,
                             int error_len) {
  std::shared_ptr<mpistrategy::Engine> engine =
      mpistrategy::EngineHolder::Instance().Get();
  mpistrategy::Status status =
      engine == nullptr
          ? mpistrategy::Status::FailedPrecondition(
                "mpistrategy is not initialized")
          : engine->SetTimeline(path == nullptr ? "" : path);
  mpistrategy::CopyMessage(status.message(), error_buf, error_len);
  return static_cast<int>(status.code());
}

// 1 when MPI is initialized with MPI_THREAD_MULTIPLE, else 0.
int mpistrategy_mpi_threads_supported() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 0;
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE ? 1 : 0;
}

int mpistrategy_built_with_cuda() { return GOOGLE_CUDA ? 1 : 0; }

// NCCL comes with the CUDA build (--config=cuda).
int mpistrategy_built_with_nccl() { return GOOGLE_CUDA ? 1 : 0; }

}  // extern "C"
