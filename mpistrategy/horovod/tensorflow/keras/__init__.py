"""`import mpistrategy.horovod.tensorflow.keras as hvd`: Horovod's Keras API.

A drop-in for `import horovod.tensorflow.keras as hvd` with Keras 3:

```python
import mpistrategy.horovod.tensorflow.keras as hvd
hvd.init()
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
model.compile(optimizer=opt, loss=..., metrics=["accuracy"])
model.fit(dataset, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback()])
```

Process control (`init`, `rank`, ...), `DistributedOptimizer`,
`Compression`, the reduce ops and `callbacks` are those of
`mpistrategy.horovod.tensorflow`.  `allreduce`, `allgather`, `broadcast`
and `reducescatter` here take values and return numpy arrays, as Horovod's
Keras functions do.  `load_model` loads a Keras model and makes its
optimizer distributed.

Importing this module also lets `Model.compile` accept (and ignore)
`experimental_run_tf_function`, which Horovod's Keras scripts pass: Keras 3
always applies gradients through the (distributed) optimizer.
"""

import keras
import tensorflow as tf

from mpistrategy.horovod import tensorflow as _hvd
from mpistrategy import compat as _compat
from mpistrategy.horovod.tensorflow import gradients as _gradients
from mpistrategy.horovod.tensorflow.basics import ccl_built
from mpistrategy.horovod.tensorflow.basics import cross_rank
from mpistrategy.horovod.tensorflow.basics import cross_size
from mpistrategy.horovod.tensorflow.basics import cuda_built
from mpistrategy.horovod.tensorflow.basics import ddl_built
from mpistrategy.horovod.tensorflow.basics import global_process_set
from mpistrategy.horovod.tensorflow.basics import gloo_built
from mpistrategy.horovod.tensorflow.basics import gloo_enabled
from mpistrategy.horovod.tensorflow.basics import init
from mpistrategy.horovod.tensorflow.basics import is_homogeneous
from mpistrategy.horovod.tensorflow.basics import is_initialized
from mpistrategy.horovod.tensorflow.basics import local_rank
from mpistrategy.horovod.tensorflow.basics import local_size
from mpistrategy.horovod.tensorflow.basics import mpi_built
from mpistrategy.horovod.tensorflow.basics import mpi_enabled
from mpistrategy.horovod.tensorflow.basics import mpi_threads_supported
from mpistrategy.horovod.tensorflow.basics import nccl_built
from mpistrategy.horovod.tensorflow.basics import ProcessSet
from mpistrategy.horovod.tensorflow.basics import rank
from mpistrategy.horovod.tensorflow.basics import rocm_built
from mpistrategy.horovod.tensorflow.basics import shutdown
from mpistrategy.horovod.tensorflow.basics import size
from mpistrategy.horovod.tensorflow.basics import start_timeline
from mpistrategy.horovod.tensorflow.basics import stop_timeline
from mpistrategy.horovod.tensorflow.functions import Adasum
from mpistrategy.horovod.tensorflow.functions import Average
from mpistrategy.horovod.tensorflow.functions import Compression
from mpistrategy.horovod.tensorflow.functions import Max
from mpistrategy.horovod.tensorflow.functions import Min
from mpistrategy.horovod.tensorflow.functions import Product
from mpistrategy.horovod.tensorflow.functions import Sum
from mpistrategy.horovod.tensorflow.gradients import DistributedOptimizer
from mpistrategy.horovod.tensorflow.gradients import PartialDistributedOptimizer
from mpistrategy.horovod.tensorflow.keras import callbacks
from mpistrategy.horovod.tensorflow.unsupported import add_process_set
from mpistrategy.horovod.tensorflow.unsupported import (
    broadcast_global_variables)
from mpistrategy.horovod.tensorflow.unsupported import elastic
from mpistrategy.horovod.tensorflow.unsupported import remove_process_set
from mpistrategy.horovod.tensorflow.unsupported import SyncBatchNormalization


def allreduce(value, name=None, average=None, prescale_factor=1.0,
              postscale_factor=1.0, op=None, compression=Compression.none):
  """Reduces a value across ranks (default: average); returns numpy.

  See `mpistrategy.horovod.tensorflow.allreduce`.
  """
  return _hvd.allreduce(tf.constant(value), average=average, op=op,
                        prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, name=name,
                        compression=compression).numpy()


def allgather(value, name=None):
  """Concatenates every rank's value along dimension 0; returns numpy."""
  return _hvd.allgather(tf.constant(value), name=name).numpy()


def broadcast(value, root_rank, name=None):
  """Returns `root_rank`'s value on every rank, as numpy."""
  return _hvd.broadcast(tf.constant(value), root_rank, name=name).numpy()


def reducescatter(value, name=None, op=Average):
  """Reduces a value and keeps this rank's rows; returns numpy."""
  return _hvd.reducescatter(tf.constant(value), op=op, name=name).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
  """Loads a Keras model and makes its optimizer a `DistributedOptimizer`.

  Unlike `DistributedOptimizer`, the loaded optimizer keeps its state (its
  slots and iteration count); it averages gradients across ranks.

  Args:
    filepath: a `.keras` file (or anything `keras.models.load_model` reads).
    custom_optimizers: optimizer classes the file may name, besides Keras'.
    custom_objects: as for `keras.models.load_model`.
    compression: the gradient compression of the distributed optimizer.

  Returns:
    The loaded `keras.Model`.
  """
  objects = dict(custom_objects or {})
  for cls in custom_optimizers or ():
    objects[cls.__name__] = cls
  model = keras.models.load_model(filepath, custom_objects=objects)
  if getattr(model, "optimizer", None) is not None:
    _gradients.wrap_optimizer_in_place(model.optimizer, compression,
                                       "hvd.load_model")
  return model


_compat.install_for_horovod()
