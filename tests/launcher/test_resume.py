"""Kill a 2-rank Keras job after epoch 1, restart it, check it resumes.

pytest spawns `mpirun -np 2 python tests/launcher/test_resume.py --worker`
(with a `timeout`).  The first run crashes every rank (`os._exit`, like a
killed job) at the start of epoch 2 when MPISTRATEGY_TEST_CRASH_AT_EPOCH is
set; BackupAndRestore wrote rank 0's backup after epochs 0 and 1.  The
second run, same command and same user code, must start at epoch 2 on every
rank and end with identical weights on both ranks.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.abspath(__file__)


def _worker(backup_dir, out_prefix):
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import hashlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  import mpistrategy  # pylint: disable=g-import-not-at-top

  strategy = mpistrategy.MPIStrategy()
  rank = mpistrategy.rank()
  crash_at = int(os.environ.get("MPISTRATEGY_TEST_CRASH_AT_EPOCH", "-1"))
  x, y = load_digits(return_X_y=True)
  x, y = (x[:256] / 16.0).astype(np.float32), y[:256].astype(np.int32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  epochs = []

  class Record(keras.callbacks.Callback):

    def on_epoch_begin(self, epoch, logs=None):
      if epoch == crash_at:
        os._exit(17)  # pylint: disable=protected-access
      epochs.append(epoch)

  model.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[
      keras.callbacks.BackupAndRestore(backup_dir), Record()])
  digest = hashlib.sha256(b"".join(
      np.ascontiguousarray(w.numpy()).tobytes() for w in model.weights))
  with open("%s.%d.json" % (out_prefix, rank), "w") as f:
    json.dump({"epochs": epochs, "digest": digest.hexdigest()}, f)


def _mpirun(args, env, timeout):
  cmd = ["timeout", "-k", "10", str(timeout), "mpirun", "-np", "2",
         "--oversubscribe", "--bind-to", "none",
         "--mca", "btl_vader_single_copy_mechanism", "none",
         "-x", "TF_CPP_MIN_LOG_LEVEL",
         "-x", "MPISTRATEGY_TEST_CRASH_AT_EPOCH",
         sys.executable, HERE, "--worker"] + args
  return subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, check=False)


@pytest.mark.timeout(400)
def test_killed_job_resumes_on_every_rank():
  work = tempfile.mkdtemp(prefix="mpistrategy-resume-")
  try:
    backup, out = os.path.join(work, "backup"), os.path.join(work, "result")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MPISTRATEGY_TEST_CRASH_AT_EPOCH="2")
    first = _mpirun([backup, out], env, 180)
    assert first.returncode not in (0, 124, 137), first.stdout[-3000:]
    assert os.path.exists(os.path.join(backup, "latest.weights.h5"))
    assert not os.path.exists(out + ".0.json")
    env["MPISTRATEGY_TEST_CRASH_AT_EPOCH"] = "-1"
    second = _mpirun([backup, out], env, 180)
    assert second.returncode == 0, second.stdout[-3000:]
    results = []
    for r in range(2):
      with open("%s.%d.json" % (out, r)) as f:
        results.append(json.load(f))
    assert results[0]["epochs"] == [2, 3], results
    assert results[1]["epochs"] == [2, 3], results
    assert results[0]["digest"] == results[1]["digest"]
    assert not os.path.exists(backup)  # removed after a completed fit
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__" and "--worker" in sys.argv:
  _worker(*sys.argv[sys.argv.index("--worker") + 1:])
