"""Horovod's TensorFlow API on mpistrategy: a one-line migration.

Scripts written for Horovod change only their import line:

```python
import mpistrategy.horovod.tensorflow as hvd          # was horovod.tensorflow
import mpistrategy.horovod.tensorflow.keras as hvd    # was ...tensorflow.keras
```

and run under `mpirun -np N python train.py` (or `python -m mpistrategy.run`)
instead of `horovodrun`.  The functions follow Horovod's semantics (e.g.
`allreduce` averages by default) on top of `mpistrategy.ops`; see
docs/HOROVOD.md for the API map, the differences and what is not provided.

`mpistrategy.horovod` itself only holds `run`, which is not provided (as
`horovod.run`, it would start the processes itself).  Importing it makes
Horovod's tuning variables (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME,
...; `mpistrategy.options.HOROVOD_VARIABLES`) count as options for every
start of the engine, by `hvd.init()` or by an `MPIStrategy` created first;
`MPISTRATEGY_*` variables win over them.
"""

from mpistrategy import options as _options

__all__ = ["run"]

_options.count_horovod_variables()


def run(*args, **kwargs):
  """Not provided: Horovod's programmatic launcher (`horovod.run`).

  Raises:
    NotImplementedError: always.  Start the script with `mpirun -np N python
      script.py` or `python -m mpistrategy.run -np N script.py` instead.
  """
  del args, kwargs
  raise NotImplementedError(
      "mpistrategy.horovod.run (horovod.run) is not provided: mpistrategy "
      "does not spawn workers from inside Python.  Start the script with "
      "`mpirun -np N python script.py` or `python -m mpistrategy.run -np N "
      "script.py` and call the training function directly")
