"""MPIStrategy in a world of size 1 (plain pytest, no mpirun).

The same script must run unchanged with and without mpirun; with one process
the strategy is a one-replica MultiWorkerMirroredStrategy and Keras takes its
local code paths.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
from mpistrategy.strategy import MPIStrategy


@pytest.fixture(scope="module")
def strategy():
  return MPIStrategy()


def test_world_of_one(strategy):
  assert mpistrategy.size() == 1 and mpistrategy.rank() == 0
  assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
  assert strategy.num_replicas_in_sync == 1
  assert not strategy.extended._in_multi_worker_mode()
  assert strategy.extended.should_checkpoint
  assert mpistrategy.MPIStrategy is MPIStrategy


def test_reduce_gather_run(strategy):
  assert strategy.reduce("SUM", tf.constant(3.0), axis=None).numpy() == 3.0
  per = strategy.run(lambda: tf.constant([1.0, 3.0]))
  assert strategy.reduce("MEAN", per, axis=0).numpy() == 2.0
  assert strategy.reduce("MEAN", strategy.run(lambda: tf.constant(5.0)),
                         axis=0).numpy() == 5.0
  g = strategy.gather(strategy.run(lambda: tf.ones([2, 3])), axis=0)
  assert g.shape == (2, 3)

  @tf.function
  def fn():
    return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
        "SUM", tf.constant(2, tf.int32)))
  assert fn().numpy() == 2


def test_fit_matches_default_strategy(strategy):
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  x, y = (x[:256] / 16.0).astype(np.float32), y[:256].astype(np.int32)

  def build():
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, "relu"),
                          keras.layers.Dense(10)])
    m.compile(optimizer=keras.optimizers.Adam(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], steps_per_execution=2)
    return m

  with strategy.scope():
    model = build()
  ref = build()
  ref.set_weights(model.get_weights())
  h = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  rh = ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  np.testing.assert_allclose(h.history["loss"], rh.history["loss"], rtol=1e-5)
  for a, b in zip(model.get_weights(), ref.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert model.predict(x[:40], verbose=0).shape == (40, 10)


def test_nccl_rejected_on_cpu():
  if tf.config.list_logical_devices("GPU"):
    pytest.skip("has a GPU")
  impl = tf.distribute.experimental.CommunicationImplementation.NCCL
  with pytest.raises(ValueError, match="GPU"):
    MPIStrategy(communication_options=(
        tf.distribute.experimental.CommunicationOptions(implementation=impl)))


def test_options_given_to_the_strategy_are_refused_with_the_way():
  with pytest.raises(TypeError, match=r"mpistrategy.init\(options\)"):
    MPIStrategy(mpistrategy.Options(timeline="t.json"))


def test_strategy_keeps_the_options_the_user_started_with(tmp_path):
  """`init(Options(...))` then `MPIStrategy()`: the strategy uses that engine.

  Run in a fresh interpreter: the engine's options are process-wide.
  """
  code = (
      "import mpistrategy\n"
      "mpistrategy.init(mpistrategy.Options(stall_timeout_seconds=600))\n"
      "strategy = mpistrategy.MPIStrategy()\n"
      "print('TIMEOUT', mpistrategy.current_options().stall_timeout_seconds)\n"
      "print('REPLICAS', strategy.num_replicas_in_sync)\n")
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "MPISTRATEGY_"))}
  out = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path,
                       env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"),
                       capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "TIMEOUT 600.0" in out.stdout and "REPLICAS 1" in out.stdout
