"""The package version and the TensorFlow and Keras releases it is tested with.

This is the one place for both: pyproject.toml reads `__version__` from here,
and `check_versions` compares the installed TensorFlow and Keras with the
tested series when `mpistrategy` is imported.
"""

import importlib.metadata
import warnings

__version__ = "0.1.0"

# Minor series that CI runs (requirements.txt pins one release of each).
# The op library is compiled against one TensorFlow minor release (its C++
# ABI); Keras matters because mpistrategy patches Keras internals.
TESTED_TENSORFLOW = ("2.21",)
TESTED_KERAS = ("3.15",)

# The Keras and TensorFlow internals that mpistrategy patches or reads
# (the inventory in mpistrategy/compat/__init__.py, and
# mpistrategy/_tf_private.py); a release that changes them can break it.
PATCHED_INTERNALS = (
    "keras LossScaleOptimizer.check_finite",
    "keras Progbar (utils.progbar)",
    "keras BatchNormalization.call / _moments",
    "keras Trainer._symbolic_build",
    "keras ModelCheckpoint / BackupAndRestore / TensorBoard / CSVLogger "
    "file handling",
    "keras Model.save / save_weights / export",
    "tf.train.Checkpoint / CheckpointManager file handling",
    "tf saved_model save_and_return_nodes (tf.saved_model.save, Model.export)",
    "keras Model.fit / evaluate / predict / save entry points (collective "
    "names)",
    "keras Optimizer.variables and Model.compile (mpistrategy.horovod only)",
    "tf.distribute MultiWorkerMirroredStrategy internals "
    "(CollectiveAllReduceExtended)",
)

_warned = False


def _series(version):
  """'2.21.0' -> '2.21'; None stays None."""
  if not version:
    return None
  return ".".join(version.split(".")[:2])


def _installed(distribution):
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def untested_versions_message(tensorflow_version, keras_version):
  """Says what is untested about these versions, or returns None.

  Args:
    tensorflow_version: The installed TensorFlow version, e.g. "2.21.0", or
      None when it is not installed.
    keras_version: The installed Keras version, or None.

  Returns:
    One message naming the installed and the tested versions and the patched
    internals, or None when both are in a tested series (or not installed).
  """
  found = []
  if (tensorflow_version and
      _series(tensorflow_version) not in TESTED_TENSORFLOW):
    found.append(f"TensorFlow {tensorflow_version}")
  if keras_version and _series(keras_version) not in TESTED_KERAS:
    found.append(f"Keras {keras_version}")
  if not found:
    return None
  tested = (f"TensorFlow {', '.join(t + '.x' for t in TESTED_TENSORFLOW)} "
            f"and Keras {', '.join(k + '.x' for k in TESTED_KERAS)}")
  return (f"mpistrategy {__version__} is tested with {tested}, but found "
          f"{' and '.join(found)}. It patches these internals, which a "
          f"different release may have changed: "
          f"{'; '.join(PATCHED_INTERNALS)}. If something fails, install the "
          "tested versions (pip install "
          f"'tensorflow=={TESTED_TENSORFLOW[-1]}.*' "
          f"'keras=={TESTED_KERAS[-1]}.*').")


def check_versions():
  """Warns once (UserWarning) when TensorFlow or Keras is an untested release.

  Reads the installed distributions' metadata only; imports neither.
  """
  global _warned
  if _warned:
    return
  _warned = True
  message = untested_versions_message(_installed("tensorflow"),
                                      _installed("keras"))
  if message:
    warnings.warn(message, UserWarning, stacklevel=3)
