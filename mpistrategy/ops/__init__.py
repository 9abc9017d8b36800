"""Collective ops over MPI: `mpistrategy.ops.allreduce` and friends.

```python
from mpistrategy import ops
total = ops.allreduce(tf.constant([1.0, 2.0]), op=ops.Sum)
rows = ops.allgather(tf.ones([mpistrategy.rank() + 1, 3]))
```

The op library (`_mpi_ops.so`) is loaded on first use; see `mpi_ops` for
the naming rules that pair collectives across ranks.
"""

from mpistrategy.ops.mpi_ops import allgather
from mpistrategy.ops.mpi_ops import allreduce
from mpistrategy.ops.mpi_ops import alltoall
from mpistrategy.ops.mpi_ops import Average
from mpistrategy.ops.mpi_ops import barrier
from mpistrategy.ops.mpi_ops import broadcast
from mpistrategy.ops.mpi_ops import grouped_allreduce
from mpistrategy.ops.mpi_ops import Max
from mpistrategy.ops.mpi_ops import Mean
from mpistrategy.ops.mpi_ops import Min
from mpistrategy.ops.mpi_ops import Product
from mpistrategy.ops.mpi_ops import reducescatter
from mpistrategy.ops.mpi_ops import ReduceOp
from mpistrategy.ops.mpi_ops import Sum
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
