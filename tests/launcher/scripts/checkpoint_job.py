"""Checkpoint writes on a full file system, and restores on rank 0 only.

--mode enospc DIR      for each kind of write (--kinds), every rank writes
                       DIR/<kind> once, rank 0 fills DIR (a small tmpfs) up,
                       every rank writes again with changed weights: rank 0's
                       write fails, catches the error (ERROR event) and checks
                       that the first copy still loads, with what it held before
                       and that no temporary file is left (CHECK event).
                       With --layer horovod: mpistrategy.horovod alone, a
                       model of each rank's own, and only rank 0 writes
                       (Horovod's habit); backup_and_restore is not a kind.
--mode enospc-uncaught DIR
                       as above for a ModelCheckpoint inside fit(), but the
                       error is not caught: the job must end on every rank,
                       naming rank 0 and errno 28.
--mode rank0-restore DIR --api A
                       rank 0 saves (Horovod style, no communication), then
                       only rank 0 restores (A: checkpoint, load_weights,
                       manager) while the others go on to train: rank 0 must
                       fail within seconds with FailedPreconditionError (the
                       engine sees the ranks crossed), the others' training
                       collective too, and the job end.
--mode hvd-rank0-restore DIR
                       Horovod's own habit on mpistrategy.horovod alone (no
                       MPIStrategy, so reads are not collective): rank 0
                       saves, every rank's weights drift, rank 0 restores,
                       hvd.broadcast_variables on every rank: every rank must
                       end with the saved weights.

--mode scratch DIR --then T
                       every rank saves DIR (.keras, h5 weights, a
                       tf.train.Checkpoint: ranks > 0 into their scratch
                       directory, rank 0 staging its h5 files there) and
                       names its scratch directory (SCRATCH event), runs a
                       tf.function autograph converts; then the
                       last rank exits normally (T=exit), raises (T=raise)
                       or kills itself with SIGKILL (T=kill).  Run with a
                       private TMPDIR.

Events: INIT, WRITTEN, ERROR, CHECK, RESTORING, RESTORED, SCRATCH, FINISHED.
"""

import glob
import hashlib
import json
import os
import shutil

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--mode", choices=["enospc", "enospc-uncaught",
                                  "rank0-restore", "hvd-rank0-restore",
                                  "scratch"],
               required=True)
p.add_argument("--dir", required=True)
p.add_argument("--kinds", default="save_weights,save,model_checkpoint,export,"
               "checkpoint_save,checkpoint_write,manager,backup_and_restore")
p.add_argument("--api", default="checkpoint")
p.add_argument("--layer", choices=["strategy", "horovod"], default="strategy")
p.add_argument("--then", choices=["exit", "raise", "kill"], default="exit")
args = p.parse_args()

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position
import keras  # pylint: disable=wrong-import-position
import mpistrategy  # pylint: disable=wrong-import-position
from mpistrategy import ops  # pylint: disable=wrong-import-position

if args.mode == "hvd-rank0-restore" or args.layer == "horovod":
  import mpistrategy.horovod.tensorflow as hvd  # pylint: disable=g-import-not-at-top,wrong-import-position
  hvd.init()
  strategy = None
else:
  strategy = mpistrategy.MPIStrategy()
rank, size = mpistrategy.rank(), mpistrategy.size()
io.emit("INIT", f"rank={rank} size={size}")


def build(under_strategy=True):
  scope = strategy.scope() if under_strategy else tf.name_scope("local")
  with scope:
    m = keras.Sequential([keras.Input((64,)),
                          keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(10)])
    m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
  return m


def digest(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  return h.hexdigest()[:16]


def fill(directory, leave=8192):
  """Fills the file system of `directory` up to `leave` bytes."""
  st = os.statvfs(directory)
  free = st.f_bavail * st.f_frsize
  with open(os.path.join(directory, "filler"), "wb") as f:
    try:
      f.write(b"\0" * max(free - leave, 0))
      f.flush()
      os.fsync(f.fileno())
    except OSError:
      pass


def write(kind, model, directory):
  """One write of `kind`; returns what to pass to `check`."""
  if kind == "save_weights":
    model.save_weights(os.path.join(directory, "m.weights.h5"))
  elif kind == "save":
    model.save(os.path.join(directory, "m.keras"))
  elif kind == "model_checkpoint":
    cb = keras.callbacks.ModelCheckpoint(
        os.path.join(directory, "mc.weights.h5"), save_weights_only=True)
    cb.set_model(model)
    cb.on_epoch_end(0, {"loss": 1.0})
  elif kind == "export":
    model.export(os.path.join(directory, "exported"), verbose=False)
  elif kind == "checkpoint_save":
    tf.train.Checkpoint(model=model).save(os.path.join(directory, "ckpt"))
  elif kind == "checkpoint_write":
    tf.train.Checkpoint(model=model).write(os.path.join(directory, "fixed"))
  elif kind == "manager":
    if not hasattr(write, "manager"):
      write.manager = tf.train.CheckpointManager(
          tf.train.Checkpoint(model=model), os.path.join(directory, "mgr"),
          max_to_keep=1)
    write.manager.save()
  elif kind == "backup_and_restore":
    cb = keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"))
    cb.set_model(model)
    cb.on_epoch_end(0)
  else:
    raise ValueError(kind)


def _variables_in_checkpoint(prefix):
  reader = tf.train.load_checkpoint(prefix)
  names = sorted(n for n in reader.get_variable_to_shape_map()
                 if n.startswith("model/") and "OPTIMIZER" not in n and
                 "/.ATTRIBUTES/VARIABLE_VALUE" in n)
  return [reader.get_tensor(n) for n in names]


def loaded_digest(kind, directory):
  """Loads the copy of `kind` on rank 0, with code outside the strategy."""
  local = build(under_strategy=False)
  if kind in ("save_weights", "model_checkpoint"):
    name = "m.weights.h5" if kind == "save_weights" else "mc.weights.h5"
    local.load_weights(os.path.join(directory, name))
    return digest(local.weights)
  if kind == "save":
    return digest(keras.models.load_model(
        os.path.join(directory, "m.keras")).weights)
  if kind == "export":
    loaded = tf.saved_model.load(os.path.join(directory, "exported"))
    return digest([v.numpy() for v in sorted(
        loaded.variables, key=lambda v: v.name)])
  if kind == "checkpoint_save":
    latest = tf.train.latest_checkpoint(directory)
    assert latest.endswith("ckpt-1"), latest
    values = _variables_in_checkpoint(latest)
  elif kind == "checkpoint_write":
    values = _variables_in_checkpoint(os.path.join(directory, "fixed"))
  elif kind == "manager":
    latest = tf.train.latest_checkpoint(os.path.join(directory, "mgr"))
    assert latest.endswith("ckpt-1"), latest
    values = _variables_in_checkpoint(latest)
  elif kind == "backup_and_restore":
    local.load_weights(os.path.join(directory, "backup", "latest.weights.h5"))
    with open(os.path.join(directory, "backup",
                           "training_metadata.json")) as f:
      json.load(f)
    return digest(local.weights)
  return digest(sorted(values, key=lambda a: (a.shape, a.tobytes())))


def enospc(kinds):
  horovod = args.layer == "horovod"
  model = build(under_strategy=not horovod)
  writes = rank == 0 or not horovod
  for kind in kinds:
    directory = os.path.join(args.dir, kind)
    if rank == 0:
      os.makedirs(directory)
    ops.barrier()
    if writes:
      write(kind, model, directory)
    ops.barrier()
    # What the first copy holds, read back by rank 0 before the failure.
    expected = loaded_digest(kind, directory) if rank == 0 else None
    io.emit("WRITTEN", kind)
    if rank == 0:
      fill(args.dir)
    for w in model.weights:
      w.assign(w + 1.0)
    ops.barrier()
    try:
      if writes:
        write(kind, model, directory)
      io.emit("ERROR", f"{kind} none")
    except Exception as e:  # pylint: disable=broad-except
      io.emit("ERROR", f"{kind} {io.error_text(e)}")
    ops.barrier()
    if rank == 0:
      os.remove(os.path.join(args.dir, "filler"))
      litter = [os.path.relpath(f, args.dir) for f in glob.glob(
          os.path.join(args.dir, "**", ".mpistrategy-tmp-*"), recursive=True)]
      got = loaded_digest(kind, directory)
      io.emit("CHECK", f"{kind} loads_previous={got == expected} "
              f"litter={litter}")
      shutil.rmtree(directory)
    ops.barrier()
  io.emit("FINISHED")


def enospc_uncaught():
  model = build()
  path = os.path.join(args.dir, "w.weights.h5")
  x = np.random.default_rng(0).random((64, 64), np.float32)
  y = np.zeros(64, np.int64)

  class FillAfterFirst(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      if epoch == 0 and rank == 0:
        io.emit("WRITTEN", digest(model.weights))
        fill(args.dir)

  # ModelCheckpoint runs before FillAfterFirst at each epoch end.
  model.fit(x, y, batch_size=16 * size, epochs=3, verbose=0, callbacks=[
      keras.callbacks.ModelCheckpoint(path, save_weights_only=True),
      FillAfterFirst()])
  io.emit("FINISHED")


def rank0_restore(api):
  model = build()
  path = os.path.join(args.dir, "w")
  ckpt = tf.train.Checkpoint(model=model)
  if rank == 0:  # Horovod style: only rank 0 saves (must not hang)
    if api == "load_weights":
      model.save_weights(path + ".weights.h5")
    elif api == "manager":
      tf.train.CheckpointManager(ckpt, path, max_to_keep=1).save()
    else:
      ckpt.write(path)
  ops.barrier()
  io.emit("WRITTEN")
  if rank == 0:
    io.emit("RESTORING", api)
    if api == "load_weights":
      model.load_weights(path + ".weights.h5")
    elif api == "manager":
      tf.train.CheckpointManager(ckpt, path,
                                 max_to_keep=1).restore_or_initialize()
    else:
      ckpt.restore(path)
  x = np.zeros((32, 64), np.float32)
  model.fit(x, np.zeros(32, np.int64), batch_size=8 * size, epochs=1,
            verbose=0)
  io.emit("FINISHED")


def hvd_rank0_restore():
  model = build(under_strategy=False)
  ckpt = tf.train.Checkpoint(model=model)
  path = os.path.join(args.dir, "w")
  if rank == 0:
    ckpt.write(path)
    io.emit("WRITTEN", digest(model.weights))
  hvd.barrier()
  for w in model.weights:  # every rank drifts differently
    w.assign(w + float(rank + 1))
  if rank == 0:
    io.emit("RESTORING", "checkpoint")
    ckpt.restore(path)
  hvd.broadcast_variables(model.variables, root_rank=0)
  io.emit("RESTORED", digest(model.weights))
  io.emit("FINISHED")


def scratch(then):
  from mpistrategy import checkpoint  # pylint: disable=g-import-not-at-top
  model = build()
  model.save(os.path.join(args.dir, "m.keras"))
  model.save_weights(os.path.join(args.dir, "m.weights.h5"))
  tf.train.Checkpoint(model=model).write(os.path.join(args.dir, "ckpt"))
  io.emit("SCRATCH", checkpoint._STATE["scratch"])  # pylint: disable=protected-access

  @tf.function
  def converted(x):  # autograph writes its module into $TMPDIR
    if x > 0:
      x = x - 1
    return x

  converted(tf.constant(1))
  ops.barrier()
  if rank == size - 1:
    if then == "raise":
      raise RuntimeError("raised after saving")
    if then == "kill":
      os.kill(os.getpid(), 9)
  ops.barrier()
  io.emit("FINISHED")


if args.mode == "enospc":
  enospc(args.kinds.split(","))
elif args.mode == "scratch":
  scratch(args.then)
elif args.mode == "enospc-uncaught":
  enospc_uncaught()
elif args.mode == "rank0-restore":
  rank0_restore(args.api)
else:
  hvd_rank0_restore()
