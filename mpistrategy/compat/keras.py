"""Minimal Keras 3 patches that multi-process training needs.

`mpistrategy.compat.install()` (called by `MPIStrategy.__init__`) applies
each once per process; each is a no-op unless the active strategy is a
multi-process `MPIStrategy`, so single-process code is unaffected.

1. `LossScaleOptimizer.check_finite` (upstream bug, Keras 3.15
   `keras/src/optimizers/loss_scale_optimizer.py`, `_tf_apply`): the optimizer
   decides "finite or not" from the *local, not yet all-reduced* gradients --
   its comment assumes they were reduced already -- and then runs
   `cond(finite, apply_fn, skip_fn)` where only `apply_fn` contains the
   gradient all-reduce.  When one rank overflows and another does not, the
   ranks issue different collectives: one hangs, or MPI reports a truncated
   message.  The patch all-reduces the flag (MIN over ranks), so every rank
   skips the step -- and halves its loss scale -- together.  The same holds
   for a `hvd.DistributedOptimizer` (which reduces in its `apply`) that
   Keras wraps under `mixed_float16`, without `MPIStrategy`.

2. `ProgbarLogger` on ranks other than 0: progress bars and per-epoch log
   lines are printed by rank 0 only (the logged values are global, so the
   other ranks would print the same numbers N times, interleaved).  Only the
   progress-bar callback is silenced; `print` and `model.summary()` are left
   alone.

3. `BatchNormalization(synchronized=False)` moving statistics: Keras 3
   creates `moving_mean`/`moving_variance` as ordinary non-trainable weights
   (Keras 2 made them sync-on-read with MEAN aggregation), so under a
   multi-worker strategy each rank updates its mirrored copy from its own
   batch and the copies silently drift apart: `predict` rows then depend on
   which rank computed them, and the checkpoint holds rank 0's statistics
   only (TF's MultiWorkerMirroredStrategy has the same gap).  After a
   training-mode call, the patch replaces the layer's non-trainable float
   weights by their mean over ranks, weighted by each rank's rows (one
   packed `grouped_allreduce` per layer and step).  Every rank then holds
   the same statistics, and the moving mean is what one process would
   compute from the global batch, even when the shards are uneven; the
   moving variance averages the shards' variances.  A rank whose batch is
   empty (NaN moments) does not count.  The forward pass still normalizes
   with the local batch's statistics, as non-synchronized batch
   normalization does; on a rank whose batch is empty it uses a mean of 0
   and a variance of 1 instead of the NaN moments, which would otherwise
   reach every rank's gamma and beta through the gradients' sum.  The
   average is a collective, so such a layer must
   run in training mode on every rank or on none: inside a `tf.cond` whose
   branch depends on the rank's data it leaves the ranks waiting in
   different collectives (the stall warning names them).

4. `TensorFlowTrainer._maybe_symbolic_build` (Keras 3.15
   `keras/src/backend/tensorflow/trainer.py`): before `fit`/`evaluate`,
   Keras takes the first distributed batch and all-reduces it
   (`strategy.reduce("MEAN", batch, axis=None)`) only to learn its
   structure and shapes.  When the global batch does not split evenly
   (64 rows on 3 ranks) or has fewer rows than there are ranks, the ranks'
   shards differ in shape and that reduction fails on every rank.  The
   patch builds from this rank's own shard instead, which has the same
   per-replica structure; nothing is communicated.  A model without a
   `call()` of its own (the Keras guide's GAN) cannot be built from a
   batch at all, and under a strategy `fit` failed with "Unable to
   automatically build the model" (one process defers building to the
   first trace of the step): it is left to the first trace here too.

5. Keras/TF calls that communicate (`Model.fit`, `evaluate`, `predict`,
   `train_on_batch`, `test_on_batch`, `predict_on_batch`, `save`,
   `save_weights`, `load_weights`, `export`; `tf.train.Checkpoint.save`,
   `write`, `restore`, `read`; `tf.train.CheckpointManager.save`,
   `restore_or_initialize`) run inside
   `mpistrategy.ops._naming.entry_point("Model.<method>")` (or
   "Checkpoint.<method>", ...), so the default names of their collectives
   start with the call (see `_naming`): a stall warning or timeout then
   says `Model.evaluate/...` instead of an anonymous `eager/allreduce`.
   When such a call fails because other ranks did not join its collectives
   (a stall timeout, or a rank that shut down or raised), the error gets a
   note naming the call and the rank and stating the rule: every rank must
   make the same Keras/TF calls that communicate.

6. `TFEpochIterator` with a dataset the user sharded per rank (see
   `MPIStrategy._experimental_distribute_dataset`): Keras sizes each epoch
   by the tf.data dataset's own cardinality, which differs across ranks when
   the shards have different lengths, so the rank with fewer batches would
   end its epoch while the others wait in a training step.  When the
   distributed dataset's cardinality is unknown (the ranks disagreed; see
   `strategy._agree_on_cardinality`) but the local one is known, the epoch
   is sized as unknown, so every rank steps until all are exhausted, as for
   `distribute_datasets_from_function`.
   The same patch refuses a Python generator as `x` of `fit` or `evaluate`
   (with more than one rank): Keras' generator adapter under a distribution
   strategy gives the ranks batches out of step, so rows would be missed or
   repeated without an error.  `predict` keeps it (its rows come out right).

7. `CallbackList.on_train_batch_end` and `on_epoch_end` (`fit`),
   `on_test_batch_end` (`evaluate`), `on_predict_batch_end` (`predict`): a
   callback that sets `model.stop_training` (`stop_evaluating`,
   `stop_predicting`) on some ranks only (a time budget read from each
   rank's clock, a decision from rank-local values) would end their loop
   while the others wait in the next step's collectives for ever.  Where
   the flag is set after a batch or an epoch, the rank enters a blocking
   join (`ops.blocking_join`): when every rank stops there it passes, and
   otherwise, about a second later, every rank fails with
   `FailedPreconditionError` naming the step and the rule.  Nothing is
   communicated while no callback stops the loop.

8. `Trainer.compile` outside the scope of the strategy the model was built
   under: Keras 3 creates the `loss` tracker (a `Mean` metric) and an
   optimizer given by name inside `compile`, without entering the model's
   strategy (Keras 2 did), so they become ordinary per-process variables.
   One process with `MirroredStrategy` still sums its replicas' updates;
   on several ranks each rank's `loss` in the logs and in `evaluate` is
   its own, and callbacks that read it (`ReduceLROnPlateau`,
   `EarlyStopping`, `ModelCheckpoint(save_best_only=True)`) act at
   different epochs on different ranks.  The patch runs such a `compile`
   in the model's strategy's scope, as one inside the scope would run.
   The other way round, `compile` inside the scope of a model created
   outside it raises a `ValueError` saying so (Keras failed in `fit` with a
   bare `AssertionError` on two or more ranks).
"""

import functools
import inspect
import re
import types

import tensorflow as tf

from mpistrategy import _tf_private as _tfp
from mpistrategy import preemption

_WORLD = {"size": 1}


def set_world(size):
  """Records the MPI world size (the largest one seen)."""
  _WORLD["size"] = max(_WORLD["size"], size)


def _world_size():
  return _WORLD["size"]


def mpi_world_size(strategy):
  """`strategy`'s number of processes if it is an `MPIStrategy`, else 1.

  `MPIStrategy` says so with its `_is_mpi_strategy` class attribute, so that
  these patches need not import mpistrategy/strategy.py (which installs them).
  """
  if getattr(strategy, "_is_mpi_strategy", False):
    return strategy.extended._num_workers  # pylint: disable=protected-access
  return 1


def _active_mpi_world():
  """Returns the world size if the current strategy is an MPIStrategy."""
  return mpi_world_size(tf.distribute.get_strategy())


def _reduces_in_apply(optimizer):
  """True for a `hvd.DistributedOptimizer` in a job of several ranks.

  Keras wraps it in a `LossScaleOptimizer` under `mixed_float16`; its
  `apply`, which reduces, then runs in the "finite" branch only.
  """
  if getattr(optimizer, "_hvd_reducer", None) is None:
    return False
  from mpistrategy import runtime  # pylint: disable=g-import-not-at-top
  return runtime.is_initialized() and runtime.size() > 1


def patch_loss_scale_optimizer():
  cls = _tfp.keras_loss_scale_optimizer.LossScaleOptimizer
  original = cls.check_finite

  def check_finite(self, grads):
    finite = original(self, grads)
    if _active_mpi_world() <= 1 and not _reduces_in_apply(
        self.inner_optimizer):
      return finite
    from mpistrategy import ops
    # MIN over ranks of the local flag: finite only if finite everywhere.
    with tf.name_scope("MPILossScaleFinite"):
      flag = ops.allreduce(tf.cast(finite, tf.int32), op=ops.Min)
    return tf.cast(flag, tf.bool)

  check_finite.__doc__ = original.__doc__
  cls.check_finite = check_finite


def patch_progbar(rank):
  if rank == 0:
    return
  cls = _tfp.keras_progbar_logger.ProgbarLogger
  original = cls.set_params

  def set_params(self, params):
    original(self, params)
    if _active_mpi_world() > 1 or _world_size() > 1:
      self.verbose = 0

  cls.set_params = set_params


def patch_batch_normalization():
  cls = _tfp.keras_batch_normalization.BatchNormalization
  original = cls.call

  def call(self, inputs, training=None, mask=None):
    outputs = original(self, inputs, training=training, mask=mask)
    # The same condition under which the original updated the statistics.
    if (training and self.trainable and not self.synchronized and
        _active_mpi_world() > 1):
      _average_over_ranks(self, inputs)
    return outputs

  call.__doc__ = original.__doc__
  cls.call = call

  original_moments = cls._moments  # pylint: disable=protected-access

  def _moments(self, inputs, mask):
    mean, variance = original_moments(self, inputs, mask)
    if self.synchronized or _active_mpi_world() <= 1:
      return mean, variance
    # A rank with no rows (the last batch of uneven data) has 0/0 moments.
    # Its outputs are empty, but the gradients of gamma and beta pass
    # through the moments (0 * NaN), and their sum over ranks would make
    # every rank's weights NaN.  0 and 1 keep them at 0; the average above
    # leaves the rank out of the statistics.
    has_rows = tf.size(inputs) > 0
    return (tf.where(has_rows, mean, tf.zeros_like(mean)),
            tf.where(has_rows, variance, tf.ones_like(variance)))

  _moments.__doc__ = original_moments.__doc__
  cls._moments = _moments  # pylint: disable=protected-access


def _average_over_ranks(layer, inputs):
  """Replaces `layer`'s non-trainable float weights by their cross-rank mean.

  The mean is weighted by each rank's number of rows in `inputs`: the
  moving mean's update is linear in the batch mean, so this gives what one
  process would compute from the global batch, and a rank with no rows
  (whose moments are NaN) is left out.  If no rank had rows, the weights
  keep their values.

  Args:
    layer: a built `BatchNormalization` layer, after its own update.
    inputs: the batch it was just called on.
  """
  from mpistrategy import ops
  variables = [v for v in layer.non_trainable_variables
               if tf.as_dtype(v.dtype).is_floating]
  if not variables:
    return
  with tf.name_scope("MPIBatchNormStatistics"):
    rows = tf.cast(tf.shape(inputs)[0], tf.float32)
    weighted = []
    for v in variables:
      # Reads after the layer's own assign (automatic control dependencies).
      value = v.value
      weight = tf.cast(rows, value.dtype)
      weighted.append(tf.where(rows > 0, value * weight,
                               tf.zeros_like(value)))
    sums = ops.grouped_allreduce(weighted + [rows], op=ops.Sum)
    total_rows = sums[-1]
    for v, total in zip(variables, sums[:-1]):
      mean = total / tf.cast(tf.maximum(total_rows, 1.0), total.dtype)
      v.assign(tf.where(total_rows > 0, mean, v.value))


def patch_symbolic_build():
  cls = _tfp.keras_trainer.TensorFlowTrainer
  original = cls._maybe_symbolic_build  # pylint: disable=protected-access

  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy  # pylint: disable=protected-access
    if (getattr(strategy, "_is_mpi_strategy", False) and
        type(self).call is _tfp.keras_model.Model.call):
      # A model without call() (the Keras guide's GAN, whose train_step
      # calls its parts) cannot be built from a batch; as without a
      # strategy, its variables are built in the first trace of its step.
      return None
    if iterator is None or not _is_multi_process(strategy):
      return original(self, iterator=iterator, data_batch=data_batch)
    # As the original: the first batch of the first epoch iterator.
    for _, _, it in iterator:
      data_batch = tf.nest.map_structure(
          lambda x: _local_value(strategy, x), next(it))
      break
    return original(self, iterator=None, data_batch=data_batch)

  cls._maybe_symbolic_build = _maybe_symbolic_build  # pylint: disable=protected-access


def wrap_model_compile(make):
  """Replaces Keras' `Model.compile` with `make(current compile)`.

  Patched where it is defined (Keras' Trainer base class), which Keras
  compares against to tell an overridden `compile()` (`load_model`);
  functools.wraps copies Keras' `_is_default` mark, which says it is not
  overridden.  Each patch of `compile` goes through here.

  Args:
    make: takes the current `compile`, returns its replacement.
  """
  owner = next(k for k in _tfp.keras_model.Model.__mro__
               if "compile" in k.__dict__)
  original = owner.__dict__["compile"]
  setattr(owner, "compile", functools.wraps(original)(make(original)))


def patch_compile():
  def make(original):
    def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
      strategy = getattr(self, "_distribute_strategy", None)
      current = tf.distribute.get_strategy()
      if (strategy is None and getattr(current, "_is_mpi_strategy", False)
          and hasattr(self, "_distribute_strategy")):
        # Keras would fail in fit's first optimizer update, with a bare
        # AssertionError on two or more ranks.
        raise ValueError(
            f"{type(self).__name__}.compile() inside MPIStrategy's scope, "
            "but the model was created outside it: its variables are "
            "ordinary ones that the strategy cannot update. Create the model "
            "inside the scope too (`with strategy.scope(): model = "
            "build_model(); model.compile(...)`).")
      if not _is_multi_process(strategy) or tf.distribute.has_strategy():
        return original(self, *args, **kwargs)
      with strategy.scope():
        return original(self, *args, **kwargs)
    return compile

  wrap_model_compile(make)


def _is_multi_process(strategy):
  return mpi_world_size(strategy) > 1


def _local_value(strategy, value):
  """This rank's component of a distributed value (itself otherwise)."""
  if isinstance(value, tf.distribute.DistributedValues):
    return strategy.experimental_local_results(value)[0]
  return value


def patch_epoch_iterator():
  adapter_cls = _tfp.keras_tf_dataset_adapter.TFDatasetAdapter
  original_num_batches = adapter_cls.num_batches
  iterator_cls = _tfp.keras_trainer.TFEpochIterator
  original_init = iterator_cls.__init__

  def num_batches(self):
    if getattr(self, "_mpistrategy_count_unknown", False):
      return None
    return original_num_batches.fget(self)

  def __init__(self, *args, **kwargs):  # pylint: disable=invalid-name
    _refuse_a_generator(kwargs.get("x"), kwargs.get("distribute_strategy"))
    original_init(self, *args, **kwargs)
    distributed = getattr(self, "_distributed_dataset", None)
    adapter = getattr(self, "data_adapter", None)
    if (not isinstance(adapter, adapter_cls) and
        _is_multi_process(self._distribute_strategy)):  # pylint: disable=protected-access
      _check_same_input_everywhere(adapter)
    if (isinstance(adapter, adapter_cls) and
        getattr(distributed, "_cardinality", None) ==
        tf.data.UNKNOWN_CARDINALITY and
        adapter.num_batches is not None and
        _is_multi_process(self._distribute_strategy)):  # pylint: disable=protected-access
      adapter._mpistrategy_count_unknown = True  # pylint: disable=protected-access
      self._num_batches = None  # pylint: disable=protected-access
      if self.steps_per_epoch is None:
        # Each epoch now ends where the data does, by design: Keras' "Your
        # input ran out of data; interrupting training" would be wrong.
        self._interrupted_warning = lambda: None  # pylint: disable=protected-access

  adapter_cls.num_batches = property(num_batches,
                                     doc=original_num_batches.__doc__)
  iterator_cls.__init__ = __init__


def _check_same_input_everywhere(adapter):
  """Raises on every rank where the ranks' `x` or `batch_size` differ.

  Keras turns arrays (or a `PyDataset`) into a dataset whose batch size
  hides in a function, so `experimental_distribute_dataset` cannot compare
  it: a `batch_size` that depends on the rank, or arrays of another length
  on each rank, left the ranks in different steps until the stall timeout.

  Args:
    adapter: Keras' data adapter of this call's input.

  Raises:
    ValueError: where the ranks' batch sizes, numbers of batches or of rows
      differ.
  """
  from mpistrategy.ops import _naming  # pylint: disable=import-outside-toplevel
  from mpistrategy.ops import collectives  # pylint: disable=import-outside-toplevel

  def known(value):
    return -1 if value is None else int(value)

  # Rows: arrays of another length on one rank may still make as many
  # batches (128 and 100 rows of 32), and each rank then trained on its own.
  mine = [known(getattr(adapter, "batch_size", None)),
          known(getattr(adapter, "num_batches", None)),
          known(getattr(adapter, "_num_samples", None))]
  everyone = collectives.every_ranks_values(mine, "MPIStrategy/keras_input")
  if all(row == everyone[0] for row in everyone):
    return
  calls = _naming.entry_points()
  call = calls[-1] if calls else "Model.fit"

  def shown(value):
    return str(value) if value >= 0 else "unknown"

  shapes = "; ".join(
      f"rank {r}: batch_size {shown(b)}, {shown(n)} batches" +
      (f", {rows} rows" if rows >= 0 else "")
      for r, (b, n, rows) in enumerate(everyone))
  raise ValueError(
      f"{call}: the ranks' inputs differ ({shapes}). "
      "batch_size is the global batch and x the whole data, split among "
      "the ranks: give every rank the same. For data that differs per rank, "
      "pass a tf.data.Dataset sharded with ds.shard(mpistrategy.size(), "
      "mpistrategy.rank()), whose batch size is each rank's.")


def _refuse_a_generator(x, strategy):
  """Raises ValueError for a Python generator in fit/evaluate on N ranks."""
  if not isinstance(x, types.GeneratorType) or strategy is None or (
      not _is_multi_process(strategy)):
    return
  from mpistrategy.ops import _naming  # pylint: disable=import-outside-toplevel
  calls = _naming.entry_points()
  call = calls[-1] if calls else "Model.fit"
  if call == "Model.predict":
    return
  raise ValueError(
      f"mpistrategy: a Python generator as the data of {call} is not "
      f"supported with {_world_size()} ranks: Keras' generator adapter under "
      "a distribution strategy gives the ranks batches out of step, so rows "
      "would be missed or repeated without an error.  Pass a "
      "tf.data.Dataset (tf.data.Dataset.from_generator, for example) or a "
      "keras.utils.PyDataset instead")


# (module in _tf_private, class, label, methods) of the Keras/TF calls that
# communicate.
_ENTRY_POINTS = (
    ("keras_trainer", "TensorFlowTrainer", "Model",
     ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
      "predict_on_batch")),
    ("keras_model", "Model", "Model",
     ("save", "save_weights", "load_weights", "export")),
    ("tf_checkpoint", "Checkpoint", "Checkpoint",
     ("save", "write", "restore", "read")),
    ("checkpoint_management", "CheckpointManager",
     "CheckpointManager", ("save", "restore_or_initialize")),
)


# (call, the model's flag that stops it); the flag names the blocking join,
# which the other ranks' errors quote.
_FIT = ("Model.fit", "stop_training")
_EVALUATE = ("Model.evaluate", "stop_evaluating")
_PREDICT = ("Model.predict", "stop_predicting")


def patch_stop_training(rank):
  """Makes fit/evaluate/predict agree when a callback stops them (7. above)."""
  cls = _tfp.keras_callback_list.CallbackList

  def agree_after(method, loop, where):
    original = getattr(cls, method)

    def wrapper(self, step, logs=None):
      original(self, step, logs)
      _agree_to_stop(self.model, rank, loop, where % step)

    wrapper.__name__ = wrapper.__qualname__ = method
    wrapper.__doc__ = original.__doc__
    setattr(cls, method, wrapper)

  agree_after("on_train_batch_end", _FIT, "after batch %d")
  agree_after("on_epoch_end", _FIT, "at the end of epoch %d")
  agree_after("on_test_batch_end", _EVALUATE, "after batch %d")
  agree_after("on_predict_batch_end", _PREDICT, "after batch %d")


def _agree_to_stop(model, rank, loop, where):
  """Waits for every rank to stop the loop too, or raises naming the rule.

  Args:
    model: the model of the callbacks (may be None).
    rank: this rank.
    loop: `_FIT`, `_EVALUATE` or `_PREDICT`.
    where: the step at which this rank stops, for the message.

  Raises:
    tf.errors.FailedPreconditionError: other ranks went on.
  """
  call, flag = loop
  if not getattr(model, flag, False) or not _is_multi_process(
      getattr(model, "_distribute_strategy", None)):
    return
  from mpistrategy.ops import blocking_join  # pylint: disable=g-import-not-at-top
  try:
    # No timeout: ranks that go on reach the next step's collectives.
    blocking_join.join(
        f"{call} {flag} (a rank stopped {call}: every rank must set "
        f"model.{flag} at the same step)", None)
  except tf.errors.FailedPreconditionError as e:
    raise tf.errors.FailedPreconditionError(
        None, None,
        f"mpistrategy: rank {rank} set model.{flag} {where}, but other ranks "
        f"went on. Every rank must stop {call} at the same step: decide from "
        "the logs Keras passes to callbacks (global values, as EarlyStopping "
        "and TerminateOnNaN do) or from values every rank computes alike, "
        "not from this rank's own clock or data.\n"
        f"(engine: {e.message})") from None


def _rule_note(entry, rank, error):
  # A stall timeout (here or on the rank whose abort this is) follows a
  # stall message naming the missing ranks; otherwise the abort names the
  # rank that stopped.
  if isinstance(error, tf.errors.DeadlineExceededError) or (
      "DeadlineExceededError" in (getattr(error, "message", "") or "")):
    where = "see the stall message above for the ranks that were missing"
  else:
    where = "the error above names the rank that stopped"
  return (f"mpistrategy: this error was raised in {entry}() on rank {rank}: "
          "its collectives were not joined by every rank.  Every rank must "
          "make the same Keras/TF calls that communicate (fit, evaluate, "
          f"predict, save, ...), also when only rank 0 needs the result; "
          f"{where}.")


# The engine's error where another rank's uncaught exception stopped the
# job (runtime._abort_on_exception): "... stopped: rank 2 (host h, pid p)
# raised RuntimeError: ...", unless that exception was itself a stall
# timeout or abort of a collective.
_PEER_RAISED = re.compile(r"stopped: rank \d+ (\([^)]*\) )?raised "
                          r"(?!DeadlineExceededError|AbortedError)")


def _peer_raised(error):
  """True where `error` only reports another rank's own exception.

  Not a broken rule then: every rank made the same calls until one raised.
  """
  return bool(_PEER_RAISED.search(getattr(error, "message", "") or ""))


_TRAINED_ALONE = set()


def _warn_if_trained_alone(model, rank):
  """Warns once where `fit` trains a model that no MPIStrategy distributes.

  A model built and compiled outside `strategy.scope()` trains on each
  rank's own data with nothing averaged, as in one process per rank; the
  ranks' weights part ways without an error.
  """
  if mpi_world_size(getattr(model, "distribute_strategy", None)) > 1:
    return
  name = getattr(model, "name", type(model).__name__)
  if name in _TRAINED_ALONE:
    return
  _TRAINED_ALONE.add(name)
  if rank == 0:
    tf.get_logger().warning(
        "MPIStrategy: Model.fit of model %r, which was built outside "
        "strategy.scope(), trains it on each rank alone: no gradient is "
        "averaged across ranks, and their weights part ways. Build and "
        "compile the model inside `with strategy.scope():`.", name)


def patch_entry_points(rank):
  from mpistrategy.ops import _naming
  for module_name, class_name, label, methods in _ENTRY_POINTS:
    cls = getattr(getattr(_tfp, module_name), class_name)
    for method in methods:
      original = cls.__dict__.get(method)
      if original is None:
        continue
      entry = f"{label}.{method}"

      def wrapper(self, *args, __original=original, __entry=entry, **kwargs):
        outermost = not _naming.entry_points()
        if outermost and __entry == "Model.fit" and _world_size() > 1:
          _warn_if_trained_alone(self, rank)
        with _naming.entry_point(__entry):
          try:
            return __original(self, *args, **kwargs)
          except (tf.errors.DeadlineExceededError,
                  tf.errors.AbortedError) as e:
            if outermost and _world_size() > 1 and not getattr(
                e, "_mpistrategy_noted", False) and not _peer_raised(e):
              e._mpistrategy_noted = True  # pylint: disable=protected-access
              e.add_note(_rule_note(__entry, rank, e))
            raise
          finally:
            if outermost and __entry == "Model.fit":
              preemption.release_fit_watches()

      wrapper.__doc__ = original.__doc__
      wrapper.__name__ = method
      wrapper.__qualname__ = f"{class_name}.{method}"
      wrapper.__wrapped__ = original
      setattr(cls, method, wrapper)


def patch_auto_jit_compile_for_horovod():
  """`compile(jit_compile="auto")` is off for a `hvd.DistributedOptimizer`.

  Keras 3 resolves "auto" to XLA where a GPU is present and no tf.distribute
  strategy is set, which is how Horovod scripts run; the optimizer's
  collectives have no XLA kernels, so such a script failed at its first
  step ("No registered 'MpiStrategyGroupedAllreduce' OpKernel for
  XLA_GPU_JIT devices").  An explicit `jit_compile=True` is left as asked.
  """
  def make(original):
    signature = inspect.signature(original)

    def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
      bound = signature.bind_partial(self, *args, **kwargs)
      arguments = bound.arguments
      # The mixin's mark (horovod/tensorflow/gradients.py), without
      # importing the Horovod layer here.
      if (arguments.get("jit_compile", "auto") == "auto" and
          hasattr(arguments.get("optimizer"), "_hvd_configure")):
        arguments["jit_compile"] = False
      return original(*bound.args, **bound.kwargs)
    return compile

  wrap_model_compile(make)
