"""mpistrategy: a drop-in `tf.distribute` strategy over MPI and NCCL.

```python
import mpistrategy
strategy = mpistrategy.MPIStrategy()      # mpirun -np N python train.py
with strategy.scope():
  model = ...
```

Process control (`init`, `shutdown`, `rank`, `size`, ...) and the collective
ops (`mpistrategy.ops`) can also be used without the strategy.
"""

from mpistrategy import ops
from mpistrategy.compression import Compression
from mpistrategy.ops.mpi_ops import current_options
from mpistrategy.ops.mpi_ops import init
from mpistrategy.ops.mpi_ops import is_initialized
from mpistrategy.ops.mpi_ops import local_rank
from mpistrategy.ops.mpi_ops import local_size
from mpistrategy.ops.mpi_ops import rank
from mpistrategy.ops.mpi_ops import shutdown
from mpistrategy.ops.mpi_ops import size
from mpistrategy.options import Options

__all__ = [
    "init", "shutdown", "is_initialized", "current_options", "rank", "size",
    "local_rank", "local_size", "Options", "ops", "MPIStrategy",
    "cross_device_ops", "Compression",
]


def __getattr__(name):
  # Imported lazily: the strategy pulls in tf.distribute internals that
  # users of the bare ops do not need.
  if name == "MPIStrategy":
    try:
      from mpistrategy.strategy import MPIStrategy  # pylint: disable=g-import-not-at-top
    except ModuleNotFoundError as e:
      # TODO(lead): remove once mpistrategy/strategy.py has landed.
      if e.name != "mpistrategy.strategy":
        raise
      raise AttributeError(
          "mpistrategy.MPIStrategy is not available in this build") from e
    return MPIStrategy
  if name == "cross_device_ops":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("mpistrategy.cross_device_ops")
  raise AttributeError(f"module 'mpistrategy' has no attribute {name!r}")
