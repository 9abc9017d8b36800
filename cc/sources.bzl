"""Sources of the op library //cc:_mpi_ops.so, one list per Bazel target.

Read by the BUILD files and by setup.py (the pip route), so that the two
builds compile exactly the same files.  Keep this file to plain assignments
of string lists: setup.py parses it with Python's `ast`, without Bazel.
Paths are relative to the target's package; headers are listed too.
"""

# //cc/engine:common: types, config, autotuner, host reduction kernels.
ENGINE_COMMON_SRCS = [
    "autotuner.cc",
    "common.cc",
    "config.cc",
    "reduce_kernels.cc",
]

# //cc/engine:engine: negotiation, fusion, execution, timeline.
ENGINE_SRCS = [
    "engine.cc",
    "executor.cc",
    "executor.h",
    "fusion.cc",
    "logging.cc",
    "logging.h",
    "message.cc",
    "negotiator.cc",
    "peer_monitor.cc",
    "response_cache.cc",
    "stall_inspector.cc",
    "timeline.cc",
]

# //cc/transport:mpi_transport.
MPI_TRANSPORT_SRCS = [
    "mpi_transport.cc",
]

# //cc/transport:nccl_transport (--config=cuda / MPISTRATEGY_CUDA=1 only).
NCCL_TRANSPORT_SRCS = [
    "nccl_transport.cc",
]

# //cc:mpi_ops_kernels: op registrations, kernels and the C ABI.
KERNEL_SRCS = [
    "kernels/c_api.cc",
    "kernels/collective_kernels.cc",
    "kernels/engine_holder.cc",
    "kernels/tf_adapter.cc",
    "ops/mpi_ops.cc",
]

# //cc:mpi_ops_kernels with --config=cuda / MPISTRATEGY_CUDA=1.
KERNEL_GPU_SRCS = [
    "kernels/collective_kernels_gpu.cc",
]
