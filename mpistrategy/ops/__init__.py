"""Collective ops over MPI: `mpistrategy.ops.allreduce` and friends.

```python
from mpistrategy import ops
total = ops.allreduce(tf.constant([1.0, 2.0]), op=ops.Sum)
rows = ops.allgather(tf.ones([mpistrategy.rank() + 1, 3]))
```

The op library (`_mpi_ops.so`) is loaded on first use.  The collectives are
in `collectives`, their gradients in `gradients` (registered by importing
this package), the rules that pair them across ranks in `_naming`; process
control (`init`, `rank`, ...) is re-exported from `mpistrategy.runtime`.
"""

from mpistrategy.ops.collectives import allgather
from mpistrategy.ops.collectives import allreduce
from mpistrategy.ops.collectives import alltoall
from mpistrategy.ops.collectives import Average
from mpistrategy.ops.collectives import barrier
from mpistrategy.ops.collectives import broadcast
from mpistrategy.ops.collectives import grouped_allreduce
from mpistrategy.ops.collectives import Max
from mpistrategy.ops.collectives import Mean
from mpistrategy.ops.collectives import Min
from mpistrategy.ops.collectives import Product
from mpistrategy.ops.collectives import reducescatter
from mpistrategy.ops.collectives import ReduceOp
from mpistrategy.ops.collectives import Sum
from mpistrategy.ops import gradients  # registers the gradients
from mpistrategy.runtime import built_with_cuda
from mpistrategy.runtime import built_with_nccl
from mpistrategy.runtime import current_options
from mpistrategy.runtime import init
from mpistrategy.runtime import is_initialized
from mpistrategy.runtime import local_rank
from mpistrategy.runtime import local_size
from mpistrategy.runtime import mpi_threads_supported
from mpistrategy.runtime import rank
from mpistrategy.runtime import shutdown
from mpistrategy.runtime import size
from mpistrategy.runtime import tuned_parameters
