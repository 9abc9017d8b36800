"""GPU placement: one GPU per process, chosen by the local rank.

With several GPUs per host, each process should drive its own: NCCL needs a
GPU per rank, and TensorFlow would otherwise place every process's ops on
GPU:0.  `pin_to_local_gpu()` makes GPU `local_rank % n_gpus` the only GPU
this process's TensorFlow sees (`tf.config.set_visible_devices`).  It must
run before TensorFlow initializes its GPUs (before the first GPU op, or
`tf.config.list_logical_devices`).

When more processes than GPUs share a host, several processes share a GPU;
mpistrategy then runs GPU collectives over MPI with host staging (NCCL
refuses several ranks per GPU), and memory growth is enabled so that the
processes do not each reserve the whole GPU.

Example:

```python
import mpistrategy
from mpistrategy import gpu

mpistrategy.init()
gpu.pin_to_local_gpu()
```
"""

import warnings

import tensorflow as tf


def pin_to_local_gpu(local_rank=None, local_size=None, memory_growth=None):
  """Makes GPU `local_rank % n_gpus` the only GPU TensorFlow uses.

  Args:
    local_rank: This process's rank among the processes on its host; None
      asks mpistrategy (`mpistrategy.local_rank()`, which initializes
      mpistrategy if needed).
    local_size: The number of processes on this host; None asks mpistrategy.
    memory_growth: Whether TensorFlow allocates GPU memory as needed instead
      of reserving (nearly) all of it up front.  None (the default) enables
      it only when processes share a GPU (`local_size > n_gpus`).

  Returns:
    The `tf.config.PhysicalDevice` this process now uses, or None when it
    sees no GPU, or when TensorFlow had already initialized its GPUs with a
    different selection (a warning says so and nothing changes).

  Raises:
    TypeError: `local_rank` or `local_size` is not an int.
    ValueError: `local_rank` is negative or `local_size` is not positive.
  """
  gpus = tf.config.list_physical_devices("GPU")
  if not gpus:
    return None
  if local_rank is None or local_size is None:
    from mpistrategy import runtime
    if local_rank is None:
      local_rank = runtime.local_rank()
    if local_size is None:
      local_size = runtime.local_size()
  for name, value in (("local_rank", local_rank), ("local_size", local_size)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"pin_to_local_gpu: {name} must be an int, got "
                      f"{type(value).__name__} {value!r}")
  if local_rank < 0:
    raise ValueError(
        f"pin_to_local_gpu: local_rank must be >= 0, got {local_rank}")
  if local_size < 1:
    raise ValueError(
        f"pin_to_local_gpu: local_size must be >= 1, got {local_size}")
  chosen = gpus[local_rank % len(gpus)]
  if memory_growth is None:
    memory_growth = local_size > len(gpus)
  try:
    tf.config.set_visible_devices([chosen], "GPU")
    if memory_growth:
      tf.config.experimental.set_memory_growth(chosen, True)
  except RuntimeError as e:
    # TensorFlow has already created its GPU devices.
    visible = tf.config.get_visible_devices("GPU")
    if visible == [chosen]:
      return chosen
    warnings.warn(
        f"mpistrategy.gpu.pin_to_local_gpu: TensorFlow already initialized "
        f"its GPUs ({e}); local rank {local_rank} keeps "
        f"{[d.name for d in visible]} instead of {chosen.name}. Call it "
        "before any GPU work.", RuntimeWarning, stacklevel=2)
    return None
  return chosen
