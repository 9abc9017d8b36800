"""Keras 2 spellings that Horovod scripts use, accepted under Keras 3.

Applied by `mpistrategy.compat.install_for_horovod()`, which the
Horovod layer calls when it is imported: `optimizer.variables` of Keras 3
optimizers is also callable (`opt.variables()`, Keras 2, used by Horovod's
TF2 examples to broadcast the optimizer state, returns the same list as
`opt.variables`; the value is still a `list`), and `Model.compile` accepts
`experimental_run_tf_function`.
"""

import keras

from mpistrategy.compat import keras as compat_keras


class _CallableList(list):
  """A list that returns itself when called (Keras 2's `variables()`)."""

  def __call__(self):
    return self


def _find_property(cls, name):
  for klass in cls.__mro__:
    value = klass.__dict__.get(name)
    if isinstance(value, property):
      return klass, value
  return None, None


def make_optimizer_variables_callable():
  """Patches the Keras optimizer base class's `variables`."""
  klass, prop = _find_property(keras.optimizers.Optimizer, "variables")
  if prop is None:
    return
  original = prop.fget

  def variables(self):
    return _CallableList(original(self))

  variables.__doc__ = original.__doc__
  setattr(klass, "variables", property(variables))


def accept_experimental_run_tf_function():
  """`Model.compile(experimental_run_tf_function=...)` (Keras 2;
  Horovod's Keras examples pass False) is accepted and ignored: Keras 3
  always applies gradients through the optimizer, so a
  `hvd.DistributedOptimizer` is always used."""
  def make(original):
    def compile(self, *args, experimental_run_tf_function=None, **kwargs):  # pylint: disable=redefined-builtin
      del experimental_run_tf_function
      return original(self, *args, **kwargs)
    return compile

  compat_keras.wrap_model_compile(make)
