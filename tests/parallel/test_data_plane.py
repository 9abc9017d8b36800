"""Options.data_plane under mpirun: which plane carries CPU tensors.

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_data_plane.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_data_plane.py

The op results on each plane are test_ops.py's (shared memory, the default
on one host) and test_ops_mpi_plane.py's (MPI); here: the plane in use, the
same bits from both, and what happens where shared memory cannot be used.
Every rank of the job runs on one host.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops
from mpistrategy import runtime

SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                          os.environ.get("PMI_SIZE", "1")))
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK",
                          os.environ.get("PMI_RANK", "0")))
pytestmark = [
    pytest.mark.skipif(SIZE < 2, reason="needs other ranks"),
    pytest.mark.skipif(
        "MPISTRATEGY_DATA_PLANE" in os.environ or
        "MPISTRATEGY_SHM_BYTES" in os.environ,
        reason="the environment overrides the data plane"),
]
# More than any /dev/shm holds.
HUGE = 1 << 50


def _mapped_segments():
  with open("/proc/self/maps") as f:
    return sorted({line.split()[5] for line in f
                   if "/dev/shm/mpistrategy-" in line})


def _restart(**options):
  mpistrategy.shutdown()
  mpistrategy.init(mpistrategy.Options(**options))


@pytest.fixture(autouse=True, scope="module")
def _default_engine_afterwards():
  yield
  mpistrategy.shutdown()
  mpistrategy.init()


def _results():
  """Results of a few collectives, as bytes, on this rank."""
  rng = np.random.default_rng(RANK)
  out = []
  for dtype in (np.float32, np.float16, np.float64, np.int32, np.int8):
    x = (rng.standard_normal(100003) * 50).astype(dtype)
    for op in (ops.Sum, ops.Average, ops.Min, ops.Max, ops.Product):
      if op is ops.Average and not np.issubdtype(dtype, np.floating):
        continue
      out.append(ops.allreduce(tf.constant(x), op=op).numpy().tobytes())
  # A group of one dtype: shared memory reduces it where its tensors are.
  group = [tf.constant((rng.standard_normal(n) * 50).astype(np.float32))
           for n in (3, 17, 6001, 0, 1)]
  for op in (ops.Sum, ops.Average, ops.Max):
    out.extend(y.numpy().tobytes()
               for y in ops.grouped_allreduce(group, op=op))
  rows = tf.constant(rng.standard_normal((RANK + 3, 7)).astype(np.float32))
  out.append(ops.allgather(rows).numpy().tobytes())
  out.append(ops.broadcast(rows[:2], root_rank=SIZE - 1).numpy().tobytes())
  out.append(ops.reducescatter(
      tf.constant(rng.standard_normal((2 * SIZE + 1, 5)).astype(np.float32)),
      op=ops.Average).numpy().tobytes())
  out.append(ops.alltoall(tf.fill([SIZE], RANK))[0].numpy().tobytes())
  return out


def test_default_is_shared_memory_and_matches_mpi_bit_for_bit():
  _restart()
  shm = _results()
  segments = _mapped_segments()
  # One segment, the same on every rank, and already gone from /dev/shm.
  assert len(segments) == 1, segments
  name = segments[0]
  mine = np.frombuffer(name.encode().ljust(128, b"\0"), np.uint8)
  every = ops.allgather(tf.constant(mine[None])).numpy()
  assert all(row.tobytes() == mine.tobytes() for row in every)
  assert not os.path.exists(name)
  _restart(data_plane="mpi")
  mpi = _results()
  assert not _mapped_segments()
  for i, (a, b) in enumerate(zip(shm, mpi)):
    # Sums of 3 ranks may round differently with MPI's own order; 2 ranks
    # (a + b) cannot.
    if SIZE == 2:
      assert a == b, f"result {i} differs between the planes"
  assert len(shm) == len(mpi)


def test_auto_falls_back_to_mpi_and_logs_why_once(capfd):
  _restart(shm_bytes=HUGE)
  np.testing.assert_allclose(
      ops.allreduce(tf.ones([5]), op=ops.Sum).numpy(), np.full([5], SIZE))
  assert not _mapped_segments()
  err = capfd.readouterr().err
  lines = [l for l in err.splitlines() if "CPU collectives use MPI" in l]
  if RANK == 0:
    assert len(lines) == 1 and "/dev/shm has" in lines[0], err
  else:
    assert not lines, err


def test_shm_that_cannot_be_used_fails_on_every_rank():
  # At init, as documented, not at the first collective (minutes later).
  cannot = (r'data_plane is "shm" but shared memory cannot carry this '
            r"job's CPU tensors: /dev/shm has \d+ bytes free, the segment "
            r"needs")
  with pytest.raises(tf.errors.FailedPreconditionError, match=cannot):
    _restart(data_plane="shm", shm_bytes=HUGE)
  # The same from the environment, where the first collective starts it.
  mpistrategy.shutdown()
  os.environ["MPISTRATEGY_DATA_PLANE"] = "shm"
  os.environ["MPISTRATEGY_SHM_BYTES"] = str(HUGE)
  try:
    with pytest.raises(tf.errors.FailedPreconditionError, match=cannot):
      ops.allreduce(tf.ones([5]))
  finally:
    del os.environ["MPISTRATEGY_DATA_PLANE"]
    del os.environ["MPISTRATEGY_SHM_BYTES"]


@pytest.mark.parametrize("field,first,others,shown", [
    ("data_plane", "mpi", "shm", "rank 0: mpi, rank 1: shm"),
    ("shm_bytes", 1 << 24, 1 << 21, "rank 0: 16777216, rank 1: 2097152"),
])
def test_ranks_that_disagree_on_the_data_plane_fail_on_every_rank(
    field, first, others, shown):
  # Each would set up its planes with different collectives (a hang, or
  # calls matched to the wrong ones).
  with pytest.raises(tf.errors.FailedPreconditionError,
                     match=f"ranks disagree on {field} \\({shown}\\); set "
                     f"MPISTRATEGY_{field.upper()} \\(or Options.{field}\\) "
                     "alike on every rank"):
    _restart(**{field: first if RANK == 0 else others})
  # What waits for the ranks' start-up exchange (the strategy's cluster
  # spec) gets the same error instead of waiting forever.
  with pytest.raises(tf.errors.FailedPreconditionError,
                     match=f"ranks disagree on {field}"):
    runtime.rank_hosts()
