"""Horovod's TF2 examples (examples/horovod/) run on 2 ranks through
mpistrategy.horovod, with only their import lines changed.

Each job is kept short (HVD_EXAMPLE_STEPS / HVD_EXAMPLE_EPOCHS, a small model
for the benchmark); each must exit 0 on both ranks with the trainable weights
identical on both ranks (tests/launcher/scripts/horovod_example.py prints a
digest per rank).
"""

import os
import re

import pytest

from _job_env import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "horovod")


def _run(launch, tmp_path, example, env=None, args=(), timeout=240):
  job = launch("horovod_example.py", np=2, timeout=timeout, env=env,
               args=[f"--example={os.path.join(EXAMPLES, example)}",
                     f"--workdir={tmp_path}", "--", *args])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  # Searched anywhere in the output, not per line: Keras' progress bar on
  # rank 0 ends its lines with "\r", so mpirun can glue rank 1's lines to it.
  digests = dict(
      (int(rank), (int(count), digest)) for rank, count, digest in re.findall(
          r"@@ (\d+) [0-9.]+ WEIGHTS (\d+) ([0-9a-f]{64})", job.stdout))
  done = set(int(r) for r in re.findall(r"@@ (\d+) [0-9.]+ DONE", job.stdout))
  assert sorted(digests) == [0, 1] and done == {0, 1}, job.describe()
  assert digests[0][0] > 0, job.describe()
  assert digests[0] == digests[1], (
      "the ranks' weights differ after training\n" + job.describe())
  return job


@pytest.mark.timeout(300)
def test_tensorflow2_mnist(launch, tmp_path):
  job = _run(launch, tmp_path, "tensorflow2_mnist.py",
             env={"HVD_EXAMPLE_STEPS": "40"})
  losses = [float(m.group(1)) for m in re.finditer(
      r"Step #\d+\tLoss: ([0-9.]+)", job.rank_text(0))]
  assert len(losses) == 2, job.describe()  # steps 0 and 10 of 20 per rank
  assert os.path.exists(os.path.join(tmp_path, "checkpoint")), job.describe()


@pytest.mark.timeout(300)
def test_tensorflow2_keras_mnist_prints_accuracy(launch, tmp_path):
  job = _run(launch, tmp_path, "tensorflow2_keras_mnist.py",
             env={"HVD_EXAMPLE_STEPS": "40", "HVD_EXAMPLE_EPOCHS": "2"})
  # Only rank 0 trains with verbose=1 (Horovod's example), so every
  # progress line is rank 0's.
  accuracies = [float(a) for a in re.findall(r"accuracy: ([0-9.]+)",
                                             job.stdout)]
  assert len(accuracies) >= 2, job.describe()
  print("tensorflow2_keras_mnist: last accuracy printed", accuracies[-1])
  assert "Epoch 2/2" in job.stdout, job.describe()
  assert os.path.exists(os.path.join(tmp_path, "checkpoint-2.h5")), (
      job.describe())


@pytest.mark.timeout(300)
def test_tensorflow2_synthetic_benchmark(launch, tmp_path):
  job = _run(launch, tmp_path, "tensorflow2_synthetic_benchmark.py",
             args=["--no-cuda", "--model", "MobileNetV3Small",
                   "--batch-size", "4", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "2", "--num-iters", "2"])
  text = job.rank_text(0)
  assert "Number of CPUs: 2" in text, job.describe()
  assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", text), (
      job.describe())
