"""Checks that an op library registers the GPU kernels of the collectives.

Usage:
    python tests/check_gpu_kernels.py path/to/_mpi_ops.so

Loads the library with `tf.load_op_library` and reads TensorFlow's kernel
registry, so it needs no GPU (`make build-cuda` runs it on CPU machines).
Checks, for every op below, a DEVICE_GPU kernel whose `T` constraint covers
the expected dtypes and excludes int32 (TF keeps int32 in host memory), the
host-memory arguments of alltoall, and that the CPU kernels are still there.

Exit status: 0 when everything is registered, 1 otherwise, 2 for bad usage.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf
from tensorflow.python.framework import kernels

_REQUIRED = ("float16", "bfloat16", "float32", "float64", "int64")
_ALL = _REQUIRED + ("uint8", "int8", "bool")
_NUMERIC = _REQUIRED + ("uint8", "int8")

# op -> (dtypes its GPU kernel must accept, host-memory arguments)
EXPECTED = {
    "MpiStrategyAllreduce": (_ALL, ()),
    "MpiStrategyGroupedAllreduce": (_ALL, ()),
    "MpiStrategyAllgather": (_ALL, ()),
    "MpiStrategyBroadcast": (_ALL, ()),
    "MpiStrategyReducescatter": (_NUMERIC, ()),
    "MpiStrategyAlltoall": (_ALL, ("splits", "received_splits")),
}


def _type_constraint(kernel):
  for c in kernel.constraint:
    if c.name == "T":
      return sorted(tf.dtypes.as_dtype(t).name
                    for t in c.allowed_values.list.type)
  return None


def check(path):
  """Returns a list of problems (empty when the library is as expected)."""
  tf.load_op_library(os.path.abspath(path))
  problems = []
  for op, (dtypes, host_args) in EXPECTED.items():
    registered = kernels.get_registered_kernels_for_op(op).kernel
    gpu = [k for k in registered if k.device_type == "GPU"]
    cpu = [k for k in registered if k.device_type == "CPU"]
    if not cpu:
      problems.append(f"{op}: no CPU kernel")
    if len(gpu) != 1:
      problems.append(f"{op}: expected one GPU kernel, found {len(gpu)}")
      print(f"{op:30s} GPU: MISSING")
      continue
    allowed = _type_constraint(gpu[0])
    print(f"{op:30s} GPU: {allowed}"
          + (f" host memory: {sorted(gpu[0].host_memory_arg)}"
             if gpu[0].host_memory_arg else ""))
    if allowed is None:
      problems.append(f"{op}: the GPU kernel has no T constraint")
      continue
    missing = sorted(set(dtypes) - set(allowed))
    if missing:
      problems.append(f"{op}: the GPU kernel lacks dtypes {missing}")
    if "int32" in allowed:
      problems.append(f"{op}: int32 must not have a GPU kernel (TF keeps "
                      "int32 tensors in host memory)")
    missing_host = sorted(set(host_args) - set(gpu[0].host_memory_arg))
    if missing_host:
      problems.append(f"{op}: arguments {missing_host} must be host memory")
  return problems


def main(argv):
  if len(argv) != 2:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    return 2
  if not os.path.isfile(argv[1]):
    print(f"check_gpu_kernels: no such file: {argv[1]}", file=sys.stderr)
    return 2
  problems = check(argv[1])
  if problems:
    for p in problems:
      print(f"check_gpu_kernels: FAIL: {p}", file=sys.stderr)
    return 1
  print(f"check_gpu_kernels: OK: GPU kernels of {len(EXPECTED)} ops "
        f"registered in {argv[1]}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
