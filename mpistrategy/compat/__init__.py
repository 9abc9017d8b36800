"""Every patch mpistrategy applies to Keras and TensorFlow, in one inventory.

`install(rank, size)` (called by `MPIStrategy.__init__`) applies the patches
of `_PATCHES` below, each once per process: the names of the applied ones
are recorded in `_applied`, the one idempotence scheme (the patched
functions carry no marks of their own).  The Horovod layer calls
`install_for_horovod()` for the two Keras 2 spellings its users write and
the loss-scale patch, and `install_saving_for_horovod(rank, size)` at
`hvd.init()` for atomic saves.

Each entry says what upstream behaviour it changes and what upstream change
would let it go; docs/DESIGN.md has the same inventory as a table.  The
patches name private Keras/TF modules through `mpistrategy._tf_private`, so
they must be checked again whenever the TensorFlow or Keras pin moves
(`mpistrategy/version.py`).

The patch bodies live where the behaviour they implement is described:
`compat/keras.py` (training), `mpistrategy/checkpoint.py` (saving and
restoring), `compat/keras2_spellings.py` (Horovod scripts).  None of them
imports mpistrategy/strategy.py: they recognise an `MPIStrategy` by its
`_is_mpi_strategy` class attribute.
"""

import threading

from mpistrategy import checkpoint
from mpistrategy import preemption
from mpistrategy.compat import keras
from mpistrategy.compat import keras2_spellings

# (name, multi-process only, apply(rank)), applied in this order: the
# checkpoint patches wrap the entry points of `keras.entry_points`.
# Keras 3.15 LossScaleOptimizer._tf_apply decides "finite" from the local,
# not yet all-reduced gradients and only all-reduces them in the "apply"
# branch: ranks that disagree hang.  Removed when Keras reduces the flag
# across replicas (or tests finiteness after the all-reduce).  The Horovod
# layer needs it too (hvd.DistributedOptimizer reduces in `apply`).
_LOSS_SCALE_PATCH = ("keras.LossScaleOptimizer.check_finite", False,
                     lambda rank: keras.patch_loss_scale_optimizer())

_PATCHES = (
    _LOSS_SCALE_PATCH,
    # Keras 3 makes BatchNormalization's moving statistics ordinary
    # non-trainable weights (Keras 2: sync-on-read, MEAN), so each rank's copy
    # drifts.  Removed when Keras 3 aggregates them across replicas again.
    # Also `_moments`: a rank with an empty batch gets NaN moments, which
    # its zero gradients multiply into NaN (removed when Keras guards it).
    ("keras.BatchNormalization.call+_moments", False,
     lambda rank: keras.patch_batch_normalization()),
    # TensorFlowTrainer._maybe_symbolic_build all-reduces the first
    # distributed batch only to learn its shapes, which fails when the
    # ranks' shards differ in shape.  Removed when Keras builds from one
    # replica's local value (`experimental_local_results`).
    ("keras.TensorFlowTrainer._maybe_symbolic_build", False,
     lambda rank: keras.patch_symbolic_build()),
    # TFEpochIterator sizes an epoch by the local dataset's cardinality, which
    # differs across ranks for datasets sharded per rank, and is 1/N of the
    # batches of a dataset that is not sharded (AutoShardPolicy.OFF).
    # Removed when Keras uses the distributed dataset's (agreed) cardinality.
    ("keras.TFEpochIterator.__init__+TFDatasetAdapter.num_batches", False,
     lambda rank: keras.patch_epoch_iterator()),
    # Keras 3's Trainer.compile creates the loss tracker and an optimizer
    # given by name without entering the model's strategy (Keras 2 did), so
    # outside the scope they are per-rank variables.  Removed when Keras
    # compiles in `self.distribute_strategy.scope()`.
    ("keras.Trainer.compile", False, lambda rank: keras.patch_compile()),
    # Not a Keras/TF defect: wraps the Keras/TF calls that communicate
    # (Model.fit, ..., Checkpoint.save, ...) so their collectives are named
    # after the call and a failure names the rule.  Would go if Keras/TF
    # offered a per-call hook around these methods.
    ("keras+tf.entry_points", False,
     lambda rank: keras.patch_entry_points(rank)),
    # Not a Keras/TF defect: a callback that stops fit (evaluate, predict)
    # on some ranks only leaves the others waiting in the next step for
    # ever; the stopping rank waits in a blocking join instead, which fails
    # on every rank where the others went on.
    ("keras.CallbackList.stop_training", True,
     lambda rank: keras.patch_stop_training(rank)),
    # Keras' ProgbarLogger prints on every process (N interleaved copies of
    # the same global numbers).  Removed if Keras printed on the chief only
    # under a multi-worker strategy.
    ("keras.ProgbarLogger.set_params", True,
     lambda rank: keras.patch_progbar(rank)),
    # tf.train.Checkpoint/CheckpointManager write the user's path on every
    # worker (MultiWorkerMirroredStrategy expects each worker to pick its own
    # path), non-atomically, and restore each worker's own files.  Removed
    # when TF writes on the chief only (others to temporary paths),
    # atomically, and restores the chief's state on every worker.
    ("tf.train.Checkpoint+CheckpointManager", True,
     lambda rank: checkpoint.patch_tf_checkpoint()),
    # tf.saved_model.save (and Model.export) writes on every worker, not
    # atomically; load reads the worker's own path.  Same upstream change.
    ("tf.saved_model.save+load", True,
     lambda rank: checkpoint.patch_saved_model()),
    # TF's PreemptionCheckpointHandler agrees through a coordination service
    # MPIStrategy does not run, and without one (single-worker mode) each
    # rank acts on its own signal and the saving rank hangs.  Here it runs in
    # single-worker mode and the ranks agree over MPI at each run().
    # Removed if TF agreed through the strategy's collectives instead of its
    # coordination service.
    ("tf.PreemptionCheckpointHandler", False,
     lambda rank: preemption.patch_preemption_checkpoint_handler()),
    # Keras 3's BackupAndRestore ignores preemption signals and resumes at
    # the start of the saved epoch (tf.keras 2 resumed at the saved batch).
    # Removed when Keras saves on a preemption signal and skips the batches
    # a backup has seen.  Applied before the next entry, which wraps it.
    ("keras.BackupAndRestore.preemption", False,
     lambda rank: preemption.patch_backup_and_restore()),
    # Keras 3's BackupAndRestore, ModelCheckpoint, TensorBoard and
    # CSVLogger write on every worker (N event files, N copies of each CSV
    # row), and BackupAndRestore resumes from each worker's own files
    # (tf.keras 2 had distributed_file_utils for this).  Removed when Keras
    # 3 writes on the chief only and resumes every worker from the chief's
    # backup.
    ("keras.BackupAndRestore+ModelCheckpoint+TensorBoard+CSVLogger", True,
     lambda rank: checkpoint.patch_keras_callbacks()),
    # Keras 3's Model.save/save_weights/export/load_weights and
    # keras.saving.save_model/load_model: the same, for direct calls.
    ("keras.Model.save+load", True,
     lambda rank: checkpoint.patch_keras_model_saving()),
)

# Keras 2 spellings of Horovod scripts (`opt.variables()`,
# `compile(experimental_run_tf_function=...)`); Keras 3 dropped them.  Kept
# for as long as the Horovod layer accepts Keras 2 scripts unchanged.
_KERAS2_SPELLINGS = (
    ("keras.Optimizer.variables()", False,
     lambda rank: keras2_spellings.make_optimizer_variables_callable()),
    ("keras.Model.compile(experimental_run_tf_function)", False,
     lambda rank: keras2_spellings.accept_experimental_run_tf_function()),
)

# Keras 3 resolves compile(jit_compile="auto") to XLA on a GPU without a
# strategy (Horovod scripts), and the collectives a hvd.DistributedOptimizer
# runs have no XLA kernels.  Applied before the Keras 2 spelling, which
# wraps it.  Removed if the collectives get XLA kernels.
_HOROVOD_AUTO_JIT_PATCH = (
    "keras.Model.compile(jit_compile='auto', hvd optimizer)", False,
    lambda rank: keras.patch_auto_jit_compile_for_horovod())

_lock = threading.Lock()
_applied = set()


def _apply(patches, rank, size):
  with _lock:
    for name, multi_process_only, apply in patches:
      if name in _applied or (multi_process_only and size <= 1):
        continue
      apply(rank)
      _applied.add(name)


def install(rank, size):
  """Applies the Keras/TF patches that `MPIStrategy` needs (idempotent).

  Args:
    rank: this process' MPI rank.
    size: the MPI world size; the patches marked multi-process only wait for
      a call with a size > 1.
  """
  keras.set_world(size)
  checkpoint.set_world(rank, size)
  _apply(_PATCHES, rank, size)


def install_for_horovod():
  """Applies what `mpistrategy.horovod` needs (idempotent): XLA off by
  default for its optimizer, the Keras 2 spellings of Horovod scripts, and
  the loss scale's agreement across ranks.
  """
  _apply((_HOROVOD_AUTO_JIT_PATCH,) + _KERAS2_SPELLINGS + (_LOSS_SCALE_PATCH,),
         rank=0, size=1)


# What the Horovod layer alone takes of `_PATCHES` once `hvd.init()` knows
# the world: atomic writes of whatever a rank saves (Horovod's own writes
# are plain, so a rank killed or a disk filled during a save destroys the
# last good file).  Not the rank-0 rule: Horovod scripts save and restore
# on the ranks they choose.
_HOROVOD_SAVING = ("tf.train.Checkpoint+CheckpointManager",
                   "tf.saved_model.save+load", "keras.Model.save+load")


def install_saving_for_horovod(rank, size):
  """Makes saves atomic on every rank of a Horovod-layer job (idempotent).

  Each rank writes the paths it saves itself, as under Horovod; under an
  `MPIStrategy` (before or after) the strategy's rule applies instead.

  Args:
    rank: this process' MPI rank.
    size: the MPI world size.
  """
  checkpoint.set_world_for_horovod(rank, size)
  _apply([p for p in _PATCHES if p[0] in _HOROVOD_SAVING], rank, size)


def applied():
  """Returns the names of the patches applied in this process (a set)."""
  with _lock:
    return set(_applied)
