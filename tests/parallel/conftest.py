"""Fixtures shared by the per-rank tests (tests/parallel, under mpirun)."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops
from mpistrategy.strategy import MPIStrategy


@pytest.fixture(scope="module")
def strategy():
  return MPIStrategy()


@pytest.fixture()
def workdir(strategy, request):
  """One directory, the same path on every rank (rank 0 creates/cleans it)."""
  del strategy  # started first: the broadcast below needs the engine
  name = ops.broadcast(tf.constant(
      np.frombuffer(os.urandom(8), np.uint8)), root_rank=0).numpy()
  module = request.module.__name__.rsplit(".", 1)[-1]
  path = f"/tmp/mpistrategy-{module}-{name.tobytes().hex()}"
  if mpistrategy.rank() == 0:
    os.makedirs(path)
  ops.barrier()
  yield path
  ops.barrier()
  if mpistrategy.rank() == 0:
    shutil.rmtree(path, ignore_errors=True)
