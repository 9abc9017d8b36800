"""Whole-job checkpoint cases: a full file system, a restore on rank 0 only.

Runs tests/launcher/scripts/checkpoint_job.py under mpirun.

* A full file system: a 1 MiB tmpfs, mounted by the test (root, and a
  kernel that lets us: CI), filled up after a first write so that the next
  write of the same path fails.  For each kind of write rank 0 makes for the
  user (save_weights, save, ModelCheckpoint, export, Checkpoint.save/write,
  CheckpointManager, BackupAndRestore) the first copy must still load, with
  the first weights, and no temporary file may be left.  Uncaught (a
  ModelCheckpoint in fit()), the error ends the job on every rank, naming
  rank 0 and errno 28.  The same on `mpistrategy.horovod` alone, where rank
  0 saves by Horovod's habit.  Where mounting is not allowed the tests are
  skipped with a message saying so.
* Restoring on rank 0 only (the Horovod habit) while the others train: the
  engine sees rank 0's read and the others' training collectives crossed,
  so the job must end within seconds (far below the 120 s read timeout)
  with rank 0's FailedPreconditionError saying what to do and the others'
  errors naming rank 0's checkpoint read, instead of hanging.
* Scratch directories (`$TMPDIR/mpistrategy-rank<r>-*`, where ranks > 0
  write their copies) and autograph's modules: gone after a job whose rank
  raised (MPI_Abort skips atexit); scratch directories a SIGKILL left
  behind are removed by the next job that saves on the same host.
* The same habit on `mpistrategy.horovod` alone (no MPIStrategy, so reads
  are local as in Horovod): rank 0 restores, `hvd.broadcast_variables`
  gives every rank the restored weights.
"""

import os
import re
import subprocess
import tempfile

import pytest

_ERRNO_28 = re.compile(r"Errno 28|No space left on device|ENOSPC",
                       re.IGNORECASE)


@pytest.fixture()
def tmpfs():
  """A 1 MiB tmpfs, unmounted and removed in teardown."""
  path = tempfile.mkdtemp(prefix="mpistrategy-tmpfs-")
  try:
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path],
        capture_output=True, text=True, timeout=30, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    mounted = None
    reason = str(e)
  if mounted is None or mounted.returncode != 0:
    os.rmdir(path)
    reason = reason if mounted is None else mounted.stderr.strip()
    pytest.skip("NOT TESTED: full file system (cannot mount a tmpfs here: "
                f"{reason}; run as root with CAP_SYS_ADMIN)")
  try:
    yield path
  finally:
    if subprocess.run(["umount", path], capture_output=True, timeout=60,
                      check=False).returncode != 0:
      subprocess.run(["umount", "-l", path], capture_output=True, timeout=60,
                     check=False)
    os.rmdir(path)


def _assert_rank_0_failed_and_kept_the_first_copies(job, kinds):
  """Rank 0's second write of each kind failed with ENOSPC, naming the
  user's path, and its first copy still loads, with no temporary left."""
  errors = job.events("ERROR", rank=0)
  assert len(errors) == kinds, job.describe()
  for e in errors:
    kind, error = e.text.split(" ", 1)
    assert _ERRNO_28.search(error) or "ResourceExhausted" in error, (
        f"{kind}: rank 0's second write did not fail with ENOSPC: {error}")
    # It names the user's path, not the staged copy or a temporary name.
    assert "mpistrategy-rank" not in error and "stage-" not in error, (
        f"{kind}: {error}")
  checks = job.events("CHECK", rank=0)
  assert len(checks) == kinds, job.describe()
  for e in checks:
    assert "loads_previous=True" in e.text and "litter=[]" in e.text, (
        e.text + "\n" + job.describe())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [2, 3])
def test_full_file_system_keeps_the_previous_copy(launch, tmpfs, np_):
  job = launch("checkpoint_job.py", np=np_, timeout=540,
               args=["--mode", "enospc", "--dir", tmpfs])
  try:
    assert job.returncode == 0, job.describe()
    _assert_rank_0_failed_and_kept_the_first_copies(job, 8)
    for r in range(1, np_):  # ranks > 0 write their scratch copy: no error
      assert all(e.text.endswith(" none") for e in job.events("ERROR", r))
  finally:
    job.assert_no_leftovers()


@pytest.mark.timeout(400)
def test_full_file_system_keeps_the_previous_copy_on_the_horovod_layer(
    launch, tmpfs):
  # Horovod's habit (rank 0 saves, no MPIStrategy): Keras and TF write in
  # place, so a failed write used to leave a truncated file and no copy.
  kinds = ("save_weights,save,model_checkpoint,export,checkpoint_save,"
           "checkpoint_write,manager")
  job = launch("checkpoint_job.py", np=2, timeout=340,
               args=["--mode", "enospc", "--layer", "horovod", "--dir", tmpfs,
                     "--kinds", kinds])
  try:
    assert job.returncode == 0, job.describe()
    _assert_rank_0_failed_and_kept_the_first_copies(job, 7)
  finally:
    job.assert_no_leftovers()


@pytest.mark.timeout(300)
def test_full_file_system_ends_the_job_naming_rank_0(launch, tmpfs):
  job = launch("checkpoint_job.py", np=2, timeout=240,
               args=["--mode", "enospc-uncaught", "--dir", tmpfs])
  try:
    assert job.returncode != 0 and not job.timed_out, job.describe()
    assert not job.events("FINISHED"), job.describe()
    for r in range(2):
      text = job.rank_text(r)
      assert _ERRNO_28.search(text), f"rank {r}:\n" + job.describe()
      assert re.search(r"\brank 0\b", text) or r == 0, job.describe()
    assert sorted(os.listdir(tmpfs)) == ["filler", "w.weights.h5"], (
        os.listdir(tmpfs))  # no temporary file left
    os.remove(os.path.join(tmpfs, "filler"))
    # The epoch-0 weights file is intact: load it in a fresh process.
    expected = job.event("WRITTEN", 0).text
    check = subprocess.run(
        [_python(), "-c", _LOAD_AND_DIGEST,
         os.path.join(tmpfs, "w.weights.h5")],
        capture_output=True, text=True, timeout=180, check=False,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""))
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip().splitlines()[-1] == expected
  finally:
    job.assert_no_leftovers()


def _python():
  import conftest  # pylint: disable=g-import-not-at-top
  return conftest.PYTHON


_LOAD_AND_DIGEST = """
import hashlib, sys
import numpy as np
import keras
m = keras.Sequential([keras.Input((64,)),
                      keras.layers.Dense(256, activation="relu"),
                      keras.layers.Dense(10)])
m.load_weights(sys.argv[1])
h = hashlib.sha256()
for w in m.weights:
  h.update(np.ascontiguousarray(np.asarray(w)).tobytes())
print(h.hexdigest()[:16])
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api", ["checkpoint", "load_weights", "manager"])
def test_restore_on_rank_0_only_fails_instead_of_hanging(launch, api):
  work = tempfile.mkdtemp(prefix="mpistrategy-restore-")
  what = {"checkpoint": "tf.train.Checkpoint.read/restore",
          "load_weights": "Model.load_weights",
          "manager": "tf.train.CheckpointManager.restore_or_initialize"}[api]
  try:
    # The default read timeout (120 s) applies: the crossing must end the
    # job long before it.
    job = launch("checkpoint_job.py", np=2, timeout=200,
                 args=["--mode", "rank0-restore", "--dir", work,
                       "--api", api])
    assert job.returncode != 0 and not job.timed_out, job.describe()
    assert not job.events("FINISHED"), job.describe()
    restoring = job.event("RESTORING", 0).time
    assert job.end - restoring < 60, job.describe()
    text0 = job.rank_text(0).replace("\n", " ")
    assert "FailedPreconditionError" in text0, job.describe()
    assert f"rank 0 called {what}" in text0, job.describe()
    assert "must make the call on every rank" in text0, job.describe()
    text1 = job.rank_text(1).replace("\n", " ")
    assert re.search(r"cannot complete: rank 0 \(host", text1), job.describe()
    assert f"MPIBlockingJoin/{what}" in text1, job.describe()
    job.assert_no_leftovers()
  finally:
    subprocess.run(["rm", "-rf", work], check=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_layer_rank_0_restore_then_broadcast_works(launch, np_):
  work = tempfile.mkdtemp(prefix="mpistrategy-hvd-restore-")
  try:
    job = launch("checkpoint_job.py", np=np_, timeout=200,
                 args=["--mode", "hvd-rank0-restore", "--dir", work])
    assert job.returncode == 0, job.describe()
    saved = job.event("WRITTEN", 0).text
    for r in range(np_):
      assert job.event("RESTORED", r).text == saved, job.describe()
    job.assert_no_leftovers()
  finally:
    subprocess.run(["rm", "-rf", work], check=False)


def _scratch_dirs(tmp):
  return sorted(d for d in os.listdir(tmp) if d.startswith("mpistrategy-rank"))


def _scratch_job(launch, tmp, then, np_=2):
  work = os.path.join(tmp, "work")
  os.makedirs(work, exist_ok=True)
  return launch("checkpoint_job.py", np=np_, timeout=200,
                env={"TMPDIR": tmp},
                args=["--mode", "scratch", "--dir", work, "--then", then])


@pytest.fixture()
def job_tmp():
  """A private TMPDIR for the jobs, removed in teardown."""
  tmp = tempfile.mkdtemp(prefix="mpistrategy-test-tmp-")
  try:
    yield tmp
  finally:
    subprocess.run(["rm", "-rf", tmp], check=False)


@pytest.mark.timeout(300)
def test_scratch_directories_are_removed_when_a_rank_raises(launch, job_tmp):
  job = _scratch_job(launch, job_tmp, "raise")
  assert job.returncode != 0 and not job.timed_out, job.describe()
  assert "raised after saving" in job.rank_text(1), job.describe()
  used = [os.path.basename(job.event("SCRATCH", r).text) for r in range(2)]
  assert all(u.startswith("mpistrategy-rank") for u in used), used
  job.assert_no_leftovers()
  assert _scratch_dirs(job_tmp) == [], job.describe()
  # Nor autograph's modules, which its atexit (skipped by MPI_Abort) removes.
  assert not [f for f in os.listdir(job_tmp)
              if f.startswith("__autograph_generated_file")], (
                  os.listdir(job_tmp))


@pytest.mark.timeout(400)
def test_scratch_directories_a_kill_left_are_removed_by_the_next_job(
    launch, job_tmp):
  killed = _scratch_job(launch, job_tmp, "kill")
  assert killed.returncode != 0 and not killed.timed_out, killed.describe()
  killed.assert_no_leftovers()
  left = _scratch_dirs(job_tmp)
  # The killed rank cannot clean up; mpirun ends the others by signal.
  assert os.path.basename(killed.event("SCRATCH", 1).text) in left, (
      left, killed.describe())
  # An older version's directory (no owner file) is not ours to judge.
  os.makedirs(os.path.join(job_tmp, "mpistrategy-rank5-legacy"))
  job = _scratch_job(launch, job_tmp, "exit")
  assert job.returncode == 0, job.describe()
  assert len(job.events("FINISHED")) == 2, job.describe()
  assert _scratch_dirs(job_tmp) == ["mpistrategy-rank5-legacy"], (
      job.describe())
