"""Checkpointing under MPIStrategy with single-process user code.

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_checkpoint.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_checkpoint.py

Only rank 0 writes the user's paths (ranks > 0 write a scratch mirror), no
rank hangs (saving reads SyncOnRead variables collectively), and restoring
gives every rank rank 0's state.
"""

import functools
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
from mpistrategy import checkpoint as mpi_checkpoint
from mpistrategy import ops

R = mpistrategy.rank()
N = mpistrategy.size()


def _same_everywhere(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  mine = np.frombuffer(h.digest(), np.uint8)
  allh = ops.allgather(tf.constant(mine[None, :])).numpy()
  return all(np.array_equal(allh[i], allh[0]) for i in range(N))


def _data():
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  x, y = load_digits(return_X_y=True)
  return (x[:384] / 16.0).astype(np.float32), y[:384].astype(np.int32)


def _model(strategy):
  with strategy.scope():
    m = keras.Sequential([keras.Input((64,)),
                          keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10)])
    m.compile(optimizer=keras.optimizers.Adam(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
  return m


@pytest.mark.timeout(300)
def test_model_checkpoint_only_rank0_writes(strategy, workdir):
  x, y = _data()
  m = _model(strategy)
  weights_path = os.path.join(workdir, "w-{epoch:02d}.weights.h5")
  model_path = os.path.join(workdir, "model.keras")
  m.fit(x, y, batch_size=32 * N, epochs=2, verbose=0, callbacks=[
      keras.callbacks.ModelCheckpoint(weights_path, save_weights_only=True),
      keras.callbacks.ModelCheckpoint(model_path, monitor="loss",
                                      save_best_only=True)])
  ops.barrier()
  assert sorted(os.listdir(workdir)) == ["model.keras", "w-01.weights.h5",
                                         "w-02.weights.h5"]
  if R > 0:
    mirror = mpi_checkpoint.mirror_path(workdir)
    assert mirror != workdir
    assert sorted(os.listdir(mirror)) == sorted(os.listdir(workdir))
  else:
    assert mpi_checkpoint.mirror_path(workdir) == workdir
  # Every rank can load what rank 0 wrote (same file system here).
  m2 = _model(strategy)
  m2.load_weights(os.path.join(workdir, "w-02.weights.h5"))
  for a, b in zip(m.weights, m2.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.timeout(300)
def test_model_save_and_save_weights_on_every_rank(strategy, workdir):
  # Single-process code run by every rank: only rank 0 writes the path, so
  # the ranks do not corrupt each other's HDF5/zip files.
  m = _model(strategy)
  weights_path = os.path.join(workdir, "sub", "m.weights.h5")
  model_path = os.path.join(workdir, "m.keras")
  if R == 0:
    os.makedirs(os.path.dirname(weights_path))
  ops.barrier()
  for _ in range(3):
    m.save_weights(weights_path)
    m.save(model_path)
    ops.barrier()  # rank 0's files are complete
    m2 = _model(strategy)
    m2.load_weights(weights_path)
    loaded = keras.models.load_model(model_path)
    for a, b, c in zip(m.weights, m2.weights, loaded.weights):
      np.testing.assert_array_equal(a.numpy(), b.numpy())
      np.testing.assert_array_equal(a.numpy(), c.numpy())
    ops.barrier()  # everyone read before the next round rewrites
  for i in range(2):
    m.export(os.path.join(workdir, "exported"))
    keras.saving.save_model(m, os.path.join(workdir, "f.keras"))
    ops.barrier()
  assert sorted(os.listdir(workdir)) == ["exported", "f.keras", "m.keras",
                                         "sub"]
  loaded = keras.models.load_model(os.path.join(workdir, "f.keras"))
  np.testing.assert_array_equal(loaded.weights[0].numpy(),
                                m.weights[0].numpy())
  if R > 0:
    assert os.path.exists(mpi_checkpoint.mirror_path(weights_path))
    assert os.path.isdir(
        mpi_checkpoint.mirror_path(os.path.join(workdir, "exported")))
  # Horovod-style code that saves on rank 0 only needs nothing from others.
  if R == 0:
    m.save_weights(weights_path)
  ops.barrier()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("answer", [False, True])
def test_overwrite_false_asks_on_rank_0_only(strategy, workdir, monkeypatch,
                                             answer):
  # Keras asks before replacing a file where overwrite=False.  Ranks > 0
  # asked too, about their scratch copy, and failed with EOFError (they
  # have no stdin under mpirun).  Now rank 0 alone asks, and every rank
  # reads what rank 0 kept.
  asked = []
  def ask(path):
    asked.append(path)
    return answer
  monkeypatch.setattr(keras.src.utils.io_utils,
                      "ask_to_proceed_with_overwrite", ask)
  p = functools.partial(os.path.join, workdir)
  m = _model(strategy)
  m.save(p("m.keras"))
  m.save_weights(p("m.weights.h5"))
  keras.saving.save_model(m, p("f.keras"))
  ops.barrier()
  old = [w.numpy() for w in m.weights]
  for w in m.weights:
    w.assign(w + 1.0)
  m.save(p("m.keras"), overwrite=False)
  m.save_weights(p("m.weights.h5"), False)
  keras.saving.save_model(m, p("f.keras"), False)
  m.save(p("new.keras"), overwrite=False)  # nothing there: nothing asked
  assert asked == ([p("m.keras"), p("m.weights.h5"), p("f.keras")]
                   if R == 0 else [])
  ops.barrier()  # rank 0 has its answers
  kept = [w.numpy() for w in m.weights] if answer else old
  weights = _model(strategy)
  weights.load_weights(p("m.weights.h5"))
  for loaded in (keras.models.load_model(p("m.keras")), weights,
                 keras.models.load_model(p("f.keras"))):
    for a, b in zip(loaded.weights, kept):
      np.testing.assert_array_equal(a.numpy(), b)
  new = keras.models.load_model(p("new.keras"))
  np.testing.assert_array_equal(new.weights[0].numpy(), m.weights[0].numpy())
  assert sorted(os.listdir(workdir)) == ["f.keras", "m.keras",
                                         "m.weights.h5", "new.keras"]
  ops.barrier()


def _own_model(value):
  """A model outside any MPIStrategy whose weights are all `value`."""
  m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)],
                       name="own")
  for w in m.weights:
    w.assign(tf.fill(w.shape, float(value)))
  return m


@pytest.mark.timeout(300)
def test_what_is_not_the_strategys_is_saved_by_the_rank_that_saves_it(
    strategy, workdir):
  # Each rank's own objects (a model built outside the strategy, one under
  # another strategy, a module of plain variables) may differ per rank: a
  # rank that saves one keeps its file, as in one process.  They went to
  # the rank's scratch copy and were gone at exit.
  own = _own_model(R)
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    other = _own_model(R)
  module = tf.Module()
  module.v = tf.Variable(float(R))
  module.get = tf.function(lambda: module.v, input_signature=[])
  p = functools.partial(os.path.join, workdir)
  own.save(p(f"own{R}.keras"))
  own.save_weights(p(f"own{R}.weights.h5"))
  keras.saving.save_model(own, p(f"fn{R}.keras"))
  own.export(p(f"export{R}"))
  other.save(p(f"other{R}.keras"))
  tf.saved_model.save(module, p(f"module{R}"))
  if R == N - 1:
    own.save(p("only_the_last_rank.keras"))
  # The same path from every rank: one complete copy, no error.
  for _ in range(2):
    own.save(p("shared.keras"))
    tf.saved_model.save(module, p("shared_module"))
  # A write that cannot be atomic (sharded weights) stays with rank 0: the
  # ranks' shards mixed on one path, or h5py's lock failed.
  for _ in range(3):
    own.save_weights(p("sharded.weights.json"), max_shard_size=1e-5)
    ops.barrier()
  # The strategy's state is written by rank 0 only, as before.
  _model(strategy).save(p(f"strategy{R}.keras"))
  ops.barrier()
  if R == 0:
    for r in range(N):
      for name in (f"own{r}.keras", f"fn{r}.keras", f"other{r}.keras"):
        loaded = keras.models.load_model(p(name))
        assert all((w.numpy() == r).all() for w in loaded.weights), name
      weights = _own_model(-1)
      weights.load_weights(p(f"own{r}.weights.h5"))
      assert all((w.numpy() == r).all() for w in weights.weights)
      x = np.ones((1, 3), np.float32)
      assert tf.saved_model.load(p(f"export{r}")).serve(x).numpy().tolist() \
          == [[3.0 * r + r] * 2]
      assert tf.saved_model.load(p(f"module{r}")).get().numpy() == r
    loaded = keras.models.load_model(p("only_the_last_rank.keras"))
    assert all((w.numpy() == N - 1).all() for w in loaded.weights)
    shared = keras.models.load_model(p("shared.keras")).weights[0].numpy()
    assert shared.min() == shared.max() and shared.min() in range(N)
    assert tf.saved_model.load(p("shared_module")).get().numpy() in range(N)
    sharded = _own_model(-1)
    sharded.load_weights(p("sharded.weights.json"))
    assert all((w.numpy() == 0).all() for w in sharded.weights)
    assert os.path.exists(p("strategy0.keras"))
    assert not [n for n in os.listdir(workdir)
                if n.startswith("strategy") and n != "strategy0.keras"]
    assert not [n for n in os.listdir(workdir) if n.startswith(".mpistrategy")]
  ops.barrier()
  keras.backend.clear_session(free_memory=False)


@pytest.mark.timeout(300)
def test_errors_of_a_save_name_the_users_path(strategy, workdir):
  # Rank 0 stages h5 writes and writes next to the path, ranks > 0 write a
  # scratch mirror: Keras' checks of the path must still quote the user's.
  m = _model(strategy)
  cases = [(m.save, os.path.join(workdir, "model_dir"), "Invalid filepath"),
           (m.save_weights, os.path.join(workdir, "x.weights"),
            ".weights.h5"),
           (m.save, "relative_dir", "Invalid filepath")]
  for save, path, what in cases:
    with pytest.raises(ValueError, match=what) as raised:
      save(path)
    text = str(raised.value)
    assert f"Received: filepath={path}" in text, text
    assert "mpistrategy-rank" not in text and "stage-" not in text, text
  # Rank 0 writes a checkpoint under a temporary prefix; where that fails
  # (a file where the directory should be), the error names the user's.
  a_file = os.path.join(workdir, "a_file")
  if R == 0:
    open(a_file, "w").close()
  ops.barrier()
  # Ranks > 0 on rank 0's host fail too, though their scratch mirror could
  # hold a directory there.
  prefix = os.path.join(a_file, "ckpt")
  with pytest.raises((tf.errors.OpError, NotADirectoryError)) as raised:
    tf.train.Checkpoint(model=m).write(prefix)
  text = str(raised.value)
  assert "a_file" in text and _TMP_TAG not in text, text
  assert "mpistrategy-rank" not in text, text
  ops.barrier()


_TMP_TAG = ".mpistrategy-tmp-"


class _Interrupt(Exception):
  pass


class _StopAt(keras.callbacks.Callback):

  def __init__(self, epoch):
    super().__init__()
    self.epoch = epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self.epoch:
      raise _Interrupt()


class _Epochs(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.seen = []

  def on_epoch_begin(self, epoch, logs=None):
    self.seen.append(epoch)


@pytest.mark.timeout(300)
def test_backup_and_restore_resumes_everywhere(strategy, workdir):
  x, y = _data()
  backup = os.path.join(workdir, "backup")
  m = _model(strategy)
  with pytest.raises(_Interrupt):
    m.fit(x, y, batch_size=32 * N, epochs=4, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup), _StopAt(2)])
  ops.barrier()
  assert os.path.exists(os.path.join(backup, "latest.weights.h5"))
  saved = [w.numpy() for w in m.weights]

  # A fresh model with rank-dependent weights/optimizer state: resuming must
  # give every rank rank 0's backup.
  keras.utils.set_random_seed(R)
  m2 = _model(strategy)
  for w in m2.weights:  # make ranks differ before the restore
    w.assign(w + float(R))
  epochs = _Epochs()
  m2.fit(x, y, batch_size=32 * N, epochs=3, verbose=0, callbacks=[
      keras.callbacks.BackupAndRestore(backup), epochs,
      _StopAt(3)])
  assert epochs.seen == [2], epochs.seen
  assert _same_everywhere([w.numpy() for w in m2.weights] +
                          [v.numpy() for v in m2.optimizer.variables])
  assert not os.path.exists(backup)  # deleted at the end of training (rank 0)
  del saved


class _KilledBetweenTheTwoFiles(keras.callbacks.Callback):
  """After the backup of batch 2, leaves rank 0's backup as a kill right
  after its metadata committed would: the metadata of batch 2, its weights
  still pending, the weights file of batch 1.  Then every rank stops."""

  def __init__(self, backup):
    super().__init__()
    self.weights = os.path.join(backup, "latest.weights.h5")
    self.meta = os.path.join(backup, "training_metadata.json")
    self.older = os.path.join(os.path.dirname(backup), "batch1.weights.h5")
    self.saved = None

  def on_train_batch_end(self, batch, logs=None):
    if batch == 1 and R == 0:
      shutil.copy(self.weights, self.older)
    if batch != 2:
      return
    self.saved = [w.numpy() for w in self.model.weights]
    if R == 0:
      pending = self._pending("killed")
      os.replace(self.weights, pending)
      with open(self.meta) as f:
        meta = json.load(f)
      meta["mpistrategy_pending_weights"] = os.path.basename(pending)
      with open(self.meta, "w") as f:
        json.dump(meta, f)
      shutil.copy(self.older, self.weights)
      # And one of a save that never committed.
      shutil.copy(self.older, self._pending("stray"))
    raise _Interrupt()

  def _pending(self, token):
    # Where rank 0 writes a save's weights until its metadata commits them.
    return os.path.join(os.path.dirname(self.weights),
                        f".mpistrategy-pending-{token}-latest.weights.h5")


class _WeightsAtStart(keras.callbacks.Callback):

  def on_train_begin(self, logs=None):
    self.weights = [w.numpy() for w in self.model.weights]
    raise _Interrupt()


@pytest.mark.timeout(300)
def test_backup_killed_between_weights_and_metadata_resumes_the_pair(
    strategy, workdir):
  # A backup is two files; a resumed run must never see one save's
  # metadata with another save's weights (a batch trained twice).
  x, y = _data()
  backup = os.path.join(workdir, "backup")
  killed = _KilledBetweenTheTwoFiles(backup)
  with pytest.raises(_Interrupt):
    _model(strategy).fit(x, y, batch_size=32 * N, epochs=2, verbose=0,
                         callbacks=[keras.callbacks.BackupAndRestore(
                             backup, save_freq=1), killed])
  ops.barrier()
  start = _WeightsAtStart()
  with pytest.raises(_Interrupt):
    _model(strategy).fit(x, y, batch_size=32 * N, epochs=2, verbose=0,
                         callbacks=[keras.callbacks.BackupAndRestore(
                             backup, save_freq=1), start])
  for a, b in zip(start.weights, killed.saved):
    np.testing.assert_array_equal(a, b)
  ops.barrier()
  assert sorted(os.listdir(backup)) == ["latest.weights.h5",
                                        "training_metadata.json"]


@pytest.mark.timeout(300)
def test_csv_logger_and_tensorboard_write_once(strategy, workdir):
  # Every rank runs the same callbacks with the same paths; the files must
  # be what one process writes (one CSV row per epoch, not N; one set of
  # event files), as for ModelCheckpoint.
  x, y = _data()
  csv = os.path.join(workdir, "log.csv")
  for _ in range(2):  # append=True: a resumed run adds its rows
    m = _model(strategy)
    m.fit(x, y, batch_size=32 * N, epochs=2, verbose=0, callbacks=[
        keras.callbacks.CSVLogger(csv, append=True)])
  ops.barrier()
  with open(csv) as f:
    lines = f.read().splitlines()
  assert len(lines) == 1 + 2 * 2 and lines[0].startswith("epoch"), lines
  assert [l.split(",")[0] for l in lines[1:]] == ["0", "1", "0", "1"], lines
  # TensorBoard's writers and profile go under the directories set_model
  # derives from log_dir (tensorboard itself is not a dependency).
  logs = os.path.join(workdir, "logs")
  board = keras.callbacks.TensorBoard(logs, write_graph=False)
  board.set_model(_model(strategy))
  assert board.log_dir == logs
  if R == 0:
    assert board._train_dir == os.path.join(logs, "train")  # pylint: disable=protected-access
  else:
    assert board._train_dir == os.path.join(  # pylint: disable=protected-access
        mpi_checkpoint.mirror_path(logs), "train")


@pytest.mark.timeout(300)
def test_tf_train_checkpoint_with_sync_on_read(strategy, workdir):
  with strategy.scope():
    v = tf.Variable([1.0, 2.0])
    counter = tf.Variable(0.0,
                          synchronization=tf.VariableSynchronization.ON_READ,
                          aggregation=tf.VariableAggregation.SUM)
    m = _model(strategy)

  @tf.function
  def bump():
    strategy.run(lambda: counter.assign_add(1.0))

  bump()
  ckpt = tf.train.Checkpoint(v=v, counter=counter, model=m)
  prefix = os.path.join(workdir, "ckpt")
  path = ckpt.save(prefix)  # every rank saves: no hang on the ON_READ read
  assert path == prefix + "-1"
  ops.barrier()
  assert tf.train.latest_checkpoint(workdir) == path
  assert sorted(p for p in os.listdir(workdir)) == sorted(
      ["checkpoint", "ckpt-1.index", "ckpt-1.data-00000-of-00001"])

  # Diverge the ranks, then restore rank 0's checkpoint everywhere.
  v.assign([float(R), float(R)])
  for w in m.weights:
    w.assign(w + float(R))
  status = ckpt.restore(tf.train.latest_checkpoint(workdir) if R == 0 else None)
  status.assert_existing_objects_matched()
  assert v.numpy().tolist() == [1.0, 2.0]
  assert counter.numpy() == float(N)
  assert _same_everywhere([w.numpy() for w in m.weights])

  # write/read and CheckpointManager.
  p2 = ckpt.write(os.path.join(workdir, "plain"))
  assert p2 == os.path.join(workdir, "plain")
  # A relative prefix comes back as given, on every rank.
  cwd = os.getcwd()
  os.chdir(workdir)
  try:
    assert ckpt.write("relative/plain") == "relative/plain"
  finally:
    os.chdir(cwd)
  # Inside a tf.function, with the prefix as a tensor or a str.
  in_function = os.path.join(workdir, "in_function")

  @tf.function
  def write(prefix):
    return ckpt.write(prefix)

  assert write(tf.constant(in_function)).numpy().decode() == in_function
  assert tf.function(lambda: ckpt.write(in_function + "2"))().numpy().decode(
      ) == in_function + "2"
  ops.barrier()
  ckpt.read(in_function).assert_existing_objects_matched()
  v.assign([5.0, 5.0 + R])
  ckpt.read(p2).assert_existing_objects_matched()
  assert v.numpy().tolist() == [1.0, 2.0]

  mdir = os.path.join(workdir, "managed")
  mgr = tf.train.CheckpointManager(ckpt, mdir, max_to_keep=1)
  assert mgr.restore_or_initialize() is None
  mgr.save()
  v.assign([9.0, 9.0])
  mgr.save()
  ops.barrier()
  assert sorted(os.listdir(mdir)) == [
      "checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index"]
  v.assign([float(R), 0.0])
  mgr2 = tf.train.CheckpointManager(ckpt, mdir, max_to_keep=1)
  restored = mgr2.restore_or_initialize()
  assert restored is not None and restored.endswith("ckpt-3")
  assert v.numpy().tolist() == [9.0, 9.0]


@pytest.mark.timeout(300)
def test_checkpoint_manager_after_a_restart_agrees_with_rank_0(strategy,
                                                               workdir):
  # The TF guide's pattern, run by every rank of a restarted job: a fresh
  # manager over rank 0's directory must report rank 0's checkpoints, so
  # every rank takes the same branch (restoring is collective).
  with strategy.scope():
    v = tf.Variable(0.0)
    step = tf.Variable(0, dtype=tf.int64)
  ckpt = tf.train.Checkpoint(v=v, step=step)
  mdir = os.path.join(workdir, "restart")
  first = tf.train.CheckpointManager(ckpt, mdir, max_to_keep=3)
  for _ in range(2):
    v.assign_add(1.0)
    first.save()
  ops.barrier()

  v.assign(-1.0)
  mgr = tf.train.CheckpointManager(ckpt, mdir, max_to_keep=3,
                                   step_counter=step, checkpoint_interval=10)
  latest = mgr.latest_checkpoint
  assert latest is not None and os.path.basename(latest) == "ckpt-2"
  assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-1",
                                                            "ckpt-2"]
  if mgr.latest_checkpoint:
    ckpt.restore(mgr.latest_checkpoint)
  assert v.numpy() == 2.0
  assert os.path.basename(mgr.save()) == "ckpt-3"  # same numbering
  # checkpoint_interval counts from the restored step, as in TF.
  mgr2 = tf.train.CheckpointManager(ckpt, mdir, max_to_keep=3,
                                    step_counter=step, checkpoint_interval=10)
  assert mgr2.restore_or_initialize() is not None
  step.assign_add(1)
  assert mgr2.save() is None


@pytest.mark.timeout(300)
def test_rank0_only_saving_and_evaluation_need_no_other_rank(strategy,
                                                             workdir):
  # Horovod habits that keep working: rank 0 alone saves (no
  # communication), then rank 0 alone loads copies that build new objects
  # (evaluation): local reads.  Only reads into the strategy's variables
  # are collective (tests/launcher/test_checkpoint_job.py).
  m = _model(strategy)
  if R == 0:
    m.save(os.path.join(workdir, "r0.keras"))
    m.save_weights(os.path.join(workdir, "r0.weights.h5"))
    m.export(os.path.join(workdir, "r0_export"))
    tf.train.Checkpoint(model=m).write(os.path.join(workdir, "r0_ckpt"))
    loaded = keras.models.load_model(os.path.join(workdir, "r0.keras"))
    local = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16),
                              keras.layers.Dense(10)])
    local.load_weights(os.path.join(workdir, "r0.weights.h5"))
    exported = tf.saved_model.load(os.path.join(workdir, "r0_export"))
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(exported.serve(x).numpy(), m(x).numpy(),
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(loaded.weights, m.weights):
      np.testing.assert_array_equal(a.numpy(), b.numpy())
  ops.barrier()
  assert sorted(os.listdir(workdir)) == [
      "r0.keras", "r0.weights.h5", "r0_ckpt.data-00000-of-00001",
      "r0_ckpt.index", "r0_export"]
  # Rank 0 alone built Keras objects above, which advanced only its
  # automatic names (`sequential_N`, `dense_N`).  Collectives inside a
  # tf.function are paired by names that contain them, so the next test's
  # training would stall; reset the counters on every rank (README: build
  # the same Keras objects on every rank).
  keras.backend.clear_session(free_memory=False)
