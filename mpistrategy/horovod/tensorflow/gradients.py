"""DistributedGradientTape and DistributedOptimizer (Keras 3 optimizers).

Both average the gradients across ranks before they are used, with
Horovod's options: `compression`, `sparse_as_dense`, `op`,
`gradient_predivide_factor`, `num_groups`/`groups` and, for the optimizer,
`backward_passes_per_step` with `average_aggregated_gradients`; variables
registered as local keep their own gradient (divided by the number of ranks
when `scale_local_gradients`, as Horovod does).
"""

import keras
import tensorflow as tf

from mpistrategy.horovod.tensorflow import basics
from mpistrategy.horovod.tensorflow import functions

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape",
           "DistributedOptimizer", "PartialDistributedOptimizer",
           "wrap_optimizer_in_place"]


def _layer_variables(layers, fn):
  if layers is None:
    return []
  if isinstance(layers, keras.layers.Layer):
    layers = [layers]
  out = []
  for layer in layers:
    if not isinstance(layer, keras.layers.Layer):
      raise TypeError(f"{fn}: local_layers must be Keras layers, got "
                      f"{type(layer).__name__}")
    out.extend(layer.trainable_weights)
  return out


def _key(source):
  """A hashable identity of a variable or tensor (Keras 3 variables have no
  `ref()`)."""
  return source.ref() if hasattr(source, "ref") else ("id", id(source))


class _GradientReducer:
  """Averages (or sums) a list of gradients across ranks, Horovod-style."""

  def __init__(self, fn, device_dense, device_sparse, compression,
               sparse_as_dense, op, gradient_predivide_factor, num_groups,
               groups, process_set, scale_local_gradients):
    basics.check_initialized()
    basics.check_process_set(process_set, fn)
    functions._check_device(device_dense, "device_dense", fn)  # pylint: disable=protected-access
    functions._check_device(device_sparse, "device_sparse", fn)  # pylint: disable=protected-access
    self.fn = fn
    self.op = functions._resolve_op(op, None, fn)  # pylint: disable=protected-access
    self.compression = functions._compression(compression, fn)  # pylint: disable=protected-access
    self.sparse_as_dense = bool(sparse_as_dense)
    if gradient_predivide_factor != 1.0 and self.op != functions.Average:
      raise ValueError(f"{fn}: gradient_predivide_factor needs op=hvd.Average "
                       f"(got op={self.op!r})")
    self.predivide = float(gradient_predivide_factor)
    if not isinstance(num_groups, int) or num_groups < 0:
      raise ValueError(f"{fn}: num_groups must be an int >= 0, got "
                       f"{num_groups!r}")
    if num_groups and groups is not None:
      raise ValueError(f"{fn}: give num_groups or groups, not both")
    self.num_groups = num_groups
    self.group_of = None
    if groups is not None:
      if isinstance(groups, int):
        self.num_groups = groups
      else:
        self.group_of = {}
        for g, group in enumerate(groups):
          for v in group:
            self.group_of[_key(v)] = g
    self.scale_local_gradients = bool(scale_local_gradients)
    self.local_refs = set()

  def register_local(self, source):
    self.local_refs.add(_key(source))

  def _groups(self, indices, sources):
    """Splits the indices of the dense gradients into allreduce groups."""
    if self.group_of is not None:
      by_group = {}
      extra = []
      for i in indices:
        g = (self.group_of.get(_key(sources[i])) if sources[i] is not None
             else None)
        if g is None:
          extra.append([i])  # not in any group: reduced on its own
        else:
          by_group.setdefault(g, []).append(i)
      return [by_group[g] for g in sorted(by_group)] + extra
    if self.num_groups and len(indices) > 1:
      n = min(self.num_groups, len(indices))
      bounds = [len(indices) * k // n for k in range(n + 1)]
      return [indices[bounds[k]:bounds[k + 1]] for k in range(n)]
    return [indices] if indices else []

  def __call__(self, grads, sources):
    """Returns the reduced `grads` (a list; None stays None)."""
    grads = list(grads)
    sources = list(sources) if sources is not None else [None] * len(grads)
    if self.predivide != 1.0:
      op, pre, post = functions.Sum, 1.0 / self.predivide, (
          self.predivide / basics.size())
    else:
      op, pre, post = self.op, 1.0, 1.0
    out = list(grads)
    dense = []
    for i, (g, s) in enumerate(zip(grads, sources)):
      if g is None:
        continue
      if s is not None and _key(s) in self.local_refs:
        if self.scale_local_gradients:
          out[i] = g / tf.cast(basics.size(), g.dtype)
        continue
      if isinstance(g, tf.IndexedSlices):
        if self.sparse_as_dense:
          grads[i] = tf.convert_to_tensor(g)
        else:
          reduced = functions.allreduce(g, op=op, compression=self.compression)
          if post != 1.0 or pre != 1.0:
            reduced = tf.IndexedSlices(reduced.values * (pre * post),
                                       reduced.indices, reduced.dense_shape)
          out[i] = reduced
          continue
      dense.append(i)
    for group in self._groups(dense, sources):
      reduced = functions.grouped_allreduce(
          [grads[i] for i in group], op=op, compression=self.compression,
          prescale_factor=pre, postscale_factor=post)
      for i, r in zip(group, reduced):
        out[i] = r
    return out


class _DistributedGradientTape(tf.GradientTape):
  """A `tf.GradientTape` whose `gradient` reduces across ranks.

  Wraps (and delegates everything to) the tape it was made from, so it can
  be created inside or after the tape's `with` block.
  """

  def __init__(self, tape, reducer):  # pylint: disable=super-init-not-called
    # Not tf.GradientTape.__init__: all state lives in the wrapped tape.
    self._hvd_tape = tape
    self._hvd_reducer = reducer

  def __getattr__(self, name):
    if name.startswith("_hvd_"):
      raise AttributeError(name)
    return getattr(self._hvd_tape, name)

  def __enter__(self):
    self._hvd_tape.__enter__()
    return self

  def __exit__(self, typ, value, traceback):
    return self._hvd_tape.__exit__(typ, value, traceback)

  def watch(self, tensor):
    return self._hvd_tape.watch(tensor)

  def stop_recording(self):
    return self._hvd_tape.stop_recording()

  def reset(self):
    return self._hvd_tape.reset()

  def watched_variables(self):
    return self._hvd_tape.watched_variables()

  def jacobian(self, *args, **kwargs):
    return self._hvd_tape.jacobian(*args, **kwargs)

  def batch_jacobian(self, *args, **kwargs):
    return self._hvd_tape.batch_jacobian(*args, **kwargs)

  def register_local_source(self, source):
    """Keeps `source`'s gradient local (not reduced across ranks)."""
    self._hvd_reducer.register_local(source)

  def gradient(self, target, sources, output_gradients=None,
               unconnected_gradients=tf.UnconnectedGradients.NONE,
               use_generic_names=False):
    """`tf.GradientTape.gradient`, then the reduction across ranks."""
    del use_generic_names
    grads = self._hvd_tape.gradient(
        target, sources, output_gradients=output_gradients,
        unconnected_gradients=unconnected_gradients)
    flat_sources = tf.nest.flatten(sources)
    flat_grads = tf.nest.flatten(grads)
    reduced = self._hvd_reducer(flat_grads, flat_sources)
    return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",  # pylint: disable=invalid-name
                            compression=functions.Compression.none,
                            sparse_as_dense=False, op=functions.Average,
                            gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=None,
                            scale_local_gradients=True):
  """Wraps a `tf.GradientTape`: `gradient()` averages across ranks.

  Args:
    gradtape: the `tf.GradientTape` that recorded the forward pass.
    device_dense: must be empty.
    device_sparse: must be empty.
    compression: `hvd.Compression.none` (default) or `.fp16`.
    sparse_as_dense: reduce `tf.IndexedSlices` gradients as dense tensors
      (else their rows are allgathered).
    op: `hvd.Average` (default) or `hvd.Sum` (Min/Max/Product allowed).
    gradient_predivide_factor: divides by this before the sum and by
      size()/factor after (op=Average only).
    num_groups: split the dense gradients into this many allreduce groups
      (0: one group).
    groups: list of lists of variables reduced together, or an int (as
      num_groups).
    process_set: only the global process set.
    scale_local_gradients: divide the gradients of local sources (see
      `register_local_source`) by size().

  Returns:
    A tape (an instance of `tf.GradientTape`) whose `gradient` reduces.
  """
  reducer = _GradientReducer(
      "hvd.DistributedGradientTape", device_dense, device_sparse, compression,
      sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
      process_set, scale_local_gradients)
  if not isinstance(gradtape, tf.GradientTape):
    raise TypeError("hvd.DistributedGradientTape: expects a tf.GradientTape, "
                    f"got {type(gradtape).__name__}")
  return _DistributedGradientTape(gradtape, reducer)


def PartialDistributedGradientTape(gradtape, device_dense="",  # pylint: disable=invalid-name
                                   device_sparse="",
                                   compression=functions.Compression.none,
                                   sparse_as_dense=False, op=functions.Average,
                                   gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=None,
                                   local_layers=None,
                                   scale_local_gradients=True):
  """A `DistributedGradientTape` that keeps `local_layers`' gradients local.

  The trainable weights of `local_layers` (a Keras layer or a list) are
  registered as local sources; see `DistributedGradientTape`.
  """
  tape = DistributedGradientTape(
      gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
      gradient_predivide_factor, num_groups, groups, process_set,
      scale_local_gradients)
  for v in _layer_variables(local_layers, "hvd.PartialDistributedGradientTape"):
    tape.register_local_source(v)
  return tape


class _DistributedOptimizerMixin:
  """Mixed into a Keras 3 optimizer's class: `apply` reduces the gradients.

  With `backward_passes_per_step` N > 1 the gradients are summed locally
  (in variables of their own, not part of `optimizer.variables`, so neither
  broadcast nor saved) and reduced and applied on every N-th call; the
  other calls only count `iterations`, as Horovod's aggregation helper
  does.
  """

  def _hvd_configure(self, reducer, backward_passes_per_step,
                     average_aggregated_gradients):
    self._hvd_reducer = reducer
    self._hvd_passes = backward_passes_per_step
    self._hvd_average_aggregated = bool(average_aggregated_gradients)
    self._hvd_accumulators = None

  def register_local_var(self, var):
    """Keeps `var`'s gradient local (not reduced across ranks)."""
    self._hvd_reducer.register_local(var)

  def build(self, variables):
    first = not self.built
    super().build(variables)
    if first and self._hvd_passes > 1:
      # Plain tf.Variables, not optimizer variables: they hold this rank's
      # own gradients, so broadcasting them (BroadcastGlobalVariablesCallback)
      # would be wrong, and a saved model stays loadable by plain Keras.
      with tf.init_scope():
        slots = {id(v): tf.Variable(tf.zeros(v.shape, v.dtype),
                                    trainable=False,
                                    name="hvd_aggregated_gradient")
                 for v in variables}
        counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="hvd_backward_passes")
      self._hvd_accumulators = (slots, counter)

  def apply(self, grads, trainable_variables=None):
    grads = list(grads)
    if trainable_variables is not None:
      trainable_variables = list(trainable_variables)
      variables = trainable_variables
    else:
      variables = list(getattr(self, "_trainable_variables", None) or
                       [None] * len(grads))
    if self._hvd_passes == 1:
      return super().apply(self._hvd_reducer(grads, variables),
                           trainable_variables)
    if not self.built:
      if trainable_variables is None:
        raise ValueError("hvd.DistributedOptimizer: the optimizer must be "
                         "built (or apply called with the variables) first")
      self.build(trainable_variables)
    return self._hvd_aggregate_and_maybe_apply(grads, variables,
                                               trainable_variables)

  def _hvd_aggregate_and_maybe_apply(self, grads, variables,
                                     trainable_variables):
    slots, counter = self._hvd_accumulators
    summed = []
    for g, v in zip(grads, variables):
      if g is None:
        summed.append(None)
        continue
      if isinstance(g, tf.IndexedSlices):
        if not self._hvd_reducer.sparse_as_dense:
          raise ValueError(
              "hvd.DistributedOptimizer: tf.IndexedSlices gradients are not "
              "supported with backward_passes_per_step > 1 unless "
              "sparse_as_dense=True (as in Horovod)")
        g = tf.convert_to_tensor(g)
      if v is None or id(v) not in slots:
        raise ValueError("hvd.DistributedOptimizer: apply() got a variable "
                         "the optimizer was not built with")
      slots[id(v)].assign_add(tf.cast(g, slots[id(v)].dtype))
      summed.append(slots[id(v)])
    counter.assign_add(1)

    def reduce_and_apply():
      values = [None if s is None else tf.convert_to_tensor(s)
                for s in summed]
      reduced = self._hvd_reducer(values, variables)
      if self._hvd_average_aggregated:
        reduced = [None if r is None else r / self._hvd_passes
                   for r in reduced]
      super(_DistributedOptimizerMixin, self).apply(reduced,
                                                    trainable_variables)
      for s in slots.values():
        s.assign(tf.zeros_like(s))
      counter.assign(0)
      return tf.constant(True)

    def count_only():
      self.iterations.assign_add(1)
      return tf.constant(False)

    if tf.executing_eagerly():
      return (reduce_and_apply() if int(counter.numpy()) >= self._hvd_passes
              else count_only())
    return tf.cond(counter >= self._hvd_passes, reduce_and_apply, count_only)


_DISTRIBUTED_CLASSES = {}


def _distributed_class(base):
  """The subclass of optimizer class `base` with the mixin (cached)."""
  if issubclass(base, _DistributedOptimizerMixin):
    return base
  if base not in _DISTRIBUTED_CLASSES:
    # Same name and module as `base`, so a saved model's config names the
    # plain optimizer and loads without mpistrategy.
    _DISTRIBUTED_CLASSES[base] = type(
        base.__name__, (_DistributedOptimizerMixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__})
  return _DISTRIBUTED_CLASSES[base]


def _check_optimizer(optimizer, fn):
  if isinstance(optimizer, tf.compat.v1.train.Optimizer):
    raise NotImplementedError(
        f"{fn}: TF1 optimizers (tf.compat.v1.train.Optimizer) are not "
        "provided by mpistrategy.horovod; use a Keras optimizer "
        "(keras.optimizers.*) or hvd.DistributedGradientTape")
  if not isinstance(optimizer, keras.optimizers.Optimizer):
    raise TypeError(f"{fn}: expects a Keras optimizer, got "
                    f"{type(optimizer).__name__}")
  if isinstance(optimizer, _DistributedOptimizerMixin):
    raise ValueError(f"{fn}: the optimizer is already distributed")


def _check_passes(backward_passes_per_step, fn):
  if (not isinstance(backward_passes_per_step, int) or
      isinstance(backward_passes_per_step, bool) or
      backward_passes_per_step < 1):
    raise ValueError(f"{fn}: backward_passes_per_step must be an int >= 1, "
                     f"got {backward_passes_per_step!r}")


def DistributedOptimizer(optimizer, name=None, use_locking=False,  # pylint: disable=invalid-name
                         device_dense="", device_sparse="",
                         compression=functions.Compression.none,
                         sparse_as_dense=False,
                         backward_passes_per_step=1, op=functions.Average,
                         gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None,
                         scale_local_gradients=True):
  """Returns a copy of a Keras 3 optimizer that averages gradients across
  ranks in `apply` / `apply_gradients` (so also in `model.fit`).

  As Horovod, the result is a new optimizer of the same class made from
  `optimizer.get_config()` (state of an already used optimizer is not
  carried over).

  Args:
    optimizer: a `keras.optimizers.Optimizer`.
    name: the new optimizer's name (default: the original's, so checkpoint
      paths do not change).
    use_locking: accepted for compatibility (TF1 only).
    device_dense: must be empty.
    device_sparse: must be empty.
    compression: `hvd.Compression.none` (default) or `.fp16`.
    sparse_as_dense: reduce `tf.IndexedSlices` gradients as dense tensors.
    backward_passes_per_step: sum gradients locally over this many calls,
      then reduce and apply once.
    op: `hvd.Average` (default) or `hvd.Sum`.
    gradient_predivide_factor: see `DistributedGradientTape`.
    average_aggregated_gradients: divide the locally summed gradients by
      backward_passes_per_step.
    num_groups: see `DistributedGradientTape`.
    groups: see `DistributedGradientTape`.
    process_set: only the global process set.
    scale_local_gradients: see `DistributedGradientTape`.

  Returns:
    The distributed optimizer (an instance of `type(optimizer)`).

  Raises:
    ValueError: `op` is not `hvd.Average` or `hvd.Sum`, or another argument
      is invalid.
    NotImplementedError: `op=hvd.Adasum`, devices or process sets.
  """
  del use_locking
  fn = "hvd.DistributedOptimizer"
  _check_optimizer(optimizer, fn)
  if op not in (functions.Average, functions.Sum, functions.Adasum):
    # As Horovod's for Keras optimizers (the tape takes Min, Max, Product).
    raise ValueError(f"{fn}(op={op!r}): op currently only supports Average "
                     "and Sum (as in Horovod)")
  _check_passes(backward_passes_per_step, fn)
  reducer = _GradientReducer(
      fn, device_dense, device_sparse, compression, sparse_as_dense, op,
      gradient_predivide_factor, num_groups, groups, process_set,
      scale_local_gradients)
  config = optimizer.get_config()
  if name is not None:
    config["name"] = name
  distributed = _distributed_class(type(optimizer)).from_config(config)
  distributed._hvd_configure(reducer, backward_passes_per_step,  # pylint: disable=protected-access
                             average_aggregated_gradients)
  return distributed


def PartialDistributedOptimizer(optimizer, name=None, use_locking=False,  # pylint: disable=invalid-name
                                device_dense="", device_sparse="",
                                compression=functions.Compression.none,
                                sparse_as_dense=False,
                                backward_passes_per_step=1,
                                op=functions.Average,
                                gradient_predivide_factor=1.0,
                                average_aggregated_gradients=False,
                                num_groups=0, groups=None, process_set=None,
                                local_layers=None,
                                scale_local_gradients=True):
  """A `DistributedOptimizer` that keeps `local_layers`' gradients local."""
  distributed = DistributedOptimizer(
      optimizer, name, use_locking, device_dense, device_sparse, compression,
      sparse_as_dense, backward_passes_per_step, op,
      gradient_predivide_factor, average_aggregated_gradients, num_groups,
      groups, process_set, scale_local_gradients)
  for v in _layer_variables(local_layers, "hvd.PartialDistributedOptimizer"):
    distributed.register_local_var(v)
  return distributed


def wrap_optimizer_in_place(optimizer, compression, fn):
  """Makes an existing (e.g. loaded) optimizer distributed, keeping its
  state: its class becomes the distributed subclass."""
  _check_optimizer(optimizer, fn)
  reducer = _GradientReducer(fn, "", "", compression, False,
                             functions.Average, 1.0, 0, None, None, True)
  optimizer.__class__ = _distributed_class(type(optimizer))
  optimizer._hvd_configure(reducer, 1, False)  # pylint: disable=protected-access
  return optimizer
