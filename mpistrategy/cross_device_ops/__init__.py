"""`tf.distribute.CrossDeviceOps` implementations for `MPIStrategy`.

* `MPIAllReduce`: MPI between processes (the default; CPU and GPU tensors).
* `NcclAllReduce`: NCCL between processes for GPU tensors (CUDA build only).
"""

from mpistrategy.cross_device_ops.mpi_all_reduce import MPIAllReduce
from mpistrategy.cross_device_ops.nccl_all_reduce import NcclAllReduce

__all__ = ["MPIAllReduce", "NcclAllReduce"]
