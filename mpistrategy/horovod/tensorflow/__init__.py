"""`import mpistrategy.horovod.tensorflow as hvd`: Horovod's TF2 API.

A drop-in for `import horovod.tensorflow as hvd` on TensorFlow 2.21 and
Keras 3, on mpistrategy's engine:

```python
import mpistrategy.horovod.tensorflow as hvd
hvd.init()
opt = tf.optimizers.Adam(0.001 * hvd.size())

@tf.function
def step(images, labels, first_batch):
  with tf.GradientTape() as tape:
    loss = loss_fn(labels, model(images, training=True))
  tape = hvd.DistributedGradientTape(tape)
  grads = tape.gradient(loss, model.trainable_variables)
  opt.apply_gradients(zip(grads, model.trainable_variables))
  if first_batch:
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables(), root_rank=0)
```

Run it with `mpirun -np N python train.py` or `python -m mpistrategy.run -np
N train.py`.  Semantics are Horovod's (e.g. `allreduce` averages by
default).  Not provided, each raising `NotImplementedError` that says what
to use instead: Adasum, process sets other than the global one, `join`,
elastic training, `SyncBatchNormalization`, run-time timeline control,
device arguments, TF1 optimizers and `broadcast_global_variables`.  See
docs/HOROVOD.md.

Importing this module makes Keras 3 optimizers' `variables` callable as
well (`opt.variables()`, the Keras 2 spelling Horovod scripts use); see
`mpistrategy.compat.keras2_spellings`.
"""

from mpistrategy import compat as _compat
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
from mpistrategy.horovod.tensorflow.basics import local_rank_op
from mpistrategy.horovod.tensorflow.basics import local_size
from mpistrategy.horovod.tensorflow.basics import local_size_op
from mpistrategy.horovod.tensorflow.basics import mpi_built
from mpistrategy.horovod.tensorflow.basics import mpi_enabled
from mpistrategy.horovod.tensorflow.basics import mpi_threads_supported
from mpistrategy.horovod.tensorflow.basics import nccl_built
from mpistrategy.horovod.tensorflow.basics import process_set_included_op
from mpistrategy.horovod.tensorflow.basics import ProcessSet
from mpistrategy.horovod.tensorflow.basics import rank
from mpistrategy.horovod.tensorflow.basics import rank_op
from mpistrategy.horovod.tensorflow.basics import rocm_built
from mpistrategy.horovod.tensorflow.basics import shutdown
from mpistrategy.horovod.tensorflow.basics import size
from mpistrategy.horovod.tensorflow.basics import size_op
from mpistrategy.horovod.tensorflow.basics import start_timeline
from mpistrategy.horovod.tensorflow.basics import stop_timeline
from mpistrategy.horovod.tensorflow.functions import Adasum
from mpistrategy.horovod.tensorflow.functions import allgather
from mpistrategy.horovod.tensorflow.functions import allgather_object
from mpistrategy.horovod.tensorflow.functions import allreduce
from mpistrategy.horovod.tensorflow.functions import alltoall
from mpistrategy.horovod.tensorflow.functions import Average
from mpistrategy.horovod.tensorflow.functions import barrier
from mpistrategy.horovod.tensorflow.functions import broadcast
from mpistrategy.horovod.tensorflow.functions import broadcast_
from mpistrategy.horovod.tensorflow.functions import broadcast_object
from mpistrategy.horovod.tensorflow.functions import broadcast_object_fn
from mpistrategy.horovod.tensorflow.functions import broadcast_variables
from mpistrategy.horovod.tensorflow.functions import Compression
from mpistrategy.horovod.tensorflow.functions import Compressor
from mpistrategy.horovod.tensorflow.functions import FP16Compressor
from mpistrategy.horovod.tensorflow.functions import grouped_allgather
from mpistrategy.horovod.tensorflow.functions import grouped_allreduce
from mpistrategy.horovod.tensorflow.functions import grouped_reducescatter
from mpistrategy.horovod.tensorflow.functions import join
from mpistrategy.horovod.tensorflow.functions import Max
from mpistrategy.horovod.tensorflow.functions import Min
from mpistrategy.horovod.tensorflow.functions import NoneCompressor
from mpistrategy.horovod.tensorflow.functions import Product
from mpistrategy.horovod.tensorflow.functions import reducescatter
from mpistrategy.horovod.tensorflow.functions import Sum
from mpistrategy.horovod.tensorflow.gradients import DistributedGradientTape
from mpistrategy.horovod.tensorflow.gradients import DistributedOptimizer
from mpistrategy.horovod.tensorflow.gradients import (
    PartialDistributedGradientTape)
from mpistrategy.horovod.tensorflow.gradients import PartialDistributedOptimizer
from mpistrategy.horovod.tensorflow.unsupported import add_process_set
from mpistrategy.horovod.tensorflow.unsupported import (
    broadcast_global_variables)
from mpistrategy.horovod.tensorflow.unsupported import (
    BroadcastGlobalVariablesHook)
from mpistrategy.horovod.tensorflow.unsupported import elastic
from mpistrategy.horovod.tensorflow.unsupported import remove_process_set
from mpistrategy.horovod.tensorflow.unsupported import SyncBatchNormalization

_compat.install_for_horovod()
