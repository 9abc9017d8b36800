"""Gradient compression: 16-bit floats on the wire for wider float tensors.

```python
strategy = mpistrategy.MPIStrategy(compression=mpistrategy.Compression.fp16)
total = mpistrategy.ops.allreduce(t, op=mpistrategy.ops.Average,
                                  compression="bf16")
```

A compression is a `Compressor`:

* `compress(tensor) -> (wire_tensor, context)`: what travels between the
  ranks, and whatever `decompress` needs to undo it;
* `decompress(wire_tensor, context) -> tensor`: the reduced wire tensor,
  turned back into the caller's dtype;
* `compresses(dtype) -> bool`: whether `compress` changes tensors of that
  dtype (the ops use it to divide MEAN inputs first).

`Compression.fp16` and `Compression.bf16` cast float32 and float64 tensors to
float16 or bfloat16 and back; float16, bfloat16 and non-floating tensors
pass through unchanged.  Everywhere a compression is accepted, the strings
"none", "fp16" and "bf16" (and `None` for "none") work too; `get()` turns
them into the objects.

`MPIStrategy(compression=...)` compresses the reductions of
`ReplicaContext.all_reduce` and `extended.batch_reduce_to` (gradients,
synchronized batch-norm statistics), not `strategy.reduce` (metrics, Keras
logs, `SyncOnRead` reads), whose counters easily exceed 65504.

Numerics:

* The wire sum is done in the wire dtype: each element of the result is
  rounded to 11 significant bits (fp16, relative error up to about 5e-4) or
  8 (bf16, about 4e-3), at every step of the reduction.
* `MEAN` divides by the number of replicas *before* the cast, so the wire
  carries values of the mean's magnitude rather than the sum's: dividing
  after a float16 sum of N values would overflow N times sooner.  `SUM` is
  sent as is.
* float16 tops out at 65504.  A finite element whose magnitude is larger
  (after the MEAN division) becomes +-inf on the wire, and so does a partial
  sum that exceeds it: the result then holds inf where the uncompressed
  reduction would be finite.  Nothing clips or rescales these values; use
  `bf16` (float32's exponent range, less precision) when gradients can be
  this large.  Keras already divides each replica's loss by the number of
  replicas, so its gradient SUM is a mean in size.
* inf and nan survive the casts, so a non-finite value on any rank is
  non-finite in the result, exactly as without compression.  Keras'
  `LossScaleOptimizer` decides "finite or not" from every rank's local,
  scaled gradients (`mpistrategy.compat.keras`) before the all-reduce and
  then all-reduces the *unscaled* gradients, so loss scaling works
  unchanged.  Because that check comes first, an inf created by the float16
  wire itself (an unscaled gradient beyond 65504) is not caught by it and
  reaches the weights; use `bf16` if that can happen.
"""

import tensorflow as tf

__all__ = ["Compression", "Compressor", "get"]


class Compressor:
  """Base class of the compressions: the identity (`Compression.none`).

  Subclasses override `compresses`, `compress` and `decompress`.  A tensor
  for which `compresses(dtype)` is False must pass through `compress`
  unchanged (with `context` None).

  Args:
    name: the short name ("none", "fp16", ...), used in messages.
  """

  def __init__(self, name="none"):
    self.name = name

  def compresses(self, dtype):
    """Returns True when tensors of `dtype` change dtype on the wire.

    Args:
      dtype: a `tf.DType`.

    Returns:
      A bool.
    """
    del dtype
    return False

  def compress(self, tensor):
    """Returns `(wire_tensor, context)` for `tensor`.

    Args:
      tensor: a `tf.Tensor`.

    Returns:
      The tensor to send and the context `decompress` needs.
    """
    return tensor, None

  def decompress(self, tensor, context):
    """Undoes `compress` on the (reduced) wire tensor.

    Args:
      tensor: a `tf.Tensor` as received from the wire.
      context: what `compress` returned with it.

    Returns:
      A `tf.Tensor` in the dtype the caller passed to `compress`.
    """
    del context
    return tensor

  def __repr__(self):
    return f"mpistrategy.Compression.{self.name}"


class _CastCompressor(Compressor):
  """Casts float32/float64 tensors to a 16-bit float `wire_dtype` and back.

  Args:
    name: the short name ("fp16" or "bf16").
    wire_dtype: `tf.float16` or `tf.bfloat16`.
  """

  # Only these are wider than a 16-bit wire type.
  _WIDE_FLOATS = (tf.float32, tf.float64)

  def __init__(self, name, wire_dtype):
    super().__init__(name)
    self.wire_dtype = wire_dtype

  def compresses(self, dtype):
    return tf.as_dtype(dtype) in self._WIDE_FLOATS

  def compress(self, tensor):
    if not self.compresses(tensor.dtype):
      return tensor, None
    return tf.cast(tensor, self.wire_dtype), tensor.dtype

  def decompress(self, tensor, context):
    if context is None:
      return tensor
    return tf.cast(tensor, context)


class Compression:
  """The built-in compressions (like Horovod's `hvd.Compression`).

  * `Compression.none`: tensors travel in their own dtype (the default).
  * `Compression.fp16`: float32/float64 tensors travel as float16.
  * `Compression.bf16`: float32/float64 tensors travel as bfloat16.

  Example:

  ```python
  strategy = mpistrategy.MPIStrategy(compression=mpistrategy.Compression.fp16)
  # or, equivalently:
  strategy = mpistrategy.MPIStrategy(compression="fp16")
  ```
  """

  none = Compressor("none")
  fp16 = _CastCompressor("fp16", tf.float16)
  bf16 = _CastCompressor("bf16", tf.bfloat16)


_BY_NAME = {"none": Compression.none, "fp16": Compression.fp16,
            "bf16": Compression.bf16}


def get(compression, where="compression"):
  """Normalises a compression argument to a `Compressor`.

  Args:
    compression: `None` (no compression), one of the strings "none", "fp16",
      "bf16" (case-insensitive), or a `Compressor` such as
      `mpistrategy.Compression.fp16`.
    where: the caller, used in the error message.

  Returns:
    A `Compressor`.

  Raises:
    ValueError: `compression` is none of the accepted values.
  """
  if compression is None:
    return Compression.none
  if isinstance(compression, Compressor):
    return compression
  if isinstance(compression, str) and compression.lower() in _BY_NAME:
    return _BY_NAME[compression.lower()]
  raise ValueError(
      f"{where}: unknown compression {compression!r}; accepted: None, "
      "'none', 'fp16', 'bf16', mpistrategy.Compression.none, "
      "mpistrategy.Compression.fp16, mpistrategy.Compression.bf16 (or another "
      "mpistrategy.compression.Compressor)")
