"""The Horovod-style TF2 scripts in examples/horovod/ run on 2 ranks.

They are written as Horovod users write them, importing mpistrategy.horovod
in place of horovod.  Each job is kept short (HVD_EXAMPLE_STEPS /
HVD_EXAMPLE_EPOCHS, tiny benchmark batches); each must exit 0 on both ranks
with the trainable weights identical on both ranks, checked twice: the
digest each script prints itself ("rank R weights sha256 H") and the one
tests/launcher/scripts/horovod_example.py prints after the script returns.
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
  own = dict((int(rank), digest) for rank, digest in re.findall(
      r"rank (\d+) weights sha256 ([0-9a-f]{64})", job.stdout))
  assert sorted(own) == [0, 1], job.describe()
  assert own[0] == own[1], (
      "the script's own weight digests differ between ranks\n"
      + job.describe())
  return job


def _run_failing(launch, tmp_path, example, args=(), timeout=120):
  job = launch("horovod_example.py", np=2, timeout=timeout,
               args=[f"--example={os.path.join(EXAMPLES, example)}",
                     f"--workdir={tmp_path}", "--", *args])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode != 0, job.describe()
  return job


@pytest.mark.timeout(300)
def test_custom_loop_mnist(launch, tmp_path):
  job = _run(launch, tmp_path, "custom_loop_mnist.py",
             env={"HVD_EXAMPLE_STEPS": "40"})
  losses = [float(x) for x in re.findall(
      r"step \d+/20  loss ([0-9.]+)", job.rank_text(0))]
  assert len(losses) == 2, job.describe()  # steps 0 and 10 of 20 per rank
  assert all(l > 0 for l in losses), job.describe()
  # Rank 0 alone prints the loss.
  assert not re.search(r"step \d+/20  loss", job.rank_text(1)), (
      job.describe())


@pytest.mark.timeout(300)
def test_keras_mnist_prints_accuracy(launch, tmp_path):
  job = _run(launch, tmp_path, "keras_mnist.py",
             env={"HVD_EXAMPLE_STEPS": "40", "HVD_EXAMPLE_EPOCHS": "2"})
  final = re.findall(r"final accuracy ([0-9.]+)", job.stdout)
  assert len(final) == 1, job.describe()  # rank 0 only
  accuracy = float(final[0])
  print("keras_mnist: final accuracy", accuracy)
  assert 0.0 <= accuracy <= 1.0, job.describe()
  assert "Epoch 2/2" in job.stdout, job.describe()
  # ModelCheckpoint runs on rank 0 only, once per epoch.
  for epoch in (1, 2):
    assert os.path.exists(
        os.path.join(tmp_path, f"checkpoint-{epoch}.weights.h5")), (
            job.describe())


@pytest.mark.timeout(300)
def test_synthetic_benchmark(launch, tmp_path):
  job = _run(launch, tmp_path, "synthetic_benchmark.py",
             args=["--batch-size", "4", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "2", "--num-iters", "2"])
  text = job.rank_text(0)
  assert "Number of CPUs: 2" in text, job.describe()
  assert len(re.findall(r"Iteration \d: [0-9.]+ img/s per CPU", text)) == 2, (
      job.describe())
  assert re.search(
      r"Total img/s on 2 CPU\(s\): [0-9.]+ \+- [0-9.]+", text), job.describe()
  assert "img/s" not in job.rank_text(1), job.describe()


@pytest.mark.timeout(120)
def test_synthetic_benchmark_rejects_unknown_model(launch, tmp_path):
  job = _run_failing(launch, tmp_path, "synthetic_benchmark.py",
                     args=["--model", "NoSuchNet"])
  # argparse's message, from every rank.
  for rank in (0, 1):
    assert "no model 'NoSuchNet'" in job.rank_text(rank), job.describe()
