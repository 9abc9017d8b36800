"""The checkpoint module's scratch directories and error texts, one process.

Ranks > 0 write their copies of what they save into
`$TMPDIR/mpistrategy-rank<r>-*/`; a process killed outright cannot remove
its own, so the next one sweeps those whose owner lock nobody holds.
tests/launcher/test_checkpoint_job.py checks the same with whole jobs.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from mpistrategy import checkpoint

_OWNER = ".owner"


def _child(code, tmp):
  """Starts `code` in a fresh interpreter with TMPDIR=`tmp`; waits for READY."""
  proc = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(code)],
      env=dict(os.environ, TMPDIR=tmp, TF_CPP_MIN_LOG_LEVEL="3"),
      stdout=subprocess.PIPE, text=True)
  line = proc.stdout.readline().split()
  assert line and line[0] == "READY", line
  return proc, line[1]


_MAKE_SCRATCH = """
    import os, sys, time
    from mpistrategy import checkpoint
    checkpoint.set_world(1, 2)
    root = checkpoint.mirror_path("/x/y")[:-len("/x/y")]
    print("READY", root, flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_sweep_removes_only_directories_whose_owner_is_gone(tmp_path):
  tmp = str(tmp_path)
  live, live_root = _child(_MAKE_SCRATCH, tmp)
  dead, dead_root = _child(_MAKE_SCRATCH, tmp)
  try:
    open(os.path.join(dead_root, "left.keras"), "w").close()
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    legacy = tmp_path / "mpistrategy-rank3-legacy"  # no owner file
    legacy.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    link = tmp_path / "mpistrategy-rank4-link"
    link.symlink_to(outside)
    assert os.path.isdir(dead_root) and os.path.exists(
        os.path.join(live_root, _OWNER))

    checkpoint._remove_abandoned_scratch(tmp)  # pylint: disable=protected-access

    assert not os.path.exists(dead_root)
    assert os.path.isdir(live_root)
    assert legacy.is_dir() and (outside / "keep").exists() and link.is_symlink()
  finally:
    live.kill()
    dead.kill()
    live.wait(30)


@pytest.mark.timeout(120)
def test_a_normal_exit_removes_the_scratch_directory(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-c", textwrap.dedent("""
          from mpistrategy import checkpoint
          checkpoint.set_world(1, 2)
          print(checkpoint.mirror_path("/x/y"))
      """)],
      env=dict(os.environ, TMPDIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="3"),
      capture_output=True, text=True, timeout=100, check=True)
  assert str(tmp_path) in proc.stdout
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [
    ValueError("Received: filepath=/s/mpistrategy-rank1-ab/data/m"),
    OSError(2, "No such file", "/s/mpistrategy-rank1-ab/data/m"),
    tf.errors.NotFoundError(None, None,
                            "open /s/mpistrategy-rank1-ab/data/m failed"),
], ids=["ValueError", "OSError", "OpError"])
def test_errors_name_the_users_path(error, monkeypatch):
  monkeypatch.setitem(checkpoint._STATE, "rank", 1)  # pylint: disable=protected-access
  monkeypatch.setitem(checkpoint._STATE, "scratch", "/s/mpistrategy-rank1-ab")  # pylint: disable=protected-access
  with pytest.raises(type(error)) as raised:
    with checkpoint._naming_user_path("m", "/s/mpistrategy-rank1-ab/data/m"):  # pylint: disable=protected-access
      raise error
  assert raised.value is error
  assert "mpistrategy-rank1" not in str(error), str(error)
  assert "m" in str(error)
  if isinstance(error, OSError):
    assert error.filename == "m" and error.errno == 2


def test_a_save_removes_temporary_names_of_killed_writers_only(
    tmp_path, monkeypatch):
  monkeypatch.setattr(checkpoint, "_SWEPT", set())
  host = checkpoint._host_tag()  # pylint: disable=protected-access
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait(30)
  alive = subprocess.Popen([sys.executable, "-c", "import time; "
                            "time.sleep(60)"])
  try:
    names = {
        "dead_file": f".mpistrategy-tmp-{gone.pid}-{host}-0123abcd-m.keras",
        "dead_dir": f".mpistrategy-tmp-{gone.pid}-{host}-4567abcd-ckpt-4_temp",
        "alive": f".mpistrategy-tmp-{alive.pid}-{host}-89abcdef-m.keras",
        "mine": f".mpistrategy-tmp-{os.getpid()}-{host}-00000000-m.keras",
        "other_host": f".mpistrategy-tmp-{gone.pid}-0000beef-11111111-m.keras",
        "older_format": ".mpistrategy-tmp-0123456789ab-m.keras",
        "users": "m.keras",
    }
    for key, name in names.items():
      if key == "dead_dir":
        (tmp_path / name).mkdir()
        (tmp_path / name / "part").write_text("x")
      else:
        (tmp_path / name).write_text("x")
    new = checkpoint._temp_sibling(str(tmp_path / "m.keras"))  # pylint: disable=protected-access
    assert checkpoint._TEMP_NAME.match(os.path.basename(new)), new  # pylint: disable=protected-access
    left = set(os.listdir(tmp_path))
    assert names["dead_file"] not in left and names["dead_dir"] not in left
    for key in ("alive", "mine", "other_host", "older_format", "users"):
      assert names[key] in left, (key, left)
  finally:
    alive.kill()
    alive.wait(30)


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device", "/data/m.keras"),
    tf.errors.ResourceExhaustedError(
        None, None, "/data/m.index; No space left on device (errno = 28)"),
], ids=["OSError", "OpError"])
def test_a_full_scratch_disk_on_a_rank_above_0_is_named(error, monkeypatch):
  monkeypatch.setitem(checkpoint._STATE, "rank", 1)  # pylint: disable=protected-access
  monkeypatch.setitem(checkpoint._STATE, "scratch", "/s/mpistrategy-rank1-ab")  # pylint: disable=protected-access
  with pytest.raises(OSError) as raised:
    checkpoint._raise_if_scratch_full(error, "/data/m.keras")  # pylint: disable=protected-access
  text = str(raised.value)
  assert raised.value.errno == 28 and raised.value.__cause__ is error
  for part in ("rank 1", "/data/m.keras", "/s/mpistrategy-rank1-ab", "TMPDIR"):
    assert part in text, text
  # Other errors pass through unchanged.
  checkpoint._raise_if_scratch_full(OSError(2, "No such file"), "/data/m")  # pylint: disable=protected-access


def test_a_full_disk_under_a_staged_write_names_tmpdir(tmp_path, monkeypatch):
  # Keras files are staged in $TMPDIR before the copy next to the user's
  # path; a full $TMPDIR gave a bare "No space left on device".
  monkeypatch.setitem(checkpoint._STATE, "scratch", str(tmp_path / "scratch"))  # pylint: disable=protected-access
  (tmp_path / "scratch").mkdir()

  def write(target):
    raise OSError(28, "No space left on device", target)

  with pytest.raises(OSError) as raised:
    checkpoint._write_atomically(str(tmp_path / "m.keras"), write, stage=True)  # pylint: disable=protected-access
  text = str(raised.value)
  assert raised.value.errno == 28, text
  for part in ("rank 0", str(tmp_path / "m.keras"), "first", "TMPDIR"):
    assert part in text, text
  assert sorted(os.listdir(tmp_path)) == ["scratch"]
  assert os.listdir(tmp_path / "scratch") == []


def test_a_directory_another_writer_made_meanwhile_is_replaced_entry_by_entry(
    tmp_path):
  # Ranks saving their own object (not the strategy's) to one path all
  # write it: a SavedModel directory renamed into place after another
  # rank's appeared failed with ENOTEMPTY.
  new, path = tmp_path / "new", tmp_path / "saved"
  for directory, text in ((new, "mine"), (path, "theirs")):
    (directory / "variables").mkdir(parents=True)
    (directory / "saved_model.pb").write_text(text)
    (directory / "variables" / "data").write_text(text)
  (path / "fingerprint.pb").write_text("theirs only")
  checkpoint._rename_to_new_name(str(new), str(path))  # pylint: disable=protected-access
  assert (path / "saved_model.pb").read_text() == "mine"
  assert (path / "variables" / "data").read_text() == "mine"
  assert (path / "fingerprint.pb").read_text() == "theirs only"
  assert not new.exists()
  # Anything else still fails as the rename did.
  (tmp_path / "file").write_text("x")
  (tmp_path / "dir").mkdir()
  with pytest.raises(NotADirectoryError):
    checkpoint._rename_to_new_name(str(tmp_path / "dir"),  # pylint: disable=protected-access
                                   str(tmp_path / "file"))
