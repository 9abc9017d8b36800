"""Every private TensorFlow and Keras import used by mpistrategy, in one place.

`tf.distribute` exposes the extension points a strategy needs (the
`StrategyExtended` base classes, `CrossDeviceOps` helpers, the
`PerReplica`/`Mirrored` value types) only under `tensorflow.python`.
Keeping those imports here means a TensorFlow upgrade that moves one of them
breaks exactly one file, and the rest of the package reads as if it only used
public API.  The module re-exports modules, never copies of their contents, so
monkeypatches made by tests stay visible.

The Keras 3 internals that `mpistrategy.compat` patches are imported on
first use (`_tfp.keras_trainer`, ...; PEP 562), so that a process that never
touches Keras does not import it.

Verified against TensorFlow 2.21.0 and Keras 3.15.
"""

import importlib


from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import (
    cross_device_ops as cross_device_ops_lib)
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import mirrored_run
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.distribute import values_util
from tensorflow.python.distribute.cluster_resolver import (
    cluster_resolver as cluster_resolver_lib)
from tensorflow.python.distribute.failure_handling import failure_handling
from tensorflow.python.eager import context
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.saved_model import load as saved_model_load
from tensorflow.python.saved_model import save as saved_model_save
from tensorflow.python.trackable import base as trackable_base

CollectiveAllReduceExtended = (
    collective_all_reduce_strategy.CollectiveAllReduceExtended)
CollectiveAllReduceStrategy = (
    collective_all_reduce_strategy.CollectiveAllReduceStrategy)
MirroredExtended = mirrored_strategy.MirroredExtended
CrossDeviceOps = cross_device_ops_lib.CrossDeviceOps
CommunicationImplementation = collective_util.CommunicationImplementation
Options = collective_util.Options
ReduceOp = reduce_util.ReduceOp
PerReplica = values_lib.PerReplica
Mirrored = values_lib.Mirrored
DistributedValues = values_lib.DistributedValues
CheckpointInitialValue = trackable_base.CheckpointInitialValue
SimpleClusterResolver = cluster_resolver_lib.SimpleClusterResolver

# name -> Keras 3 module, imported by `__getattr__` on first use.
_KERAS_MODULES = {
    "keras_backup_and_restore": "keras.src.callbacks.backup_and_restore",
    "keras_batch_normalization":
        "keras.src.layers.normalization.batch_normalization",
    "keras_callback_list": "keras.src.callbacks.callback_list",
    "keras_csv_logger": "keras.src.callbacks.csv_logger",
    "keras_file_utils": "keras.src.utils.file_utils",
    "keras_io_utils": "keras.src.utils.io_utils",
    "keras_loss_scale_optimizer": "keras.src.optimizers.loss_scale_optimizer",
    "keras_model": "keras.src.models.model",
    "keras_model_checkpoint": "keras.src.callbacks.model_checkpoint",
    "keras_progbar_logger": "keras.src.callbacks.progbar_logger",
    "keras_saving_api": "keras.src.saving.saving_api",
    "keras_tensorboard": "keras.src.callbacks.tensorboard",
    "keras_tf_dataset_adapter":
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
    "keras_trainer": "keras.src.backend.tensorflow.trainer",
}


def __getattr__(name):
  if name not in _KERAS_MODULES:
    raise AttributeError(
        f"module 'mpistrategy._tf_private' has no attribute {name!r}")
  module = importlib.import_module(_KERAS_MODULES[name])
  globals()[name] = module  # later lookups skip __getattr__
  return module
