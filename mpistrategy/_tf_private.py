"""Every private TensorFlow import used by mpistrategy, in one place.

`tf.distribute` exposes the extension points a strategy needs (the
`StrategyExtended` base classes, `CrossDeviceOps` helpers, the
`PerReplica`/`Mirrored` value types) only under `tensorflow.python`.
Keeping those imports here means a TensorFlow upgrade that moves one of them
breaks exactly one file, and the rest of the package reads as if it only used
public API.  The module re-exports modules, never copies of their contents, so
monkeypatches made by tests stay visible.

Verified against TensorFlow 2.21.0.
"""

# pylint: disable=unused-import,g-bad-import-order
from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.distribute import values_util
from tensorflow.python.distribute.cluster_resolver import cluster_resolver as cluster_resolver_lib
from tensorflow.python.eager import context
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
