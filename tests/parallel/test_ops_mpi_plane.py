"""Every test of test_ops.py again, with CPU tensors on the MPI data plane.

The rest of the parallel suite runs with the default data plane, "auto",
which on one host is shared memory (cc/transport/shm_plane.h); this module
restarts the engine with `data_plane="mpi"` and collects test_ops.py's
tests once more, so every op check runs on both planes in one mpirun job.

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_ops_mpi_plane.py
"""

import pytest

import mpistrategy
# Imported test functions are collected again in this module.
from test_ops import *  # noqa: F401,F403  pylint: disable=wildcard-import
from test_ops import SIZE


def _mapped_segments():
  """Names of the mpistrategy shared-memory segments this process maps."""
  with open("/proc/self/maps") as f:
    return sorted({line.split()[5] for line in f
                   if "/dev/shm/mpistrategy-" in line})


@pytest.fixture(autouse=True, scope="module")
def _initialized():  # replaces test_ops' fixture of the same name
  mpistrategy.shutdown()
  mpistrategy.init(mpistrategy.Options(data_plane="mpi"))
  if mpistrategy.current_options().data_plane != "mpi":
    pytest.skip("MPISTRATEGY_DATA_PLANE overrides data_plane")
  yield
  mpistrategy.shutdown()
  mpistrategy.init()


@pytest.mark.skipif(SIZE < 2, reason="needs other ranks")
def test_zz_no_shared_memory_on_the_mpi_plane():
  # A test of this module, so after every other one (same engine).
  assert not _mapped_segments()
