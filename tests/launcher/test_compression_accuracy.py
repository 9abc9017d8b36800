"""Gradient compression keeps the digits example's accuracy (2 ranks).

    .venv/bin/python -m pytest -q tests/launcher/test_compression_accuracy.py

Runs examples/keras_digits.py under `mpirun -np 2` three times with the same
seed -- uncompressed, `--compression fp16`, `--compression bf16` -- and
requires the compressed test accuracies to stay within 1 percentage point
(absolute) of the uncompressed one.  The test set has 360 samples, so 1
point is 3.6 samples.  Each run takes about 25 s on a 2-core machine.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "keras_digits.py")
SEED = 0
MAX_DROP = 0.01  # absolute accuracy
RUN_TIMEOUT_S = 240

_ACCURACY = re.compile(r"^test loss ([0-9.]+)  test accuracy ([0-9.]+)$")


def _train(launch, compression):
  """Runs the example on 2 ranks; returns rank 0's test accuracy."""
  job = launch(EXAMPLE, np=2, timeout=RUN_TIMEOUT_S,
               args=["--compression", compression, "--seed", str(SEED)])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  lines = job.rank_lines(0)
  assert any(line.endswith(f"compression {compression}") for line in lines), (
      job.describe())
  found = [m for m in map(_ACCURACY.match, lines) if m]
  assert len(found) == 1, "no 'test loss ... test accuracy ...' line\n" + (
      job.describe())
  return float(found[0].group(2))


@pytest.fixture(scope="module")
def uncompressed_accuracy(launch):
  return _train(launch, "none")


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_accuracy_within_one_point_of_uncompressed(launch, compression,
                                                    uncompressed_accuracy):
  accuracy = _train(launch, compression)
  print(f"digits test accuracy: none {uncompressed_accuracy:.4f}, "
        f"{compression} {accuracy:.4f}")
  assert uncompressed_accuracy > 0.9
  assert abs(accuracy - uncompressed_accuracy) <= MAX_DROP, (
      f"{compression}: test accuracy {accuracy:.4f} vs "
      f"{uncompressed_accuracy:.4f} uncompressed (seed {SEED}): more than "
      f"{MAX_DROP:.0%} apart")
