"""Horovod features mpistrategy.horovod does not provide.

Each raises `NotImplementedError` naming the feature and what to use
instead when it is called (or, for classes, instantiated); nothing is a
silent no-op.
"""

import types

__all__ = [
    "add_process_set", "remove_process_set", "broadcast_global_variables",
    "BroadcastGlobalVariablesHook", "SyncBatchNormalization", "elastic",
]


def _refuse(feature, instead):
  raise NotImplementedError(
      f"{feature} is not provided by mpistrategy.horovod; {instead}")


def add_process_set(process_set):
  """Not provided: process sets (collectives on a subset of the ranks)."""
  del process_set
  _refuse("hvd.add_process_set (process sets)",
          "every collective runs on all ranks")


def remove_process_set(process_set):
  """Not provided: process sets."""
  del process_set
  _refuse("hvd.remove_process_set (process sets)",
          "every collective runs on all ranks")


def broadcast_global_variables(root_rank):
  """Not provided: TF1 global-variable collections do not exist in TF2."""
  del root_rank
  _refuse("hvd.broadcast_global_variables (TF1 global variables)",
          "use hvd.broadcast_variables(model.variables, root_rank=0) and "
          "hvd.broadcast_variables(optimizer.variables, root_rank=0), or "
          "hvd.callbacks.BroadcastGlobalVariablesCallback(0) with Keras")


class BroadcastGlobalVariablesHook:
  """Not provided: a TF1 `SessionRunHook` (TF 2.16+ has no Estimator)."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    _refuse("hvd.BroadcastGlobalVariablesHook (a TF1 SessionRunHook for "
            "tf.estimator and MonitoredTrainingSession, which TensorFlow 2 "
            "no longer has)",
            "after the first training step, call "
            "hvd.broadcast_variables(model.variables, root_rank=0) and "
            "hvd.broadcast_variables(optimizer.variables, root_rank=0), or "
            "use hvd.callbacks.BroadcastGlobalVariablesCallback(0) with Keras")


class SyncBatchNormalization:
  """Not provided: Horovod's synchronized batch normalization layer."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    _refuse("hvd.SyncBatchNormalization",
            "use keras.layers.BatchNormalization(synchronized=True) under "
            "mpistrategy.MPIStrategy (its statistics are all-reduced)")


_ELASTIC_INSTEAD = (
    "mpistrategy runs a fixed set of ranks: save checkpoints "
    "(BackupAndRestore, or tf.train.CheckpointManager) and let "
    "`mpistrategyrun --restarts N` (with `--min-np M` to go on without a "
    "lost host) restart the job from them; see the README's \"Preemption and "
    "restarts\"")


def refuse_elastic(feature):
  """Raises NotImplementedError for `feature`, a part of elastic training."""
  _refuse(f"{feature} (elastic training)", _ELASTIC_INSTEAD)


def _elastic_refusal(name):
  def refuse(*args, **kwargs):
    del args, kwargs
    refuse_elastic(f"hvd.elastic.{name}")
  refuse.__name__ = name
  return refuse


# hvd.elastic.run, hvd.elastic.TensorFlowKerasState, ...: every name refuses.
elastic = types.SimpleNamespace(**{
    name: _elastic_refusal(name) for name in (
        "run", "State", "ObjectState", "TensorFlowState",
        "TensorFlowKerasState", "KerasState", "CommitStateCallback",
        "UpdateBatchStateCallback", "UpdateEpochStateCallback")})
