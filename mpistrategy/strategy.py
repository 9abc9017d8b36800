"""`MPIStrategy`: a drop-in `tf.distribute` strategy over MPI.

The strategy is a `tf.distribute.MultiWorkerMirroredStrategy` (Keras 3 keys
its multi-worker code paths on that `isinstance`) whose constructor is
replaced: no `TF_CONFIG`, no gRPC server, no collective executor.  The MPI
world (`mpirun -np N`) is the cluster, every process is one worker with one
local device, and every cross-process reduction goes through a
`mpistrategy.cross_device_ops.MPIAllReduce`.

Everything else -- `MirroredVariable`/`SyncOnReadVariable` creation, dataset
auto-sharding by `InputContext`, the cross-worker end-of-data sync, chief-only
`should_checkpoint`, replica ids -- is inherited unchanged from
`CollectiveAllReduceExtended` (see ../shared/TF-INTEGRATION-NOTES.md §2),
except that a CPU rank reads its input through a plain iterator instead of
TF's multi-device one (`MPIExtended._plain_iterator_options` says why).
"""

import copy
import random
import sys
import weakref

import numpy as np
import tensorflow as tf

from mpistrategy import _tf_private as _tfp
from mpistrategy import compat
from mpistrategy import compression as compression_lib
from mpistrategy import gpu
from mpistrategy import options as options_lib
from mpistrategy import runtime
from mpistrategy.cross_device_ops import mpi_all_reduce
from mpistrategy.cross_device_ops import nccl_all_reduce

# Dtypes the engine can broadcast.  Other fixed-size numeric dtypes (int16,
# uint32, complex64, ...) travel as their bytes; variables of the rest
# (strings, resources, variants) keep their local initial value.
_BROADCASTABLE = frozenset([
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64,
    tf.uint8, tf.int8, tf.bool,
])


def _broadcast_initial_value(value):
  """`value` as rank 0 has it, for any fixed-size numeric dtype."""
  ops = _ops()
  if value.dtype in _BROADCASTABLE:
    return ops.broadcast(value, root_rank=0)
  dtype = value.dtype
  if dtype.is_integer or dtype.is_floating or dtype.is_complex:
    # A broadcast copies bytes, so the bit pattern arrives unchanged.
    received = ops.broadcast(tf.bitcast(value, tf.uint8), root_rank=0)
    return tf.bitcast(received, value.dtype)
  return value


def _ops():
  from mpistrategy import ops
  return ops


def _init_engine(communication_options):
  """Starts the engine, honouring the strategy-level engine-wide options.

  `bytes_per_pack` becomes the engine's fusion threshold and
  `timeout_seconds` its stall timeout.  Both are process-wide, so they can
  only be applied by the call that starts the engine.

  Args:
    communication_options: a `tf.distribute.experimental.CommunicationOptions`.

  Raises:
    ValueError: if the engine already runs with different settings.
  """
  overrides = {}
  if communication_options.bytes_per_pack:
    overrides["fusion_threshold_bytes"] = int(
        communication_options.bytes_per_pack)
  if communication_options.timeout_seconds:
    overrides["stall_timeout_seconds"] = float(
        communication_options.timeout_seconds)
  # Never restarts an engine that stopped (see runtime.ensure_started).
  if not overrides:
    runtime.ensure_started()
    return
  if runtime.is_initialized():
    current = runtime.current_options()
    if current is None or any(
        getattr(current, k, None) != v for k, v in overrides.items()):
      raise ValueError(
          "The mpistrategy engine is already running, and "
          f"{sorted(overrides)} are engine-wide settings fixed when it "
          "starts. Create the MPIStrategy with these CommunicationOptions "
          "before any other mpistrategy call, or set them with "
          "mpistrategy.init(mpistrategy.Options(...)) / MPISTRATEGY_* "
          "environment variables.")
    return
  runtime.ensure_started(options_lib.Options(**overrides))


def _local_device():
  """One device per process: GPU `local_rank % #GPUs` if any, else CPU:0."""
  # Make that GPU the only one this process's TensorFlow sees (a no-op
  # without GPUs, a warning if TF already set its GPUs up), so processes on
  # one host do not all allocate memory on every GPU.
  gpu.pin_to_local_gpu()
  gpus = tf.config.list_logical_devices("GPU")
  if gpus:
    index = runtime.local_rank() % len(gpus)
    return "/device:GPU:%d" % index, "GPU"
  return "/device:CPU:0", "CPU"


class MPIExtended(_tfp.CollectiveAllReduceExtended):
  """Implementation of `MPIStrategy` (`strategy.extended`).

  Replaces `CollectiveAllReduceExtended.__init__` (which wants a cluster
  resolver and starts gRPC) and fixes the spots where the inherited code
  would stay rank-local or trips over Keras 3.
  """

  # pylint: disable=super-init-not-called,protected-access
  def __init__(self, container_strategy, cross_device_ops,
               communication_options, compression=None):
    _tfp.distribute_lib.StrategyExtendedV1.__init__(self, container_strategy)
    _init_engine(communication_options)
    rank, size = runtime.rank(), runtime.size()
    device, device_type = _local_device()

    self._communication_options = communication_options
    self._collective_key_base = container_strategy._collective_key_base
    self._num_workers = size
    self._id_in_cluster = rank
    self._is_chief = rank == 0
    self._task_type = "worker"
    self._task_id = rank
    # `None` makes the inherited `_update_config_proto` skip all gRPC
    # collective configuration.
    self._cluster_spec = None
    self._local_or_standalone_client_mode = False
    self._worker_device = _tfp.device_util.canonicalize("/device:CPU:0")
    self._host_input_device = _tfp.numpy_dataset.SingleDevice(
        self._worker_device)
    self._cluster_resolver = _tfp.SimpleClusterResolver(
        _cluster_spec(), task_type="worker", task_id=rank,
        num_accelerators={device_type: 1} if device_type == "GPU" else None)

    if cross_device_ops is None:
      if (communication_options.implementation ==
          _tfp.CommunicationImplementation.NCCL):
        cross_device_ops = nccl_all_reduce.NcclAllReduce(
            communication_options, compression=compression)
      else:
        cross_device_ops = mpi_all_reduce.MPIAllReduce(
            communication_options, compression=compression)
    elif not isinstance(cross_device_ops, mpi_all_reduce.MPIAllReduce):
      raise ValueError(
          "MPIStrategy needs a cross_device_ops from "
          "mpistrategy.cross_device_ops (MPIAllReduce or NcclAllReduce); "
          f"got {type(cross_device_ops).__name__}, whose reductions would "
          "stay inside this process.")
    elif (compression is not None and
          compression_lib.get(compression) is not cross_device_ops.compression):
      raise ValueError(
          f"MPIStrategy(compression={compression!r}) differs from the "
          f"compression of its cross_device_ops "
          f"({cross_device_ops.compression!r}); pass it to one of them, e.g. "
          f"{type(cross_device_ops).__name__}(compression=...).")
    self._cross_device_ops = cross_device_ops
    # Host (CPU) tensors, e.g. the end-of-data `has_value` sync, always go
    # over MPI.
    if isinstance(cross_device_ops, nccl_all_reduce.NcclAllReduce):
      self._host_cross_device_ops = mpi_all_reduce.MPIAllReduce(
          _tfp.Options(
              bytes_per_pack=communication_options.bytes_per_pack,
              timeout_seconds=communication_options.timeout_seconds),
          compression=cross_device_ops.compression)
    else:
      self._host_cross_device_ops = cross_device_ops
    self._collective_ops = self._cross_device_ops
    self._collective_keys = _tfp.cross_device_utils.CollectiveKeys(
        group_key_start=1 + self._collective_key_base)
    self._num_devices_per_worker = 1
    self._local_device_type = device_type
    self._rpc_layer = None
    self._cfer_fn_cache = weakref.WeakKeyDictionary()
    self.experimental_enable_get_next_as_optional = True
    _tfp.MirroredExtended._initialize_single_worker(self, (device,))

  # ------------------------------------------------------------ variables

  def _get_variable_creator_initial_value(self, replica_id, device,
                                          primary_var, **kwargs):
    """Broadcasts every variable's initial value from rank 0.

    Same structure as `CollectiveAllReduceExtended`'s version, with the
    gRPC `broadcast_send/recv` pair replaced by `mpistrategy.ops.broadcast`.
    Variables must therefore be created in the same order on every rank.
    """
    if replica_id != 0:
      return _tfp.MirroredExtended._get_variable_creator_initial_value(
          self, replica_id=replica_id, device=device, primary_var=primary_var,
          **kwargs)

    def initial_value_fn():
      with tf.device(device):
        initial_value = kwargs["initial_value"]
        if callable(initial_value):
          initial_value = initial_value()
        if isinstance(initial_value, _tfp.CheckpointInitialValue):
          initial_value = initial_value.wrapped_value
        initial_value = tf.convert_to_tensor(
            initial_value, dtype=kwargs.get("dtype", None))
        if self._num_workers > 1:
          with tf.name_scope("MPIBroadcastInitialValue"):
            initial_value = _broadcast_initial_value(initial_value)
        return initial_value

    return initial_value_fn

  # ------------------------------------------------------------ replicas

  def _call_for_each_replica(self, fn, args, kwargs):
    # Eagerly, TensorFlow runs `fn` in a thread of its own; with this one
    # replica its default-named collectives are the caller's (see `_naming`).
    if (not tf.executing_eagerly() or len(self.worker_devices) != 1 or
        isinstance(fn, tf.types.experimental.PolymorphicFunction)):
      return super()._call_for_each_replica(fn, args, kwargs)
    from mpistrategy.ops import _naming  # pylint: disable=g-import-not-at-top
    return super()._call_for_each_replica(_naming.named_as_caller(fn), args,
                                          kwargs)

  # ----------------------------------------------------------- reductions

  def _reduce_to(self, reduce_op, value, destinations, options):
    # Keras 3 (trainer.py `_maybe_symbolic_build`) reduces a tuple of
    # PerReplica values in one call; `CollectiveAllReduceExtended._reduce_to`
    # does not map over nests the way `MirroredExtended._reduce_to` does.
    if tf.nest.is_nested(value):
      return tf.nest.map_structure(
          lambda v: super(MPIExtended, self)._reduce_to(
              reduce_op, _read_keras_variable(v), destinations, options),
          value)
    return super()._reduce_to(reduce_op, _read_keras_variable(value),
                              destinations, options)

  def _experimental_distribute_dataset(self, dataset, options):
    # A dataset the user sharded for the ranks already (Horovod's
    # `ds.shard(size, rank)`) is this rank's own input: the inherited code
    # would shard it again (each rank keeping 1/N of its shard) and split its
    # batches as if they were global.  It is distributed like one returned by
    # `distribute_datasets_from_function`: as it is, its batch size per rank.
    if (self._num_workers > 1 and
        _sharded_per_rank(dataset, self._num_workers, self._id_in_cluster)):
      _log_user_sharding_once(self._id_in_cluster, self._num_workers)
      return self._distribute_datasets_from_function(
          lambda unused_input_context: dataset, options)
    if self._num_replicas_in_sync > 1:
      _check_batched(dataset)
    if self._num_workers > 1 and tf.executing_eagerly():
      _check_same_dataset_everywhere(dataset)
    unsharded = False
    if self._num_workers > 1:
      policy = _auto_shard_policy(dataset)
      dataset = _with_a_file_policy_that_works(
          dataset, policy, self._id_in_cluster, self._num_workers)
      unsharded = policy == tf.data.experimental.AutoShardPolicy.OFF
      if not unsharded:
        _warn_if_order_may_differ(dataset)
    dataset = _owned_by_tensorflow(dataset)
    plain = self._plain_iterator_options(options)
    if plain is None:
      distributed = super()._experimental_distribute_dataset(dataset, options)
    else:
      # The inherited method, less its refusal of PER_REPLICA options.
      distributed = _tfp.input_util.get_distributed_dataset(
          dataset,
          self._input_workers_with_options(plain),
          self._container_strategy(),
          num_replicas_in_sync=self._num_replicas_in_sync,
          input_context=self._make_input_context(),
          options=plain)
    if unsharded:
      # Without sharding, every rank splits every global batch into N pieces
      # and yields them all: N times the dataset's batches, not the
      # dataset's cardinality that TF reports and Keras would stop at
      # (after the first 1/N of the rows).  Unknown, every rank iterates to
      # the end.
      distributed._cardinality = tf.data.UNKNOWN_CARDINALITY  # pylint: disable=protected-access
      distributed._enable_get_next_as_optional = True  # pylint: disable=protected-access
    if self._num_workers > 1:
      _warn_if_fillers_lack_rank(distributed)
    return distributed

  def _distribute_datasets_from_function(self, dataset_fn, options):
    def owned_dataset_fn(input_context):
      dataset = dataset_fn(input_context)
      if isinstance(dataset, tf.data.Dataset):
        dataset = _owned_by_tensorflow(dataset)
      return dataset

    plain = self._plain_iterator_options(options)
    if plain is None:
      dataset = super()._distribute_datasets_from_function(owned_dataset_fn,
                                                           options)
    else:
      buffer_size = plain.experimental_per_replica_buffer_size

      def prefetched_dataset_fn(input_context):
        # What the multi-device iterator's buffer did: the next batch is
        # produced while this one trains.
        dataset = owned_dataset_fn(input_context)
        if isinstance(dataset, tf.data.Dataset):
          dataset = dataset.prefetch(buffer_size)
        return dataset

      dataset = _tfp.input_util.get_distributed_datasets_from_function(
          dataset_fn=prefetched_dataset_fn,
          input_workers=self._input_workers_with_options(plain),
          input_contexts=[self._make_input_context()],
          strategy=self._container_strategy(),
          options=plain)
    if self._num_workers > 1 and tf.executing_eagerly():
      _agree_on_cardinality(dataset)
    if self._num_workers > 1:
      _warn_if_fillers_lack_rank(dataset)
    return dataset

  def _plain_iterator_options(self, options):
    """Input options for a plain iterator on this rank's CPU, if it has one.

    The inherited code always builds TF's multi-device iterator, which
    prefetches to each local device.  With one CPU device per process there
    is nothing to fetch to, and that iterator costs more than its own work:
    it is a `GeneratorDataset`, whose kernel (TF 2.21, Python 3.11+) calls
    `mallopt(M_MMAP_THRESHOLD, 128 KiB)`.  That turns glibc's adaptive
    threshold off for the whole process, so every tensor over 128 KiB
    becomes a fresh `mmap`, zeroed page by page and unmapped when freed:
    8-10 ms of kernel time in each step of bench/keras_step.py on 2 ranks.
    `PER_REPLICA` without fetching to the device makes TF's input code use a
    plain iterator (as `MirroredStrategy` does for one device per input
    worker); with one replica per process it yields the same batches.

    Args:
      options: the caller's `tf.distribute.InputOptions`, or None.

    Returns:
      The `InputOptions` to build the input with, or None where the
      inherited path stays: a GPU rank (whose input is worth prefetching to
      the device), or options that ask for `PER_REPLICA` or for placing the
      dataset on the device themselves (the inherited code's errors).
    """
    if self._local_device_type != "CPU":
      return None
    if options is not None and (
        options.experimental_replication_mode ==
        tf.distribute.InputReplicationMode.PER_REPLICA or
        options.experimental_place_dataset_on_device):
      return None
    return tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=(
            tf.distribute.InputReplicationMode.PER_REPLICA),
        experimental_per_replica_buffer_size=(
            options.experimental_per_replica_buffer_size
            if options is not None else 1))

  def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
    # `ReplicaContext.all_reduce` passes `(t, t.device)` pairs; inside a
    # tf.function a tensor that entered the replica function as an argument
    # has `device == ''`, which `validate_destinations` rejects ("destinations
    # can not be empty").  Such values live on this worker's device.
    fixed = []
    for value, dest in value_destination_pairs:
      if not _tfp.cross_device_ops_lib.check_destinations(dest):
        dest = self._devices[0]
      fixed.append((value, dest))
    return super()._batch_reduce_to(reduce_op, fixed, options)

  # ---------------------------------------------------------- lifecycle

  def _configure(self, session_config=None, cluster_spec=None,
                 task_type=None, task_id=None):
    del task_type, task_id
    if cluster_spec:
      raise ValueError(
          "MPIStrategy takes its cluster from MPI (mpirun/srun); a "
          "cluster_spec cannot be configured.")
    if session_config:
      session_config.CopyFrom(self._update_config_proto(session_config))

  def __deepcopy__(self, memo):
    # The distribute coordinator deep-copies strategies.  The engine and the
    # cross-device ops are process-wide, so they are shared; plain settings
    # are copied.
    cls = self.__class__
    result = cls.__new__(cls)
    memo[id(self)] = result
    shared = ("_cross_device_ops", "_host_cross_device_ops", "_collective_ops",
              "_cluster_resolver", "_container_strategy_weakref",
              "_cfer_fn_cache")
    for k, v in self.__dict__.items():
      if k in shared:
        setattr(result, k, v)
      else:
        try:
          setattr(result, k, copy.deepcopy(v, memo))
        except (TypeError, ValueError, copy.Error):
          setattr(result, k, v)
    return result
  # pylint: enable=super-init-not-called,protected-access


def _value_rank(value):
  if isinstance(value, _tfp.DistributedValues):
    value = value.values[0]
  shape = getattr(value, "shape", None)
  if shape is None:
    return np.ndim(value)
  return tf.TensorShape(shape).rank


class MPIStrategy(tf.distribute.MultiWorkerMirroredStrategy):
  """Synchronous data parallelism across MPI processes.

  Launch the unchanged single-device program with `mpirun -np N python
  train.py`; each process is one worker with one device (GPU
  `local_rank % #GPUs` if GPUs are visible, else the CPU).  No `TF_CONFIG`,
  no gRPC server, no optimizer wrapper, no broadcast callbacks.

  What the constructor does, besides building the strategy:

  * starts the mpistrategy engine (`mpistrategy.init()`);
  * every variable created under `scope()` starts from rank 0's initial
    value, so model weights agree even with different seeds per rank;
  * gives every rank rank 0's numpy and Python `random` states and sets
    TF's global seed from them (`tf.random.set_seed`), so unseeded shuffles
    (`model.fit(shuffle=True)`, `Dataset.shuffle`, a `PyDataset`'s
    `np.random.shuffle`) draw the same order on every rank and the
    auto-sharded batches partition the data exactly;
  * installs small, idempotent compatibility patches (see
    `mpistrategy.compat`, which lists them all): Keras'
    `LossScaleOptimizer` skips a step on every rank when any rank overflows;
    Keras progress bars print on rank 0 only; the moving statistics of
    non-synchronized `BatchNormalization` layers are averaged over ranks
    after each training step, so they cannot drift apart; `ModelCheckpoint`,
    `BackupAndRestore` and `tf.train.Checkpoint` write the user's paths on
    rank 0 only and restore rank 0's files on every rank.

  Example:

  ```python
  strategy = mpistrategy.MPIStrategy()
  with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse")
  model.fit(x, y, batch_size=64, epochs=3)   # 64 = global batch size
  ```

  Args:
    cross_device_ops: optional `mpistrategy.cross_device_ops.MPIAllReduce`
      (default) or `NcclAllReduce`.
    communication_options: optional
      `tf.distribute.experimental.CommunicationOptions`.  `bytes_per_pack`
      sets the engine's fusion threshold and `timeout_seconds` its stall
      timeout (both engine-wide, applied when the engine starts);
      `implementation=NCCL` selects `NcclAllReduce`.
    compression: optional `mpistrategy.Compression` member or "none", "fp16",
      "bf16": float32/float64 gradients travel as float16/bfloat16 (see
      `mpistrategy.compression`).  Applies to `ReplicaContext.all_reduce` and
      `extended.batch_reduce_to` (gradients, synchronized batch-norm
      statistics); `strategy.reduce`, metrics and logs stay in full
      precision.  `None` (default) takes the `cross_device_ops`'
      compression, which defaults to none.

  Raises:
    ValueError: for invalid options, a foreign `cross_device_ops`, an
      unknown `compression` or one that differs from `cross_device_ops`',
      or engine-wide options that conflict with an already running engine.
    TypeError: for an `mpistrategy.Options` given as `cross_device_ops`.
  """

  # How mpistrategy.compat's patches recognise an MPIStrategy without
  # importing this module.
  _is_mpi_strategy = True

  def __init__(self, cross_device_ops=None, communication_options=None,
               compression=None):
    # pylint: disable=non-parent-init-called,super-init-not-called
    if isinstance(cross_device_ops, options_lib.Options):
      # The engine's options are the process's, not one strategy's.
      raise TypeError(
          "MPIStrategy's first argument is a cross_device_ops, not "
          "mpistrategy.Options: pass the options to "
          "mpistrategy.init(options) before creating the strategy (or set "
          "the MPISTRATEGY_* environment variables).")
    if communication_options is None:
      communication_options = (
          tf.distribute.experimental.CommunicationOptions())
    mpi_all_reduce.validate_communication_options(
        communication_options, "MPIStrategy")
    if compression is not None:
      compression_lib.get(compression, "MPIStrategy")  # fail before init
    # Skip CollectiveAllReduceStrategy.__init__: it builds a
    # TFConfigClusterResolver and a gRPC-backed extended.
    _tfp.distribute_lib.Strategy.__init__(
        self, MPIExtended(self, cross_device_ops, communication_options,
                          compression))
    # pylint: enable=non-parent-init-called,super-init-not-called
    rank, size = self.extended._id_in_cluster, self.extended._num_workers  # pylint: disable=protected-access
    compat.install(rank=rank, size=size)
    if size > 1:
      _agree_on_random_state()

  @property
  def cluster_resolver(self):
    """A `tf.distribute.cluster_resolver.SimpleClusterResolver`.

    Its cluster spec has one "worker" task per MPI rank, as
    MultiWorkerMirroredStrategy's has one per worker, so that
    `cluster_spec().num_tasks("worker")` and TF's chief checks work; each
    entry is the rank's host name, without a port (MPI, not gRPC, connects
    the ranks).  `task_type` is "worker" and `task_id` the MPI rank.
    """
    return self.extended._cluster_resolver  # pylint: disable=protected-access

  def reduce(self, reduce_op, value, axis):
    """Like `tf.distribute.Strategy.reduce`; scalars ignore `axis`.

    Keras 3 reduces its per-step logs with `reduce("MEAN", v, axis=0)` even
    when `v` is a scalar, which `Strategy.reduce` rejects ("Invalid reduction
    dimension 0 for input with 0 dimensions").  A scalar has no axis to
    reduce, so it is reduced across replicas only (`axis=None`).

    Args:
      reduce_op: a `tf.distribute.ReduceOp` or "SUM"/"MEAN".
      value: a `tf.distribute.DistributedValues` or tensor.
      axis: the axis to reduce within each replica, or `None`.

    Returns:
      A `tf.Tensor`, identical on every rank.
    """
    if axis is not None and _value_rank(value) == 0:
      axis = None
    return super().reduce(reduce_op, value, axis)


def _sharded_per_rank(dataset, num_shards, rank):
  """True if `dataset` was sharded per rank by the user (`_user_shard`).

  A `shard(size, rank)` has each rank's own index; a `shard(size, 0)` on
  every rank is a split (a hold-out, say) and is sharded across the ranks
  like any other dataset, as under one process with several replicas.
  Where the shard's index is a constant, the ranks compare their indices
  (one small allgather, eagerly); a computed index counts as the rank.

  Args:
    dataset: a `tf.data.Dataset`.
    num_shards: the world size.
    rank: this rank.

  Returns:
    A bool, the same on every rank.
  """
  found, index = _user_shard(dataset, num_shards)
  if not found:
    return False
  if not tf.executing_eagerly():
    return True
  indices = [row[0] for row in _ops().collectives.every_ranks_values(
      [-1 if index is None else index], "MPIStrategy.user_shard_indices")]
  if all(i in (-1, r) for r, i in enumerate(indices)):
    return True
  if rank == 0 and "split" not in _LOGGED:
    _LOGGED.add("split")
    tf.get_logger().info(
        "MPIStrategy: the dataset's shard(%d, ...) has the indices %s on "
        "ranks 0..%d, not each rank's own: it is a split, and is sharded "
        "across the ranks like any other dataset.", num_shards, indices,
        num_shards - 1)
  return False


def _user_shard(dataset, num_shards):
  """Whether `dataset` contains `.shard(num_shards, ...)` and auto-shards.

  Looks through the Python objects of the pipeline (`_inputs()`), so it sees
  every transformation built in this process; a shard inside the function
  of `interleave`/`flat_map` is not seen.  A dataset whose auto-shard policy
  the user set explicitly (anything but AUTO) keeps that policy.

  Args:
    dataset: a `tf.data.Dataset`.
    num_shards: the world size.

  Returns:
    `(found, index)`: the shard's index where it is a constant, else None.
  """
  if _auto_shard_policy(dataset) != tf.data.experimental.AutoShardPolicy.AUTO:
    return False, None
  for d in _pipeline(dataset):
    shards = getattr(d, "_num_shards", None)
    if type(d).__name__ == "_ShardDataset" and shards is not None:
      value = tf.get_static_value(shards)
      if value is not None and int(value) == num_shards:
        index = tf.get_static_value(getattr(d, "_index", None))
        return True, None if index is None else int(index)
  return False, None


def _auto_shard_policy(dataset):
  """`dataset`'s `tf.data.experimental.AutoShardPolicy`, or None."""
  if not isinstance(dataset, tf.data.Dataset):
    return None
  try:
    return dataset.options().experimental_distribute.auto_shard_policy
  except (AttributeError, TypeError):
    return None


# Datasets that read records from files, one record an element.
_RECORD_READERS = frozenset({
    "TFRecordDatasetV2", "TextLineDatasetV2", "FixedLengthRecordDatasetV2"})
# Datasets that read files, or may inside their function: where TF's FILE
# sharding (AUTO's first choice) shards.
_READS_FILES = _RECORD_READERS | {
    "CsvDatasetV2", "_InterleaveDataset", "_ParallelInterleaveDataset",
    "_FlatMapDataset"}


def _reads_files(dataset):
  return any(type(d).__name__ in _READS_FILES for d in _pipeline(dataset))


def _joins_files_and_memory(dataset):
  """True where a zip or concatenation joins files with data in memory.

  AUTO shards such a pipeline by FILE: each rank reads its own files but
  every row of the in-memory part, so a zip pairs features with the wrong
  labels and drops rows, and a concatenation repeats the in-memory rows on
  every rank.
  """
  for d in _pipeline(dataset):
    if type(d).__name__ in ("_ZipDataset", "_ConcatenateDataset"):
      try:
        inputs = d._inputs()  # pylint: disable=protected-access
      except (AttributeError, NotImplementedError, TypeError):
        continue
      if len({_reads_files(i) for i in inputs}) > 1:
        return True
  return False


# Dataset ops that read a file each, as TF's FILE sharding looks for them
# (inside the functions of interleave and flat_map).
_FILE_READER_OPS = frozenset({
    "TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
    "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2"})
_FILE_NAME_CONSUMERS = frozenset({
    "_InterleaveDataset", "_ParallelInterleaveDataset", "_FlatMapDataset",
    "ParallelInterleaveDataset"})


def _files_to_shard(dataset):
  """How many files FILE sharding would divide among the ranks, or None.

  That is the length of the file-name dataset that a record reader (or an
  interleave or flat_map whose function reads files) takes its files from,
  where TensorFlow knows it before reading.
  """
  for current in _pipeline(dataset):
    kind = type(current).__name__
    if kind in _RECORD_READERS:
      names = getattr(current, "_filenames", None)
    elif (kind in _FILE_NAME_CONSUMERS and
          _functions_use(current, _FILE_READER_OPS)):
      names = getattr(current, "_input_dataset", None)
    else:
      continue
    if isinstance(names, tf.data.Dataset):
      count = int(names.cardinality())
      if count >= 0:
        return count
  return None


def _with_a_file_policy_that_works(dataset, policy, rank, size):
  """`dataset`, sharded by DATA where sharding by file would go wrong.

  Under AUTO, TF shards a pipeline that reads files by FILE.  That pairs
  features from files with the wrong in-memory labels in a zip, and with
  fewer files than ranks it fails at the first step on the ranks left
  without a file (and only there).  FILE set explicitly with too few files
  fails here, on every rank.

  Args:
    dataset: the dataset given to `experimental_distribute_dataset`.
    policy: its `AutoShardPolicy`.
    rank: this rank.
    size: the number of ranks.

  Returns:
    `dataset`, or `dataset` with `AutoShardPolicy.DATA`.

  Raises:
    ValueError: for `AutoShardPolicy.FILE` with fewer files than ranks.
  """
  file_policies = (tf.data.experimental.AutoShardPolicy.AUTO,
                   tf.data.experimental.AutoShardPolicy.FILE)
  if policy not in file_policies:
    return dataset
  if (policy == tf.data.experimental.AutoShardPolicy.AUTO and
      _joins_files_and_memory(dataset)):
    return _sharded_by_data(
        dataset, rank, "joins files with data in memory (zip or "
        "concatenate), which sharding by file would misalign")
  files = _files_to_shard(dataset)
  if files is None or files >= size:
    return dataset
  if policy == tf.data.experimental.AutoShardPolicy.FILE:
    raise ValueError(
        f"AutoShardPolicy.FILE gives each rank whole files, but the dataset "
        f"reads {files} file(s) for {size} ranks, so some ranks would have "
        "none. Use AutoShardPolicy.DATA (or AUTO), or split the data into "
        "at least as many files as ranks.")
  return _sharded_by_data(
      dataset, rank, f"reads {files} file(s), fewer than the {size} ranks "
      "that sharding by file needs")


def _sharded_by_data(dataset, rank, why):
  """`dataset` with AutoShardPolicy.DATA, said once on rank 0 with `why`."""
  if rank == 0 and why not in _LOGGED:
    _LOGGED.add(why)
    tf.get_logger().info(
        f"MPIStrategy: the dataset {why}; it is sharded by data "
        "(AutoShardPolicy.DATA): every rank reads every file.")
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.DATA)
  return dataset.with_options(options)


def _pipeline(dataset):
  """Yields `dataset` and every dataset it reads from, each once.

  Walks the Python objects of the pipeline (`_inputs()`): every
  transformation built in this process, not a dataset made inside the
  function of `interleave`/`flat_map`.
  """
  seen = set()
  pending = [dataset]
  while pending:
    current = pending.pop()
    if id(current) in seen:
      continue
    seen.add(id(current))
    yield current
    try:
      pending.extend(i for i in current._inputs()  # pylint: disable=protected-access
                     if isinstance(i, tf.data.Dataset))
    except (AttributeError, NotImplementedError, TypeError):
      continue


_LOGGED = set()


def _log_user_sharding_once(rank, size):
  if "user_sharding" in _LOGGED or rank != 0:
    return
  _LOGGED.add("user_sharding")
  tf.get_logger().info(
      "MPIStrategy: the dataset is already sharded with shard(%d, ...); it "
      "is not sharded again, and its batch size is the batch of each rank "
      "(global batch = %d x that).", size, size)


# Ops through which a dataset's elements can share memory with numpy arrays
# that Python owns (a generator's, a PyDataset's, a py_function's results).
_PYTHON_FUNCTION_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def _calls_python(dataset):
  """True where a function of `dataset` or of its inputs runs Python.

  Sees the functions of the dataset and of its inputs (and the functions
  nested in them), not datasets captured inside a function (a generator
  dataset returned by an `interleave` function).
  """
  return any(_functions_use(current, _PYTHON_FUNCTION_OPS)
             for current in _pipeline(dataset))


def _functions_use(dataset, op_types):
  """True where `dataset`'s functions (or nested ones) run one of `op_types`."""
  for wrapper in dataset._functions():  # pylint: disable=protected-access
    graph = wrapper.function.graph.as_graph_def()
    nodes = list(graph.node) + [node for function in graph.library.function
                                for node in function.node_def]
    if any(node.op in op_types for node in nodes):
      return True
  return False


def _owned_by_tensorflow(dataset):
  """`dataset`, its elements copied where they may alias Python's memory.

  A generator's or a PyDataset's numpy batches reach TensorFlow without a
  copy.  After the ranks' split, the training step's kernels may then reuse
  such a label buffer for their outputs in place and write over the user's
  own array (a stranger's labels changed between epochs).  Each element of
  a dataset that calls Python is copied into memory TensorFlow owns.
  """
  if not _calls_python(dataset):
    return dataset

  def copy(element):
    return tf.nest.map_structure(lambda t: tf.raw_ops.DeepCopy(x=t), element,
                                 expand_composites=True)

  if isinstance(dataset.element_spec, tuple):  # map unpacks a tuple
    return dataset.map(lambda *element: copy(element), deterministic=True)
  return dataset.map(copy, deterministic=True)


# Datasets whose elements are single rows, and transformations after which
# an element is still one row.
_ROW_SOURCES = _RECORD_READERS | {
    "_TensorSliceDataset", "_RangeDataset", "_UnbatchDataset"}
_ROW_KEEPING = frozenset({
    "_MapDataset", "_ParallelMapDataset", "_FilterDataset", "_ShuffleDataset",
    "_RepeatDataset", "CacheDataset", "_TakeDataset", "_SkipDataset",
    "_PrefetchDataset", "_OptionsDataset", "_ZipDataset",
    "_ConcatenateDataset", "_ShardDataset", "_IgnoreErrorsDataset",
    "_AssertCardinalityDataset"})


def _reads_rows_unbatched(dataset):
  """True where every element of `dataset` is known to be one row.

  Follows the pipeline back from `dataset` through transformations that
  keep rows to where its rows come from (a source or an `unbatch`); any
  other transformation (a batch, an interleave) may make batches.
  """
  kind = type(dataset).__name__
  if kind in _ROW_SOURCES:
    return True
  if kind not in _ROW_KEEPING:
    return False
  try:
    inputs = dataset._inputs()  # pylint: disable=protected-access
  except (AttributeError, NotImplementedError, TypeError):
    return False
  return bool(inputs) and all(
      isinstance(i, tf.data.Dataset) and _reads_rows_unbatched(i)
      for i in inputs)


def _check_batched(dataset):
  """Refuses or warns of a dataset whose elements have no batch axis.

  `experimental_distribute_dataset` splits every element of the dataset
  along its first axis, the global batch; TF's rebatching fails with a bare
  `IndexError` on a scalar component, and splits a row of features (an
  unbatched `from_tensor_slices(x)`) across the ranks without a word.

  Args:
    dataset: the `tf.data.Dataset` passed to `experimental_distribute_dataset`.

  Raises:
    ValueError: if a component of its elements is a scalar.
  """
  if not isinstance(dataset, tf.data.Dataset):
    return
  for spec in tf.nest.flatten(dataset.element_spec):
    shape = getattr(spec, "shape", None)
    if shape is not None and shape.rank == 0:
      raise ValueError(
          "experimental_distribute_dataset splits each element along its "
          "first axis (the global batch) over the ranks, but this dataset's "
          f"elements have a scalar component (element_spec "
          f"{dataset.element_spec}). Batch it first "
          "(dataset.batch(global_batch_size)), or build each rank's input "
          "with distribute_datasets_from_function.")
  if _reads_rows_unbatched(dataset):
    # A warning, not an error: elements made whole batches beforehand
    # (from_tensor_slices of [steps, batch, ...] arrays) look the same.
    tf.get_logger().warning(
        "MPIStrategy: experimental_distribute_dataset splits each element "
        "along its first axis (the global batch) over the ranks, but this "
        "dataset reads single rows (from_tensor_slices, range, a record "
        "file) and nothing batches them, so each rank would get a part of "
        "every row (element_spec %s). Batch it first "
        "(dataset.batch(global_batch_size)); if each element already is a "
        "whole global batch, ignore this.", dataset.element_spec)


def _warn_if_order_may_differ(dataset):
  """Warns where the ranks' copies of `dataset` may yield another order.

  Each rank takes its part of every batch of its own copy of the pipeline;
  a transformation allowed to yield out of order (`deterministic=False`,
  or `Options.deterministic = False`) may give the ranks different batches,
  and rows are then lost and repeated without an error.
  """
  if not isinstance(dataset, tf.data.Dataset):
    return
  loose = [type(d).__name__.strip("_") for d in _pipeline(dataset)
           if getattr(d, "_deterministic", None) == "false"]
  try:
    if dataset.options().deterministic is False:
      loose.append("Options.deterministic")
  except (AttributeError, TypeError):
    pass
  if loose:
    tf.get_logger().warning(
        "MPIStrategy: the dataset may yield its elements in another order on "
        "each rank (deterministic=False in %s), but every rank takes its "
        "part of the same global batches: rows would be lost and repeated. "
        "Make it deterministic, or give each rank its own data with "
        "distribute_datasets_from_function.", ", ".join(sorted(set(loose))))


def _warn_if_fillers_lack_rank(distributed):
  """Warns where a rank out of data would get a scalar for its batch.

  A rank whose data ends before the others' gets, in TF's input code (as
  under MultiWorkerMirroredStrategy), a batch of 0 rows shaped like the
  dataset's elements; for an element of unknown rank that is a scalar,
  which the rank's model and `strategy.gather` reject with errors that do
  not say why (a `parse_tensor`, a `py_function`).
  """
  if not getattr(distributed, "_enable_get_next_as_optional", False):
    return  # every rank gets every step's data
  try:
    # PerReplicaSpec and the like: their components' specs.
    specs = tf.nest.flatten(distributed.element_spec, expand_composites=True)
  except (AttributeError, TypeError, ValueError):
    return
  unknown = [s for s in specs
             if isinstance(s, tf.TensorSpec) and s.shape.rank is None]
  if not unknown or "unknown_rank" in _LOGGED:
    return
  _LOGGED.add("unknown_rank")
  tf.get_logger().warning(
      "MPIStrategy: the dataset's elements include a tensor of unknown rank "
      "(%s). A rank whose data runs out before the others' gets a batch of 0 "
      "rows in its place, and for a tensor of unknown rank that is a scalar, "
      "which a model or strategy.gather cannot take. Give the elements a "
      "known rank before batching, e.g. dataset.map(lambda x: "
      "tf.ensure_shape(x, [None, None])) for matrices.", unknown[0])


# Transformations whose `_batch_size` is the size of the batches they make.
_BATCHING = frozenset({
    "_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset"})


def _batch_size(dataset):
  """The static size of the last batching in `dataset`, or -1."""
  for current in _pipeline(dataset):
    if type(current).__name__ in _BATCHING:
      size = tf.get_static_value(getattr(current, "_batch_size", None))
      return -1 if size is None else int(size)
  return -1


def _check_same_dataset_everywhere(dataset):
  """Raises on every rank where the ranks' datasets differ in shape.

  Auto-sharding splits one global dataset that every rank builds alike:
  each rank takes its part of every global batch.  A batch size that
  depends on the rank, or data of another length on each rank (arrays
  loaded per rank without `shard`), splits the rows wrongly without an
  error, or leaves ranks waiting in different steps.  One small allgather
  per distributed dataset compares them.

  Args:
    dataset: the dataset given to `experimental_distribute_dataset`.

  Raises:
    ValueError: where ranks differ in batch size or number of elements.
  """
  mine = [_batch_size(dataset), int(dataset.cardinality())]
  everyone = _ops().collectives.every_ranks_values(
      mine, "MPIStrategy/dataset_shape")
  if all(row == everyone[0] for row in everyone):
    return

  def per_rank(column, meaning):
    return ", ".join(f"{_describe_count(row[column], meaning)} on rank {r}"
                     for r, row in enumerate(everyone))

  raise ValueError(
      "experimental_distribute_dataset (Keras fit/evaluate/predict use it): "
      "the ranks' datasets differ: "
      f"{per_rank(0, 'batch size')}; {per_rank(1, 'elements')}. Each rank "
      "takes its part of every global batch of one dataset that every rank "
      "builds alike: give every rank the same data and global batch size. "
      "For data that differs per rank, shard it with "
      "ds.shard(mpistrategy.size(), mpistrategy.rank()) (its batch size is "
      "then each rank's) or use distribute_datasets_from_function.")


def _describe_count(value, meaning):
  if meaning != "elements":
    special = {-1: "unknown"}  # `_batch_size`'s
  else:
    special = {int(tf.data.INFINITE_CARDINALITY): "infinite",
               int(tf.data.UNKNOWN_CARDINALITY): "unknown"}
  return f"{meaning} {special.get(value, value)}"


def _agree_on_cardinality(dataset):
  """Marks `dataset`'s cardinality unknown when the ranks' lengths differ.

  `distribute_datasets_from_function` reports this rank's own number of
  batches, and Keras sizes each epoch by it: with per-rank datasets of
  different lengths (files of different sizes, say) a rank that ran out
  first would end its epoch and wait in a different collective forever.
  With the cardinality unknown, every rank iterates until all of them are
  exhausted (ranks without data get empty batches), as in a custom loop.

  Args:
    dataset: a built `DistributedDatasetsFromFunction`; called on every rank.
  """
  mine = int(dataset._cardinality)  # pylint: disable=protected-access
  everyone = [row[0] for row in _ops().collectives.every_ranks_values(
      [mine], "MPIStrategy/dataset_cardinality")]
  if len(set(everyone)) > 1:
    dataset._cardinality = tf.data.UNKNOWN_CARDINALITY  # pylint: disable=protected-access
    dataset._enable_get_next_as_optional = True  # pylint: disable=protected-access


def _read_keras_variable(value):
  """A `keras.Variable`'s value as a tensor; any other value unchanged.

  A Keras 3 variable wraps TF's and is neither a tensor nor a
  `DistributedValues`, so TF's reduction cannot place it ("Cannot convert
  `input_tensor` to a `PerReplica` object").  One arrives here from a
  metric whose `result()` returns its variable (the Keras guides'
  `CategoricalTruePositives`).  Read in cross-replica context, a metric's
  on-read variable is its aggregate over all ranks: the value one process
  would have counted.

  Args:
    value: what `Strategy.reduce` was given.

  Returns:
    `value`, or the variable's value.
  """
  keras = sys.modules.get("keras")
  if keras is not None and isinstance(value, keras.Variable):
    return tf.convert_to_tensor(value)
  return value


def _cluster_spec():
  """{"worker": [host of rank 0, host of rank 1, ...]}.

  Returns:
    A `tf.train.ClusterSpec` of one task per rank, named by its host (no
    port: the ranks talk over MPI, not gRPC).
  """
  return tf.train.ClusterSpec({"worker": runtime.rank_hosts()})


def _agree_on_random_state():
  """Makes unseeded random draws agree across ranks (data order, P6).

  Every rank takes rank 0's numpy and Python `random` global states, so a
  pipeline that shuffles with them (a `PyDataset`'s `np.random.shuffle` in
  `on_epoch_end`, a generator's `random.shuffle`) yields the same order on
  every rank and the auto-sharded batches partition the data.  Then every
  rank draws TF's global seed from the shared numpy state
  (`tf.random.set_seed`): the seed rank 0's generator gives, so a user who
  seeds before creating the strategy gets a reproducible run.
  """
  if not tf.executing_eagerly():
    return
  _, keys, position, has_gauss, cached_gauss = np.random.get_state()
  version, internal, gauss_next = random.getstate()
  integers = np.concatenate([keys.astype(np.int64), [position, has_gauss],
                             np.asarray(internal, np.int64)])
  floats = np.array([cached_gauss, gauss_next or 0.0,
                     float(gauss_next is None)])
  with tf.name_scope("MPIStrategySeed"):
    integers = _ops().broadcast(tf.constant(integers), root_rank=0).numpy()
    floats = _ops().broadcast(tf.constant(floats), root_rank=0).numpy()
  n = len(keys)
  np.random.set_state(("MT19937", integers[:n].astype(np.uint32),
                       int(integers[n]), int(integers[n + 1]),
                       float(floats[0])))
  random.setstate((version, tuple(int(v) for v in integers[n + 2:]),
                   None if floats[2] else float(floats[1])))
  tf.random.set_seed(int(np.random.randint(0, 2**31 - 1)))
