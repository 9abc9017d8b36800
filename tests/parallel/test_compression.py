"""Gradient compression across ranks (collective-symmetric).

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_compression.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_compression.py

Every rank runs every test in the same order.  Inputs are derived from the
rank, so each rank can compute the float64 reference of all ranks itself.
"""

import hashlib

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
from mpistrategy import ops
from mpistrategy.cross_device_ops import mpi_all_reduce
from mpistrategy.strategy import MPIStrategy

R = mpistrategy.rank()
N = mpistrategy.size()
Compression = mpistrategy.Compression
MODES = ["eager", "function"]
# Unit roundoff of the wire dtypes.
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}
WIRE = {"fp16": np.float16, "bf16": tf.bfloat16.as_numpy_dtype}
# 1 + 2**-12 rounds to 1 in float16 and bfloat16; 1 + 2**-9 is exact in
# float16 and rounds to 1 in bfloat16.
NOT_REPRESENTABLE = {"fp16": 1.0 + 2.0**-12, "bf16": 1.0 + 2.0**-9}

needs_peers = pytest.mark.skipif(N < 2, reason="needs at least 2 ranks")


def run(mode, fn, *args):
  return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def _inputs(rank, positive, dtype=np.float32):
  rng = np.random.RandomState(100 + rank)
  x = rng.uniform(-4.0, 4.0, size=[257]).astype(dtype)
  return np.abs(x) + 1.0 if positive else x


def _ranks_differing_from_0(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  mine = np.frombuffer(h.digest(), np.uint8)
  everyone = ops.allgather(tf.constant(mine[None, :])).numpy()
  return [r for r in range(N) if not np.array_equal(everyone[r], everyone[0])]


# -------------------------------------------------------------------- ops


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [ops.Sum, ops.Average], ids=["sum", "mean"])
@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_allreduce_matches_float32_within_wire_precision(comp, op, mode):
  got = run(mode, lambda t: ops.allreduce(t, op=op, compression=comp),
            tf.constant(_inputs(R, positive=True)))
  terms = np.stack([_inputs(r, positive=True) for r in range(N)])
  want = terms.astype(np.float64).sum(axis=0)
  if op == ops.Average:
    want /= N
  assert got.dtype == tf.float32
  # Each of the N casts and N - 1 additions rounds once: <= 2N unit
  # roundoffs (about 1e-3 for fp16, 1e-2 for bf16).
  np.testing.assert_allclose(got.numpy(), want, rtol=2 * N * UNIT[comp])
  exact = ops.allreduce(tf.constant(_inputs(R, positive=True)), op=op)
  assert not np.array_equal(got.numpy(), exact.numpy()), (
      "compressed result equals the float32 one: nothing was compressed")
  assert not _ranks_differing_from_0([got.numpy()])


@pytest.mark.parametrize("op", [ops.Sum, ops.Average], ids=["sum", "mean"])
@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_allreduce_with_cancellation(comp, op):
  """Mixed signs: the error bound scales with sum |x_r|, not the result."""
  got = ops.allreduce(tf.constant(_inputs(R, positive=False)), op=op,
                      compression=comp)
  terms = np.stack([_inputs(r, positive=False) for r in range(N)]).astype(
      np.float64)
  want, scale = terms.sum(axis=0), np.abs(terms).sum(axis=0)
  if op == ops.Average:
    want, scale = want / N, scale / N
  err = np.abs(got.numpy().astype(np.float64) - want)
  assert np.all(err <= 2 * N * UNIT[comp] * scale), np.max(err / scale)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_the_wire_is_16_bit(comp, mode):
  """Values the wire dtype cannot hold come back rounded (exactly)."""
  v = NOT_REPRESENTABLE[comp]

  def body(one, many):
    return (ops.allreduce(one, op=ops.Sum, compression=comp),
            ops.allreduce(many, op=ops.Average, compression=comp),
            ops.allreduce(one, op=ops.Sum))

  # MEAN divides first: N * v / N is exactly v in float32, which rounds to 1.
  summed, mean, exact = run(mode, body, tf.constant([v], tf.float32),
                            tf.constant([N * v], tf.float32))
  assert summed.dtype == tf.float32 and mean.dtype == tf.float32
  assert summed.numpy()[0] == float(N)
  assert mean.numpy()[0] == float(N)
  assert exact.numpy()[0] == np.float32(N * v) != float(N)


def test_fp16_keeps_bf16_representable_values():
  v = NOT_REPRESENTABLE["bf16"]  # exact in float16, also summed N times
  got = ops.allreduce(tf.constant([v]), compression="fp16")
  assert got.numpy()[0] == np.float32(N * v)


@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_float64_and_pass_through_dtypes(comp):
  x64 = tf.constant([NOT_REPRESENTABLE[comp]], tf.float64)
  got = ops.allreduce(x64, compression=comp)
  assert got.dtype == tf.float64 and got.numpy()[0] == float(N)
  for dtype in (tf.float16, tf.bfloat16, tf.int32, tf.int64):
    x = tf.cast(tf.constant([R + 1]), dtype)
    got = ops.allreduce(x, compression=comp)
    assert got.dtype == dtype
    assert float(got.numpy()[0]) == N * (N + 1) / 2


@needs_peers
def test_mean_divides_before_the_cast():
  """N ranks of 40000: the float16 SUM overflows, the MEAN does not."""
  x = tf.constant([40000.0])
  mean = ops.allreduce(x, op=ops.Average, compression="fp16").numpy()[0]
  np.testing.assert_allclose(mean, 40000.0, rtol=2 * N * UNIT["fp16"])
  summed = ops.allreduce(x, op=ops.Sum, compression="fp16").numpy()[0]
  assert summed == np.inf  # documented: beyond 65504 is inf


@needs_peers
@pytest.mark.parametrize("comp", ["fp16", "bf16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=str)
def test_one_rank_non_finite_is_non_finite_everywhere(comp, bad):
  """What a loss-scale finiteness check needs: inf/nan survive the wire."""
  x = np.ones([4], np.float32)
  if R == N - 1:
    x[2] = bad
  for op in (ops.Sum, ops.Average):
    got = ops.allreduce(tf.constant(x), op=op, compression=comp).numpy()
    assert np.all(np.isfinite(got[[0, 1, 3]]))
    if np.isnan(bad):
      assert np.isnan(got[2])
    else:
      assert got[2] == bad


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_with_compression(mode):
  v = NOT_REPRESENTABLE["fp16"]
  xs = [tf.constant([v, R + 1.0], tf.float32), tf.constant([v], tf.float64),
        tf.constant([R + 1.0], tf.float16), tf.constant([R + 1], tf.int64)]

  def body(*ts):
    return (ops.grouped_allreduce(list(ts), compression="fp16"),
            ops.grouped_allreduce([ts[0] * N, ts[2]], op=ops.Average,
                                  compression="fp16"))

  summed, mean = run(mode, body, *xs)
  s = N * (N + 1) / 2
  assert [t.dtype for t in summed] == [x.dtype for x in xs]
  np.testing.assert_array_equal(summed[0].numpy(), [N, s])
  assert summed[1].numpy()[0] == N
  assert summed[2].numpy()[0] == s and summed[3].numpy()[0] == s
  assert mean[0].dtype == tf.float32 and mean[1].dtype == tf.float16
  assert mean[0].numpy()[0] == N  # N * v / N = v rounds to 1 on the wire
  np.testing.assert_allclose(mean[0].numpy()[1], N * s / N, rtol=1e-3)
  np.testing.assert_allclose(float(mean[1].numpy()[0]), s / N,
                             rtol=2 * N * UNIT["fp16"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [ops.Sum, ops.Average], ids=["sum", "mean"])
def test_gradient_of_compressed_allreduce(op, mode):
  x = tf.constant([1.0, 2.0, 3.0]) * (R + 1)

  def body(t):
    with tf.GradientTape() as tape:
      tape.watch(t)
      y = ops.allreduce(t, op=op, compression="fp16")
      loss = tf.reduce_sum(y * tf.constant([1.0, 2.0, -0.5]))
    return y, tape.gradient(loss, t)

  y, grad = run(mode, body, x)
  s = N * (N + 1) / 2
  want_y = np.array([1.0, 2.0, 3.0]) * (s if op == ops.Sum else s / N)
  np.testing.assert_allclose(y.numpy(), want_y, rtol=4 * N * UNIT["fp16"])
  # d(sum over ranks of loss)/dx: every rank's upstream gradient, summed
  # (SUM) or averaged (MEAN).
  want_grad = np.array([1.0, 2.0, -0.5]) * (N if op == ops.Sum else 1.0)
  assert grad.dtype == tf.float32
  np.testing.assert_array_equal(grad.numpy(), want_grad)


@needs_peers
def test_ranks_disagreeing_on_compression_fail_everywhere():
  comp = "fp16" if R == 0 else None
  with pytest.raises(tf.errors.FailedPreconditionError) as info:
    ops.allreduce(tf.ones([3]), compression=comp, name="compression/mismatch")
  assert "compression/mismatch" in str(info.value)
  assert "do all ranks use the same compression?" in str(info.value)
  y = ops.allreduce(tf.ones([3]), compression="fp16", name="compression/ok")
  np.testing.assert_array_equal(y.numpy(), [N, N, N])


# --------------------------------------------------------------- strategy


@pytest.fixture(scope="module")
def fp16_strategy():
  return MPIStrategy(compression="fp16")


def test_strategy_run_all_reduce_is_compressed(fp16_strategy):
  strategy = fp16_strategy
  v = NOT_REPRESENTABLE["fp16"]

  @tf.function
  def step():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      dense_sum = ctx.all_reduce("SUM", tf.constant([v, R + 1.0]))
      dense_mean = ctx.all_reduce("MEAN", tf.constant([N * v]))
      sparse = ctx.all_reduce("SUM", tf.IndexedSlices(
          tf.constant([[v]]), tf.constant([R]), tf.constant([N, 1])))
      ints = ctx.all_reduce("SUM", tf.constant([R + 1]))
      return dense_sum, dense_mean, tf.convert_to_tensor(sparse), ints
    return strategy.run(replica_fn)

  dense_sum, dense_mean, sparse, ints = [
      strategy.experimental_local_results(t)[0] for t in step()]
  s = N * (N + 1) / 2
  assert dense_sum.dtype == tf.float32 and dense_mean.dtype == tf.float32
  np.testing.assert_array_equal(dense_sum.numpy(), [N, s])
  assert dense_mean.numpy()[0] == N
  assert sparse.dtype == tf.float32
  np.testing.assert_array_equal(sparse.numpy(), np.ones([N, 1]))
  assert ints.dtype == tf.int32 and ints.numpy()[0] == s


def test_strategy_batch_reduce_is_compressed(fp16_strategy):
  strategy = fp16_strategy
  v = NOT_REPRESENTABLE["fp16"]
  per = strategy.run(lambda: tf.constant([v]))
  (summed,) = strategy.extended.batch_reduce_to("SUM", [(per, per)])
  got = strategy.experimental_local_results(summed)[0]
  assert got.dtype == tf.float32 and got.numpy()[0] == N


def test_strategy_reduce_stays_exact(fp16_strategy):
  """`strategy.reduce` (metrics, logs, SyncOnRead reads) is not compressed."""
  strategy = fp16_strategy
  v = NOT_REPRESENTABLE["fp16"]
  per = strategy.run(lambda: tf.constant([v]))
  total = strategy.reduce("SUM", per, axis=None)
  assert total.numpy()[0] == np.float32(N * v)
  mean = strategy.reduce("MEAN", strategy.run(lambda: tf.constant(1e5)),
                         axis=None)
  assert mean.numpy() == 1e5  # would be inf through a float16 wire


def test_strategy_conflicting_compression_is_rejected():
  with pytest.raises(ValueError, match="differs"):
    MPIStrategy(cross_device_ops=mpi_all_reduce.MPIAllReduce(
        compression="bf16"), compression="fp16")


# ------------------------------------------------------------------ Keras


N_SAMPLES = 384  # divisible by the global batch at np 1, 2, 3
PER_REPLICA_BATCH = 32


@pytest.fixture(scope="module")
def digits():
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  x = (x[:N_SAMPLES] / 16.0).astype(np.float32)
  return x, y[:N_SAMPLES].astype(np.int32)


def _mlp():
  return keras.Sequential([keras.Input((64,)),
                           keras.layers.Dense(32, activation="relu"),
                           keras.layers.Dense(10)])


def _compile(model, spe=1):
  model.compile(
      optimizer=keras.optimizers.Adam(0.01),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], steps_per_execution=spe)


class _Spy:
  """Stands in for `mpistrategy.ops` in the cross-device ops; records calls."""

  def __init__(self):
    self.calls = []

  def __getattr__(self, name):
    return getattr(ops, name)

  def allreduce(self, tensor, **kwargs):
    self.calls.append((tensor.dtype, kwargs.get("compression")))
    return ops.allreduce(tensor, **kwargs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_keras_fit_is_identical_on_every_rank(comp, digits, monkeypatch):
  x, y = digits
  spy = _Spy()
  monkeypatch.setattr(mpi_all_reduce, "_ops", lambda: spy)
  strategy = MPIStrategy(compression=comp)
  gbs = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
  keras.utils.set_random_seed(7 + 13 * R)  # weights agree only by broadcast
  with strategy.scope():
    model = _mlp()
    _compile(model, spe=2)
  hist = model.fit(x, y, batch_size=gbs, epochs=2, shuffle=False, verbose=0)
  state = ([v.numpy() for v in model.weights] +
           [v.numpy() for v in model.optimizer.variables])
  assert not _ranks_differing_from_0(state), "weights or optimizer state differ"
  assert np.all(np.isfinite(hist.history["loss"]))
  assert hist.history["loss"][-1] < hist.history["loss"][0]
  if N > 1:
    # The gradients went through the compressed path (logs and metrics go
    # through `strategy.reduce`, uncompressed).
    compressed = [d for d, c in spy.calls
                  if c is mpistrategy.compression.get(comp)]
    assert len(compressed) >= len(model.trainable_weights), spy.calls
    assert set(compressed) == {tf.float32}, spy.calls


@needs_peers
@pytest.mark.timeout(300)
def test_keras_loss_scaling_skips_on_every_rank(digits):
  """mixed_float16 + fp16 wire: one rank overflows, every rank skips."""
  x, y = digits
  strategy = MPIStrategy(compression="fp16")
  gbs = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
  n = 2 * gbs
  xs = x[:n].copy()
  for start in range(0, n, gbs):  # rank 1's shard of every batch overflows
    xs[start + PER_REPLICA_BATCH:start + 2 * PER_REPLICA_BATCH] *= 1e4
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    with strategy.scope():
      model = _mlp()
      _compile(model)
    model.fit(xs, y[:n], batch_size=gbs, epochs=1, shuffle=False, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  opt = model.optimizer
  assert int(opt.inner_optimizer.iterations.numpy()) == 0
  assert float(opt.dynamic_scale.numpy()) < 2.0**15
  assert all(np.all(np.isfinite(w.numpy())) for w in model.weights)
  assert not _ranks_differing_from_0([w.numpy() for w in model.weights])
