"""Gradient compression (mpistrategy.Compression) in one process.

    .venv/bin/python -m pytest tests/single/test_compression.py

Compress/decompress dtypes and values, the argument normalisation and its
errors, pass-through dtypes, and `ops.allreduce`/`grouped_allreduce` and
`MPIStrategy`/`MPIAllReduce` with compression in a world of size 1 (the
wire casts happen even with one process, so rounding is visible).
"""


import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import compression
from mpistrategy import ops
from mpistrategy.cross_device_ops import MPIAllReduce
from mpistrategy.cross_device_ops import NcclAllReduce
from mpistrategy.strategy import MPIStrategy

Compression = mpistrategy.Compression
WIDE = [tf.float32, tf.float64]
PASS_THROUGH = [tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8,
                tf.int8, tf.bool]
# 1 + 2**-12 has no float16 (or bfloat16) representation: it rounds to 1.
# 1 + 2**-9 is exact in float16 but rounds to 1 in bfloat16.
NOT_FP16 = 1.0 + 2.0**-12
NOT_BF16 = 1.0 + 2.0**-9


pytestmark = pytest.mark.usefixtures("single_process_engine")


def _ids(values):
  return [getattr(v, "name", str(v)) for v in values]


def run(mode, fn, *args):
  return fn(*args) if mode == "eager" else tf.function(fn)(*args)


# ---------------------------------------------------------------- the API


def test_exported_and_named():
  assert mpistrategy.Compression is compression.Compression
  assert "Compression" in mpistrategy.__all__
  assert [c.name for c in (Compression.none, Compression.fp16,
                           Compression.bf16)] == ["none", "fp16", "bf16"]
  assert repr(Compression.fp16) == "mpistrategy.Compression.fp16"
  assert Compression.fp16.wire_dtype == tf.float16
  assert Compression.bf16.wire_dtype == tf.bfloat16


@pytest.mark.parametrize("value,want", [
    (None, Compression.none), ("none", Compression.none),
    ("fp16", Compression.fp16), ("FP16", Compression.fp16),
    ("bf16", Compression.bf16), ("Bf16", Compression.bf16),
    (Compression.none, Compression.none), (Compression.fp16, Compression.fp16),
    (Compression.bf16, Compression.bf16)])
def test_get_normalises(value, want):
  assert compression.get(value) is want


@pytest.mark.parametrize("bad", ["fp8", "", "float16", 16, tf.float16, True,
                                 object()],
                         ids=lambda bad: type(bad).__name__ + ":" + (
                             "object" if type(bad) is object else str(bad)))
def test_get_rejects_with_a_clear_message(bad):
  with pytest.raises(ValueError) as e:
    compression.get(bad, "somewhere")
  message = str(e.value)
  assert message.startswith("somewhere: unknown compression")
  assert repr(bad) in message
  for accepted in ("'none'", "'fp16'", "'bf16'", "Compression.fp16"):
    assert accepted in message


@pytest.mark.parametrize("dtype", WIDE, ids=_ids(WIDE))
@pytest.mark.parametrize("comp,wire", [(Compression.fp16, tf.float16),
                                       (Compression.bf16, tf.bfloat16)],
                         ids=["fp16", "bf16"])
def test_compress_casts_wide_floats(comp, wire, dtype):
  x = tf.constant([NOT_FP16, NOT_BF16, -2.5, 0.0, 1e-3], dtype)
  assert comp.compresses(dtype)
  w, context = comp.compress(x)
  assert w.dtype == wire
  assert context == dtype
  back = comp.decompress(w, context)
  assert back.dtype == dtype
  want = x.numpy().astype(wire.as_numpy_dtype).astype(np.float64)
  np.testing.assert_array_equal(back.numpy().astype(np.float64), want)
  assert back.numpy()[0] == 1.0, "1 + 2**-12 must round to 1 on the wire"
  if comp is Compression.fp16:
    assert back.numpy()[1] == NOT_BF16
  else:
    assert back.numpy()[1] == 1.0


@pytest.mark.parametrize("dtype", PASS_THROUGH, ids=_ids(PASS_THROUGH))
@pytest.mark.parametrize("comp", [Compression.none, Compression.fp16,
                                  Compression.bf16], ids=["none", "fp16",
                                                          "bf16"])
def test_other_dtypes_pass_through(comp, dtype):
  x = tf.cast(tf.constant([0, 1, 3]), dtype)
  assert not comp.compresses(dtype)
  w, context = comp.compress(x)
  assert w is x and context is None
  assert comp.decompress(w, context) is x


@pytest.mark.parametrize("dtype", WIDE, ids=_ids(WIDE))
def test_none_passes_wide_floats_through(dtype):
  x = tf.constant([NOT_FP16], dtype)
  w, context = Compression.none.compress(x)
  assert w is x and Compression.none.decompress(w, context) is x


@pytest.mark.parametrize("comp", [Compression.fp16, Compression.bf16],
                         ids=["fp16", "bf16"])
def test_inf_and_nan_survive(comp):
  x = tf.constant([np.inf, -np.inf, np.nan, 1.0], tf.float32)
  back = comp.decompress(*comp.compress(x)).numpy()
  assert back[0] == np.inf and back[1] == -np.inf and np.isnan(back[2])
  assert back[3] == 1.0


def test_fp16_overflow_is_inf_bf16_is_not():
  """Documented: finite values beyond 65504 become inf with fp16 only."""
  x = tf.constant([65504.0, 1e5, -1e5, 3e38], tf.float32)
  fp16 = Compression.fp16.decompress(*Compression.fp16.compress(x)).numpy()
  np.testing.assert_array_equal(fp16, [65504.0, np.inf, -np.inf, np.inf])
  bf16 = Compression.bf16.decompress(*Compression.bf16.compress(x)).numpy()
  assert np.all(np.isfinite(bf16))
  np.testing.assert_allclose(bf16, x.numpy(), rtol=1e-2)


# ------------------------------------------------- ops with world size 1


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("op", [ops.Sum, ops.Average, ops.Min, ops.Max],
                         ids=lambda o: o.name)
@pytest.mark.parametrize("comp", ["fp16", "bf16", Compression.fp16],
                         ids=["fp16", "bf16", "Compression.fp16"])
def test_allreduce_rounds_on_the_wire(comp, op, mode):
  x = tf.constant([[NOT_FP16, NOT_BF16], [-3.0, 1024.5]], tf.float32)
  got = run(mode, lambda t: ops.allreduce(t, op=op, compression=comp), x)
  wire = compression.get(comp).wire_dtype.as_numpy_dtype
  assert got.dtype == tf.float32 and got.shape == x.shape
  np.testing.assert_array_equal(got.numpy(),
                                x.numpy().astype(wire).astype(np.float32))
  assert got.numpy()[0, 0] == 1.0


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_allreduce_float64_and_no_compression(mode):
  x = tf.constant([NOT_FP16], tf.float64)
  got = run(mode, lambda t: ops.allreduce(t, compression="fp16"), x)
  assert got.dtype == tf.float64 and got.numpy()[0] == 1.0
  for comp in (None, "none", Compression.none):
    exact = run(mode, lambda t, c=comp: ops.allreduce(t, compression=c), x)
    assert exact.numpy()[0] == NOT_FP16


@pytest.mark.parametrize("dtype", PASS_THROUGH[:-1], ids=_ids(
    PASS_THROUGH[:-1]))
def test_allreduce_pass_through_dtypes(dtype):
  x = tf.cast(tf.constant([1, 2, 3]), dtype)
  got = ops.allreduce(x, compression="fp16")
  assert got.dtype == dtype
  np.testing.assert_array_equal(got.numpy(), x.numpy())
  if dtype in (tf.float16, tf.bfloat16):
    mean = ops.allreduce(x, op=ops.Average, compression="bf16")
    assert mean.dtype == dtype


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_grouped_allreduce_with_compression(mode):
  xs = [tf.constant([NOT_FP16, 2.0], tf.float32),
        tf.constant([NOT_FP16], tf.float64),
        tf.constant([1.5], tf.float16),
        tf.constant([7], tf.int32)]

  def body(*ts):
    return (ops.grouped_allreduce(list(ts), compression="fp16"),
            ops.grouped_allreduce(list(ts[:3]), op=ops.Average,
                                  compression="fp16"))

  summed, mean = run(mode, body, *xs)
  assert [t.dtype for t in summed] == [x.dtype for x in xs]
  assert [t.dtype for t in mean] == [x.dtype for x in xs[:3]]
  np.testing.assert_array_equal(summed[0].numpy(), [1.0, 2.0])
  assert summed[1].numpy()[0] == 1.0
  assert summed[2].numpy()[0] == 1.5 and summed[3].numpy()[0] == 7
  np.testing.assert_array_equal(mean[0].numpy(), [1.0, 2.0])


def test_bad_compression_names_the_function():
  with pytest.raises(ValueError, match=r"ops\.allreduce: unknown compression "
                     r"'fp32'"):
    ops.allreduce(tf.constant([1.0]), compression="fp32")
  with pytest.raises(ValueError, match=r"ops\.grouped_allreduce: unknown "
                     r"compression 'x'"):
    ops.grouped_allreduce([tf.constant([1.0])], compression="x")


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("op", [ops.Sum, ops.Average], ids=["sum", "mean"])
def test_gradient_through_compressed_allreduce(op, mode):
  x = tf.constant([1.0, 2.0, 3.0])

  def body(t):
    with tf.GradientTape() as tape:
      tape.watch(t)
      y = tf.reduce_sum(ops.allreduce(t * 3.0, op=op, compression="fp16") *
                        tf.constant([1.0, NOT_FP16, -2.0]))
    return tape.gradient(y, t)

  grad = run(mode, body, x)
  assert grad.dtype == tf.float32
  # The upstream gradient [1, 1 + 2**-12, -2] crosses the float16 wire.
  np.testing.assert_array_equal(grad.numpy(), [3.0, 3.0, -6.0])


# ------------------------------------------- cross-device ops and strategy


def test_mpi_all_reduce_takes_compression():
  assert MPIAllReduce().compression is Compression.none
  assert MPIAllReduce(compression="bf16").compression is Compression.bf16
  assert MPIAllReduce(
      compression=Compression.fp16).compression is Compression.fp16
  with pytest.raises(ValueError, match="MPIAllReduce: unknown compression"):
    MPIAllReduce(compression="int8")


def test_nccl_all_reduce_takes_compression():
  assert issubclass(NcclAllReduce, MPIAllReduce)
  with pytest.raises(ValueError, match="NcclAllReduce: unknown compression"):
    NcclAllReduce(compression="fp12")
  if not tf.config.list_logical_devices("GPU"):
    with pytest.raises(ValueError, match="no GPU"):
      NcclAllReduce(compression="fp16")


def _cross_device_ops(strategy):
  return strategy.extended._cross_device_ops  # pylint: disable=protected-access


def test_strategy_compression_argument():
  s = MPIStrategy(compression="fp16")
  assert _cross_device_ops(s).compression is Compression.fp16
  cdo = MPIAllReduce(compression="bf16")
  assert _cross_device_ops(MPIStrategy(cross_device_ops=cdo)) is cdo
  s = MPIStrategy(cross_device_ops=cdo, compression=Compression.bf16)
  assert _cross_device_ops(s).compression is Compression.bf16
  assert _cross_device_ops(MPIStrategy()).compression is Compression.none


def test_strategy_rejects_conflicting_or_unknown_compression():
  with pytest.raises(ValueError, match=r"compression='fp16'\) differs from "
                     r"the compression of its cross_device_ops "
                     r"\(mpistrategy\.Compression\.bf16\)"):
    MPIStrategy(cross_device_ops=MPIAllReduce(compression="bf16"),
                compression="fp16")
  with pytest.raises(ValueError, match="differs"):
    MPIStrategy(cross_device_ops=MPIAllReduce(), compression="fp16")
  with pytest.raises(ValueError, match="MPIStrategy: unknown compression "
                     "'half'"):
    MPIStrategy(compression="half")


def test_strategy_with_compression_runs_and_reduces():
  strategy = MPIStrategy(compression="fp16")

  @tf.function
  def step():
    return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
        "SUM", tf.constant([NOT_FP16, 2.0])))

  got = strategy.experimental_local_results(step())[0]
  assert got.dtype == tf.float32
  # One replica: nothing crosses a wire, so nothing is rounded.
  np.testing.assert_array_equal(got.numpy(), [NOT_FP16, 2.0])
  total = strategy.reduce("SUM", tf.constant([NOT_FP16]), axis=None)
  assert total.numpy()[0] == NOT_FP16
