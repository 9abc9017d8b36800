"""Sizes TensorFlow's thread pools for the ranks that share a host.

TensorFlow sizes its intra-op and inter-op thread pools by the CPUs the
process may run on.  Under `mpirun --bind-to none` (what mpistrategy's
launcher passes where the ranks outnumber the CPUs or span several hosts,
and what many job scripts pass) every rank may run on all of the host's
CPUs, so N ranks on
one host start N times as many compute threads as there are cores, and those
threads also compete with the ranks' engine threads.  `mpistrategy.init()`
therefore gives each rank its share, `CPUs // local_size` threads per pool
(at least 1), the way `torchrun` sets `OMP_NUM_THREADS`.  Measured with
`bench/keras_step.py` on 2 ranks sharing 2 cores: MPIStrategy's step went
from 32-35 ms to 25.5-28.5 ms over six alternating runs.

It leaves TensorFlow alone when the user chose (`TF_NUM_INTRAOP_THREADS` or
`TF_NUM_INTEROP_THREADS` set, or `tf.config.threading` set before
`init()`), when the launcher bound the process to a subset of the CPUs
(TensorFlow then sizes its pools by that subset itself), when the rank is
alone on its host, and when TensorFlow's runtime already started (tensors
created before `init()`), where the pools can no longer change.
"""

import logging
import os

import tensorflow as tf

_ENV_OVERRIDES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")

_log = logging.getLogger("mpistrategy")


def share_cpus(local_size, cpus=None, total_cpus=None):
  """Sets TensorFlow's pools to this rank's share of the host's CPUs.

  Args:
    local_size: Number of ranks on this host.
    cpus: CPUs this process may run on (default: its affinity mask).
    total_cpus: CPUs of the host (default: `os.cpu_count()`).

  Returns:
    The threads per pool that were set, or None when TensorFlow was left
    alone (see the module docstring for when).
  """
  if local_size <= 1:
    return None
  if any(os.environ.get(name) for name in _ENV_OVERRIDES):
    return None
  threading = tf.config.threading
  if (threading.get_intra_op_parallelism_threads() or
      threading.get_inter_op_parallelism_threads()):
    return None
  if cpus is None:
    cpus = len(os.sched_getaffinity(0))
  if total_cpus is None:
    total_cpus = os.cpu_count() or cpus
  if cpus < total_cpus:
    return None  # bound by the launcher; TF sizes by the affinity mask
  share = max(1, cpus // local_size)
  try:
    threading.set_intra_op_parallelism_threads(share)
    threading.set_inter_op_parallelism_threads(share)
  except RuntimeError:
    # The runtime started before init(): its pools are fixed.
    _log.info("mpistrategy: TensorFlow already started, so its thread pools "
              "keep their size; %d ranks share this host's %d CPUs", local_size,
              cpus)
    return None
  _log.info("mpistrategy: %d ranks share this host's %d CPUs; TensorFlow "
            "uses %d intra-op and %d inter-op threads per rank (set "
            "TF_NUM_INTRAOP_THREADS/TF_NUM_INTEROP_THREADS to choose)",
            local_size, cpus, share, share)
  return share
