"""The user's paths under MPIStrategy's saves behave as in one process.

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_checkpoint_paths.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_checkpoint_paths.py

Rank 0 writes a temporary copy and moves it into place, ranks > 0 write a
scratch mirror (tests/parallel/test_checkpoint.py); neither may show: a
directory keeps the user's other files, links are written through, a
missing directory fails on every rank, a later save by rank 0 alone is
what every rank loads, and messages name the user's path.
"""

import contextlib
import io
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
from mpistrategy import ops

R = mpistrategy.rank()
N = mpistrategy.size()
X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)


def _model(strategy):
  with strategy.scope():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile(optimizer="sgd", loss="mse")
  return m


def _on_rank_0(fn):
  if R == 0:
    fn()
  ops.barrier()


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def _read(path):
  with open(path) as f:
    return f.read()


@pytest.mark.timeout(300)
def test_a_saved_model_directory_keeps_the_users_other_files(strategy,
                                                             workdir):
  m = _model(strategy)
  directories = [os.path.join(workdir, d) for d in ("sm", "exported")]

  def populate():
    for d in directories:
      _write(os.path.join(d, "notes.txt"), "mine")
      _write(os.path.join(d, "checkpoints", "ckpt.index"), "also mine")

  _on_rank_0(populate)
  for _ in range(2):  # into a directory holding the user's files, then also
    tf.saved_model.save(m, directories[0])  # an older SavedModel
    m.export(directories[1])
    ops.barrier()
  for d in directories:
    assert _read(os.path.join(d, "notes.txt")) == "mine"
    assert _read(os.path.join(d, "checkpoints", "ckpt.index")) == "also mine"
    assert os.path.isfile(os.path.join(d, "saved_model.pb"))
    assert not [n for n in os.listdir(os.path.dirname(d))
                if n.startswith(".mpistrategy-tmp-")]
  loaded = tf.saved_model.load(directories[1])
  np.testing.assert_allclose(loaded.serve(X).numpy(), m(X).numpy(),
                             rtol=1e-6)


@pytest.mark.timeout(300)
def test_saving_into_the_working_directory(strategy, workdir):
  m = _model(strategy)
  cwd = os.path.join(workdir, "run")
  _on_rank_0(lambda: _write(os.path.join(cwd, "train.py"), "# the script"))
  before = os.getcwd()
  os.chdir(cwd)
  try:
    tf.saved_model.save(m, ".")
    ops.barrier()
    # The working directory is still the one on disk, with everything in.
    assert os.path.samefile(".", cwd)
    assert {"train.py", "saved_model.pb", "variables"} <= set(os.listdir("."))
    loaded = tf.saved_model.load(".")
  finally:
    os.chdir(before)
  np.testing.assert_allclose(
      loaded.signatures["serving_default"](tf.constant(X))["output_0"],
      m(X).numpy(), rtol=1e-6)


@pytest.mark.timeout(300)
def test_saves_write_through_symbolic_links(strategy, workdir):
  m = _model(strategy)
  real = os.path.join(workdir, "real")
  file_link = os.path.join(workdir, "model.keras")
  dir_link = os.path.join(workdir, "export")

  def links():
    _write(os.path.join(real, "kept.keras"), "old")
    _write(os.path.join(real, "sm", "notes.txt"), "mine")
    os.symlink(os.path.join(real, "kept.keras"), file_link)
    os.symlink(os.path.join(real, "sm"), dir_link)

  _on_rank_0(links)
  m.save(file_link)
  tf.saved_model.save(m, dir_link)
  ops.barrier()
  assert os.path.islink(file_link) and os.path.islink(dir_link)
  assert sorted(os.listdir(real)) == ["kept.keras", "sm"]
  loaded = keras.models.load_model(os.path.join(real, "kept.keras"))
  for a, b in zip(loaded.get_weights(), m.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert os.path.isfile(os.path.join(real, "sm", "saved_model.pb"))
  assert _read(os.path.join(real, "sm", "notes.txt")) == "mine"


@pytest.mark.timeout(300)
def test_a_later_save_by_rank_0_alone_is_what_every_rank_loads(strategy,
                                                               workdir):
  # Every rank saves (ranks > 0 into their scratch copies), then rank 0
  # alone saves newer weights (Horovod's habit): every rank loads those.
  m = _model(strategy)
  paths = {k: os.path.join(workdir, k) for k in
           ("m.keras", "w.weights.h5", "sm", "ck")}
  checkpoint = tf.train.Checkpoint(model=m)
  m.save(paths["m.keras"])
  m.save_weights(paths["w.weights.h5"])
  tf.saved_model.save(m, paths["sm"])
  checkpoint.save(os.path.join(paths["ck"], "c"))
  newer = [np.full_like(w, 7.0) for w in m.get_weights()]
  m.set_weights(newer)

  def save_again():
    m.save(paths["m.keras"])
    m.save_weights(paths["w.weights.h5"])
    tf.saved_model.save(m, paths["sm"])
    checkpoint.save(os.path.join(paths["ck"], "c"))

  # Later than every rank's own save: a rank whose save began after rank
  # 0's second one reads back its own (README), and saves here cost no
  # communication, so a rank slow to trace the SavedModel (0.5 s against
  # rank 0's 0.1 s, seen after test_checkpoint.py) began after it.
  ops.barrier()
  _on_rank_0(save_again)
  loaded = keras.models.load_model(paths["m.keras"])
  local = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  local.load_weights(paths["w.weights.h5"])
  for model in (loaded, local):
    for w in model.get_weights():
      np.testing.assert_array_equal(w, 7.0)
  serve = tf.saved_model.load(paths["sm"]).signatures["serving_default"]
  np.testing.assert_allclose(serve(tf.constant(X))["output_0"],
                             m(X).numpy(), rtol=1e-6)
  assert tf.train.latest_checkpoint(paths["ck"]) == os.path.join(
      paths["ck"], "c-2")


@pytest.mark.timeout(300)
def test_a_file_rank_0_moves_into_place_is_what_every_rank_loads(strategy,
                                                                 workdir):
  # A file moved or copied into place keeps its old modification time
  # (os.replace, shutil.copy2): ranks > 0 went on loading their own copy of
  # the earlier save, and the ranks evaluated different models.
  m = _model(strategy)
  path, other = (os.path.join(workdir, n) for n in ("m.keras", "o.keras"))
  # Built on every rank: Keras' automatic names (`sequential_N`) must stay
  # the same everywhere for the next tests' collectives to pair.
  seven = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  seven.set_weights([np.full_like(w, 7.0) for w in seven.get_weights()])
  _on_rank_0(lambda: seven.save(other))
  for move in ("copy2", "replace"):
    m.save(path)
    ops.barrier()

    def put_seven(move=move):
      if move == "copy2":
        shutil.copy2(other, path)
      else:
        shutil.copy2(other, path + ".new")
        os.replace(path + ".new", path)

    _on_rank_0(put_seven)
    for w in keras.models.load_model(path).get_weights():
      np.testing.assert_array_equal(w, 7.0, err_msg=move)
    ops.barrier()


@pytest.mark.timeout(300)
def test_a_save_into_a_missing_directory_fails_on_every_rank(strategy,
                                                             workdir):
  m = _model(strategy)
  for save, path in [
      (m.save, os.path.join(workdir, "missing", "m.keras")),
      (m.save_weights, os.path.join(workdir, "missing", "w.weights.h5"))]:
    with pytest.raises(OSError) as raised:
      save(path)
    text = str(raised.value)
    assert path in text and "mpistrategy-rank" not in text, text
    assert "-> None" not in text, text
  ops.barrier()
  assert sorted(os.listdir(workdir)) == []
  # SavedModel makes missing directories, on every rank alike.
  tf.saved_model.save(m, os.path.join(workdir, "new", "deep"))
  ops.barrier()
  assert os.path.isfile(os.path.join(workdir, "new", "deep",
                                     "saved_model.pb"))


@pytest.mark.timeout(300)
def test_export_names_the_users_path(strategy, workdir):
  m = _model(strategy)
  path = os.path.join(workdir, "exported")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    m.export(path)
  ops.barrier()
  assert f"Saved artifact at '{path}'" in printed.getvalue(), printed.getvalue()


@pytest.mark.timeout(300)
def test_a_verbose_model_checkpoint_names_the_users_path(strategy, workdir,
                                                         monkeypatch):
  # A relative pattern stays relative on every rank (a rank > 0 printed
  # the absolute path of its copy).
  m = _model(strategy)
  monkeypatch.chdir(workdir)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    m.fit(np.ones([8, 3], np.float32), np.ones([8, 2], np.float32),
          batch_size=4, epochs=1, verbose=0, callbacks=[
              keras.callbacks.ModelCheckpoint("e{epoch:02d}.keras",
                                              verbose=1)])
  ops.barrier()
  text = printed.getvalue()
  assert "saving model to e01.keras" in text, text
  assert workdir not in text, text


@pytest.mark.timeout(300)
def test_a_save_never_puts_a_file_for_a_directory_or_back(strategy, workdir):
  # One process fails there; a replacement would delete the user's data.
  m = _model(strategy)
  a_dir = os.path.join(workdir, "taken.keras")
  a_file = os.path.join(workdir, "taken_file")
  holder = os.path.join(workdir, "sm")
  prefix = os.path.join(workdir, "ck")  # ck.index is a directory of mine
  checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))

  def populate():
    _write(os.path.join(a_dir, "mine.txt"), "mine")
    _write(a_file, "mine")
    _write(os.path.join(holder, "variables"), "a file of mine")
    _write(os.path.join(prefix + ".index", "mine.txt"), "mine")

  _on_rank_0(populate)
  for save, path in [(m.save, a_dir), (m.export, a_file),
                     (lambda p: tf.saved_model.save(m, p), holder),
                     (m.save, os.path.join(a_file, "under.keras")),
                     (checkpoint.write, prefix)]:
    with pytest.raises((OSError, tf.errors.OpError)):
      save(path)
  ops.barrier()
  assert _read(os.path.join(a_dir, "mine.txt")) == "mine"
  assert _read(a_file) == "mine"
  assert _read(os.path.join(holder, "variables")) == "a file of mine"
  assert _read(os.path.join(prefix + ".index", "mine.txt")) == "mine"
  assert not [n for n in os.listdir(workdir)
              if n.startswith(".mpistrategy-tmp-")]


@pytest.mark.timeout(300)
def test_a_replaced_file_keeps_its_mode(strategy, workdir):
  m = _model(strategy)
  path = os.path.join(workdir, "private.keras")

  def private_file():
    m.save(path)
    os.chmod(path, 0o600)

  _on_rank_0(private_file)
  m.save(path)
  ops.barrier()
  assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)


@pytest.mark.timeout(300)
def test_checkpoint_manager_names_with_directories(strategy, workdir):
  m = _model(strategy)
  directory = os.path.join(workdir, "mgr")
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(model=m), directory, max_to_keep=2,
      checkpoint_name="nested/dir/ck")
  saved = [manager.save() for _ in range(3)]
  ops.barrier()
  want = [os.path.join(directory, "nested", "dir", f"ck-{i}")
          for i in (1, 2, 3)]
  assert saved == want
  assert manager.latest_checkpoint == want[-1]
  assert manager.checkpoints == want[1:]
  assert os.path.isfile(manager.latest_checkpoint + ".index")
