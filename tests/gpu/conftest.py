"""GPU tests: skipped, with the reason, without a GPU or the CUDA build.

On a GPU machine (see tests/gpu/run_on_gpu.sh, which does all of this):

    bazel build --config=cuda //cc:_mpi_ops.so
    cp bazel-bin/cc/_mpi_ops.so mpistrategy/ops/_mpi_ops.so
    tests/mpirun_pytest.sh 1 300 tests/gpu      # NCCL
    tests/mpirun_pytest.sh 2 300 tests/gpu      # 2 ranks on one GPU: MPI
                                                # with host staging

Every rank pins itself to GPU `local_rank % n_gpus` (mpistrategy.gpu) before
TensorFlow initializes its GPUs.
"""

import os

import pytest
import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))


def skip_reason():
  """Why the GPU tests cannot run here, or None."""
  if not tf.config.list_physical_devices("GPU"):
    return ("no GPU visible to TensorFlow (needs an NVIDIA GPU, its driver "
            "and tensorflow[and-cuda])")
  try:
    from mpistrategy import ops
    if not ops.built_with_cuda():
      return ("the op library has no GPU kernels: build it with `bazel build "
              "--config=cuda //cc:_mpi_ops.so` and copy it to "
              "mpistrategy/ops/_mpi_ops.so")
  except ImportError as e:
    return f"the op library cannot be loaded: {e}"
  return None


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  mine = [i for i in items if str(i.fspath).startswith(_HERE + os.sep)]
  if not mine:
    return
  reason = skip_reason()
  if reason is not None:
    for item in mine:
      item.add_marker(pytest.mark.skip(reason=reason))


class World:
  """This rank's view: `rank`, `size` and the GPU it uses (`device`)."""

  def __init__(self, rank, size, device):
    self.rank = rank
    self.size = size
    self.device = device


@pytest.fixture(scope="session")
def world():
  """Initializes mpistrategy and pins this process to its local GPU."""
  import mpistrategy
  from mpistrategy import gpu
  mpistrategy.init()
  device = gpu.pin_to_local_gpu()
  return World(mpistrategy.rank(), mpistrategy.size(), device)
