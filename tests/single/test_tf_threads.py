"""mpistrategy._tf_threads: when TensorFlow's pools are sized per rank.

Runs in a fresh interpreter per case, because TensorFlow's pool sizes can
be set only before its runtime starts.
"""

import os
import subprocess
import sys

import pytest

_PROBE = r"""
import sys
import tensorflow as tf
from mpistrategy import _tf_threads
local_size, cpus, total, touch = (int(a) for a in sys.argv[1:5])
if touch:
  tf.constant(1.0) + 1.0  # starts the runtime
result = _tf_threads.share_cpus(local_size, cpus=cpus, total_cpus=total)
print(result, tf.config.threading.get_intra_op_parallelism_threads(),
      tf.config.threading.get_inter_op_parallelism_threads())
"""


def _probe(local_size, cpus, total, touch=False, env=None):
  full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    full_env.pop(name, None)
  full_env.update(env or {})
  out = subprocess.run(
      [sys.executable, "-P", "-c", _PROBE, str(local_size), str(cpus),
       str(total), str(int(touch))],
      env=full_env, capture_output=True, text=True, timeout=120, check=True)
  return out.stdout.split()[-3:]


@pytest.mark.parametrize("local_size,cpus,want", [(3, 16, "5"), (8, 4, "1")])
def test_unbound_ranks_get_their_share(local_size, cpus, want):
  assert _probe(local_size, cpus, cpus) == [want, want, want]


def test_alone_on_the_host_is_left_alone():
  assert _probe(1, 16, 16) == ["None", "0", "0"]


def test_bound_process_is_left_alone():
  # The launcher bound the rank to 4 of 16 CPUs: TF sizes by the mask.
  assert _probe(4, 4, 16) == ["None", "0", "0"]


def test_user_choice_wins():
  assert _probe(2, 16, 16, env={"TF_NUM_INTEROP_THREADS": "3"})[0] == "None"


def test_started_runtime_is_left_alone():
  assert _probe(2, 16, 16, touch=True) == ["None", "0", "0"]
