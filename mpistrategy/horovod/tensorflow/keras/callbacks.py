"""Horovod's Keras callbacks (`hvd.callbacks.*`) for Keras 3.

* `BroadcastGlobalVariablesCallback(root_rank)`: after the first training
  batch (when the optimizer's variables exist), every rank takes the
  model's and the optimizer's variables from `root_rank`.
* `MetricAverageCallback()`: at the end of every epoch, averages the
  numeric entries of `logs` across ranks (put it before callbacks that read
  the metrics, such as ReduceLROnPlateau, TensorBoard, ModelCheckpoint).
* `LearningRateScheduleCallback(initial_lr, multiplier, ...)` and
  `LearningRateWarmupCallback(initial_lr, warmup_epochs, ...)`: set the
  optimizer's learning rate per epoch or per batch, as Horovod's do.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

from mpistrategy import ops
from mpistrategy.horovod.tensorflow import basics
from mpistrategy.horovod.tensorflow import functions

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]


def _check_device(device, fn):
  if device:
    raise NotImplementedError(
        f"{fn}(device={device!r}) is not provided by mpistrategy.horovod; "
        "leave device out")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
  """Broadcasts the model's and optimizer's variables from `root_rank`.

  Runs once, at the end of the first training batch, as Horovod's does
  (the optimizer creates its variables in the first step).

  Args:
    root_rank: the rank whose values every rank takes.
    device: must be empty.
    local_variables: a variable or a collection of variables that keep
      each rank's own value (Horovod 0.28); `register_local_var` adds more.

  Raises:
    ValueError: an entry of `local_variables` is not a variable.
  """

  def __init__(self, root_rank, device="", local_variables=None):
    super().__init__()
    _check_device(device, "BroadcastGlobalVariablesCallback")
    self.root_rank = root_rank
    self.broadcast_done = False
    self._local_ids = set()
    if local_variables is None:
      local_variables = []
    elif _is_variable(local_variables):
      local_variables = [local_variables]
    local_variables = list(local_variables)
    if not all(_is_variable(v) for v in local_variables):
      raise ValueError("BroadcastGlobalVariablesCallback: every entry of "
                       "`local_variables` must be a variable (tf.Variable "
                       "or keras.Variable)")
    for v in local_variables:
      self.register_local_var(v)

  def register_local_var(self, var):
    """Keeps `var` out of the broadcast: each rank keeps its own value."""
    self._local_ids.add(id(var))

  def _shared(self, variables):
    return [v for v in variables if id(v) not in self._local_ids]

  def on_train_batch_end(self, batch, logs=None):
    if self.broadcast_done:
      return
    functions.broadcast_variables(self._shared(self.model.variables),
                                  self.root_rank)
    optimizer = getattr(self.model, "optimizer", None)
    if optimizer is not None:
      functions.broadcast_variables(self._shared(list(optimizer.variables)),
                                    self.root_rank)
    self.broadcast_done = True


def _is_variable(value):
  return isinstance(value, (tf.Variable, keras.Variable))


class MetricAverageCallback(keras.callbacks.Callback):
  """Averages the epoch's metrics (the numeric `logs` values) across ranks.

  Args:
    device: must be empty.
  """

  def __init__(self, device=""):
    super().__init__()
    _check_device(device, "MetricAverageCallback")

  def on_epoch_end(self, epoch, logs=None):
    if not logs:
      return
    # Every rank has the same keys (same model and compile()); sorted so the
    # one grouped allreduce lines up.
    keys = sorted(k for k, v in logs.items()
                  if isinstance(v, (int, float, np.number, np.ndarray,
                                    tf.Tensor)) and np.size(v) == 1)
    if not keys:
      return
    values = tf.constant([float(np.asarray(logs[k]).reshape(())) for k in keys],
                         tf.float64)
    averaged = ops.allreduce(values, op=ops.Average,
                             name="hvd.MetricAverageCallback").numpy()
    for k, v in zip(keys, averaged):
      logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
  """Sets the learning rate to `initial_lr * multiplier(epoch)`.

  Active from `start_epoch` (inclusive) to `end_epoch` (exclusive).  With
  `staircase` the rate changes at epoch starts; otherwise at every batch,
  with the fractional epoch `epoch + batch / steps_per_epoch`.  A constant
  `multiplier` m is exponential decay from `start_epoch`:
  `initial_lr * m ** (epoch - start_epoch)`, as in Horovod since 0.23.

  Args:
    initial_lr: the base learning rate.
    multiplier: a float (see above), or a function of the (fractional)
      epoch.
    start_epoch: first epoch (inclusive).
    end_epoch: last epoch (exclusive), None for no end.
    staircase: change once per epoch (True) or every batch.
    momentum_correction: Horovod rescales momentum while the rate changes;
      Keras 3 optimizers compile their momentum as a constant, so this is
      not done: a warning says so when the optimizer has a momentum.
    steps_per_epoch: batches per epoch; default: from `fit`'s params.
    verbose: unused here (as Horovod's schedule callback).
  """

  def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
               staircase=True, momentum_correction=True, steps_per_epoch=None,
               verbose=0):
    super().__init__()
    if initial_lr is None:
      raise ValueError("LearningRateScheduleCallback: initial_lr is required "
                       "(as in Horovod >= 0.21)")
    self.initial_lr = float(initial_lr)
    self.start_epoch = start_epoch
    self.end_epoch = end_epoch
    self.staircase = staircase
    self.momentum_correction = momentum_correction
    self.steps_per_epoch = steps_per_epoch
    self.verbose = verbose
    self.current_epoch = None
    if not callable(multiplier):
      base = float(multiplier)
      self.multiplier = lambda epoch: base ** (epoch - start_epoch)
    else:
      self.multiplier = multiplier

  def _learning_rate_variable(self):
    lr = self.model.optimizer.learning_rate
    if not hasattr(lr, "assign"):
      raise ValueError(
          f"{type(self).__name__}: the optimizer's learning rate is "
          f"{type(lr).__name__}, not a variable (a LearningRateSchedule?); "
          "these callbacks need a constant learning rate to set")
    return lr

  def on_train_begin(self, logs=None):
    self._learning_rate_variable()
    if self.steps_per_epoch is None:
      self.steps_per_epoch = (self.params or {}).get("steps")
    if not self.staircase and not self.steps_per_epoch:
      raise ValueError(f"{type(self).__name__}: could not find the number "
                       "of steps per epoch; pass steps_per_epoch")
    momentum = getattr(self.model.optimizer, "momentum", None)
    if self.momentum_correction and isinstance(momentum, (int, float)) and (
        momentum):
      warnings.warn(
          f"{type(self).__name__}: momentum_correction is not applied by "
          "mpistrategy.horovod (Keras 3 optimizers compile their momentum as "
          "a constant); pass momentum_correction=False to silence this",
          stacklevel=2)

  def _in_range(self, epoch):
    return epoch >= self.start_epoch and (self.end_epoch is None or
                                          epoch < self.end_epoch)

  def _set(self, epoch):
    self._learning_rate_variable().assign(
        self.initial_lr * self.multiplier(epoch))

  def on_epoch_begin(self, epoch, logs=None):
    self.current_epoch = epoch
    if self.staircase and self._in_range(epoch):
      self._set(epoch)

  def on_train_batch_begin(self, batch, logs=None):
    epoch = self.current_epoch
    if self.staircase or epoch is None or not self._in_range(epoch):
      return
    self._set(epoch + float(batch) / self.steps_per_epoch)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      logs["lr"] = float(np.asarray(self._learning_rate_variable().numpy()))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
  """Ramps the learning rate from `initial_lr / size()` to `initial_lr`.

  Over `warmup_epochs` (per batch): `lr = initial_lr / size * (e *
  (size - 1) / warmup_epochs + 1)`, as in Goyal et al. and Horovod, where
  `e = epoch + (batch + 1) / steps_per_epoch`: Horovod counts each batch as
  done, so that the last batch of the warmup trains with `initial_lr`.

  Args:
    initial_lr: the learning rate after the warmup (already scaled by
      size(), as Horovod's examples do).
    warmup_epochs: length of the ramp.
    momentum_correction: see `LearningRateScheduleCallback`.
    steps_per_epoch: batches per epoch; default from `fit`.
    verbose: 1 prints the rate reached when the warmup ends, on rank 0.
  """

  def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
               steps_per_epoch=None, verbose=0):
    world = basics.size()

    def multiplier(epoch):
      epoch += 1.0 / self.steps_per_epoch  # this batch counted as done
      return 1.0 / world * (epoch * (world - 1) / warmup_epochs + 1)

    super().__init__(initial_lr, multiplier, start_epoch=0,
                     end_epoch=warmup_epochs, staircase=False,
                     momentum_correction=momentum_correction,
                     steps_per_epoch=steps_per_epoch, verbose=verbose)
    self.warmup_epochs = warmup_epochs

  def on_epoch_end(self, epoch, logs=None):
    super().on_epoch_end(epoch, logs)
    if (epoch == self.end_epoch - 1 and self.verbose > 0 and
        basics.rank() == 0):
      lr = float(np.asarray(self._learning_rate_variable().numpy()))
      print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
            f"{lr:g}.")
