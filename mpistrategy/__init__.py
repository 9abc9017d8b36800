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

import importlib

from mpistrategy import _output
from mpistrategy import version as _version
from mpistrategy.options import Options
from mpistrategy.version import __version__

# Under mpirun: whole output lines, and ranks other than 0 stay quiet (before
# anything here imports TensorFlow or warns; see mpistrategy/_output.py).
_output.setup_this_process()
_version.check_versions()

# Everything else is imported on first use (PEP 562), so that tools which do
# not run collectives (`python -m mpistrategy.run`, option parsing) start
# without loading TensorFlow.  name -> (module, attribute or None).
_LAZY = {
    "ops": ("mpistrategy.ops", None),
    "cross_device_ops": ("mpistrategy.cross_device_ops", None),
    "gpu": ("mpistrategy.gpu", None),
    "MPIStrategy": ("mpistrategy.strategy", "MPIStrategy"),
    "Compression": ("mpistrategy.compression", "Compression"),
    "init": ("mpistrategy.runtime", "init"),
    "shutdown": ("mpistrategy.runtime", "shutdown"),
    "is_initialized": ("mpistrategy.runtime", "is_initialized"),
    "current_options": ("mpistrategy.runtime", "current_options"),
    "collective_names": ("mpistrategy.ops._naming", "collective_names"),
    "start_timeline": ("mpistrategy.runtime", "start_timeline"),
    "stop_timeline": ("mpistrategy.runtime", "stop_timeline"),
    "rank": ("mpistrategy.runtime", "rank"),
    "size": ("mpistrategy.runtime", "size"),
    "local_rank": ("mpistrategy.runtime", "local_rank"),
    "local_size": ("mpistrategy.runtime", "local_size"),
}

__all__ = ["Options", "__version__"] + sorted(_LAZY)


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 'mpistrategy' has no attribute {name!r}")
  module_name, attribute = _LAZY[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value  # later lookups skip __getattr__
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
