"""`NcclAllReduce`: GPU all-reduce through the engine's NCCL transport."""

import tensorflow as tf

from mpistrategy import compression as compression_lib
from mpistrategy import runtime
from mpistrategy.cross_device_ops import mpi_all_reduce


class NcclAllReduce(mpi_all_reduce.MPIAllReduce):
  """All-reduces GPU tensors across MPI processes with NCCL.

  The Python side is identical to `MPIAllReduce`: one `mpistrategy.ops` op
  per tensor.  The C++ engine picks the NCCL transport for GPU tensors.  This
  needs GPU tensors and the CUDA build of `mpistrategy/ops/_mpi_ops.so`;
  until the GPU path lands, construction fails with a clear error instead of
  silently reducing over MPI.

  Example:

  ```python
  strategy = mpistrategy.MPIStrategy(
      cross_device_ops=mpistrategy.cross_device_ops.NcclAllReduce())
  ```

  Args:
    options: optional `tf.distribute.experimental.CommunicationOptions`.
    compression: optional `mpistrategy.Compression` member or "none"
      (default), "fp16", "bf16"; as for `MPIAllReduce`.

  Raises:
    ValueError: if no GPU is visible to this process, or `compression` is
      unknown.
    NotImplementedError: if the op library was built without CUDA.
  """

  def __init__(self, options=None, compression=None):  # pylint: disable=super-init-not-called
    # Checked first: a typo should not be reported as a missing GPU.
    compressor = compression_lib.get(compression, "NcclAllReduce")
    if not tf.config.list_logical_devices("GPU"):
      raise ValueError(
          "NcclAllReduce needs GPU tensors and the CUDA build of mpistrategy; "
          "no GPU is visible to this process. Use MPIAllReduce on CPUs.")
    from mpistrategy import ops
    if not getattr(ops, "built_with_cuda", lambda: False)():
      raise NotImplementedError(
          "NcclAllReduce needs GPU tensors and the CUDA build of "
          "mpistrategy/ops/_mpi_ops.so (bazel build --config=cuda); this "
          "build has no NCCL kernels.")
    if options is None:
      options = tf.distribute.experimental.CommunicationOptions()
    mpi_all_reduce.validate_communication_options(options, "NcclAllReduce")
    tf.distribute.CrossDeviceOps.__init__(self)
    self._options = options
    self._compression = compressor
    runtime.ensure_started()
    self._world_size = runtime.size()
