"""Sources of the op library //cc:_mpi_ops.so, one list per Bazel target.

Read by the BUILD files and by setup.py (the pip route), so that the two
builds compile exactly the same files.  Keep this file to plain assignments
of string lists: setup.py parses it with Python's `ast`, without Bazel.
Paths are relative to the target's package; headers are listed too.
"""

# //cc/common:common: types, logging, host reduction kernels.
COMMON_SRCS = [
    "common.cc",
    "logging.cc",
    "reduce_kernels.cc",
    "stream.cc",
    "streaming_copy.cc",
]

# //cc/common:mpi_checks.
COMMON_MPI_SRCS = [
    "checks_mpi.cc",
]

# //cc/common:cuda_checks (--config=cuda / MPISTRATEGY_CUDA=1 only).
COMMON_CUDA_SRCS = [
    "checks_cuda.cc",
]

# //cc/device:cuda_stream (--config=cuda / MPISTRATEGY_CUDA=1 only).
CUDA_STREAM_SRCS = [
    "cuda_stream.cc",
]

# //cc/engine:config: the engine's configuration (the one table that parses
# mpistrategy's options, and their range checks) and its autotuner.
ENGINE_CONFIG_SRCS = [
    "autotuner.cc",
    "config.cc",
]

# //cc/engine:config_c_api: the C ABI of //cc:_config.so, the TF-free
# library (mpistrategy/_config.so) through which Python validates options;
# linked with COMMON_SRCS and ENGINE_CONFIG_SRCS.
CONFIG_C_API_SRCS = [
    "config_c_api.cc",
]

# //cc/engine:engine: negotiation, fusion, execution, timeline.
ENGINE_SRCS = [
    "engine.cc",
    "executor.cc",
    "executor.h",
    "fusion.cc",
    "message.cc",
    "negotiator.cc",
    "peer_monitor.cc",
    "response_cache.cc",
    "stall_inspector.cc",
    "timeline.cc",
]

# //cc/transport:planes: the host, staging and hierarchical data planes.
PLANE_SRCS = [
    "hierarchical_plane.cc",
    "host_plane.cc",
    "staging_plane.cc",
]

# //cc/transport:mpi_transport.
MPI_TRANSPORT_SRCS = [
    "handoff_tuner.cc",
    "host_rendezvous.cc",
    "mpi_transport.cc",
    "shm_plane.cc",
]

# //cc/transport:nccl_plane (--config=cuda / MPISTRATEGY_CUDA=1 only).
NCCL_PLANE_SRCS = [
    "nccl_plane.cc",
]

# //cc:mpi_ops_kernels: op registrations, kernels and the C ABI.
KERNEL_SRCS = [
    "kernels/c_api.cc",
    "kernels/collective_kernels.cc",
    "kernels/collective_kernels.h",
    "kernels/engine_holder.cc",
    "kernels/tf_adapter.cc",
    "ops/mpi_ops.cc",
]

# //cc:mpi_ops_kernels with --config=cuda / MPISTRATEGY_CUDA=1.
KERNEL_GPU_SRCS = [
    "kernels/collective_kernels_gpu.cc",
]
