"""Run without mpirun (a world of size 1), and memory: a short soak on 2
ranks, and a grouped allreduce that must not hold a buffer the group's size.
"""

import os
import re

import pytest

from _job_env import ROOT


@pytest.mark.timeout(120)
def test_runs_without_mpirun_as_world_of_one(launch):
  job = launch("single.py", mpi=False, timeout=90)
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  init = job.event("INIT", 0)
  assert init.text == "rank=0 size=1 local_rank=0 local_size=1", \
      job.describe()
  checks = job.events("CHECK", rank=0)
  assert len(checks) == 6, job.describe()
  wrong = [c.text for c in checks if not c.text.endswith(" ok")]
  assert not wrong, "\n".join(wrong) + "\n" + job.describe()
  job.event("DONE", 0)


@pytest.mark.timeout(240)
def test_short_soak_rss_growth_below_5_percent(launch):
  """300 Keras steps under MPIStrategy on 2 ranks; RSS grows < 5 %."""
  job = launch(os.path.join(ROOT, "bench", "soak.py"), np=2, timeout=210,
               args=["--steps", "300", "--measure-at", "100",
                     "--max-growth", "5"])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  found = {}
  for rank in range(2):
    for line in job.rank_lines(rank):
      m = re.match(r"rank (\d+): RSS at step (\d+): ([0-9.]+) MiB; at step "
                   r"(\d+): ([0-9.]+) MiB; growth ([-+0-9.]+) %", line)
      if m:
        found[rank] = float(m.group(6))
        assert int(m.group(2)) == 100 and int(m.group(4)) == 300, line
  assert sorted(found) == [0, 1], "not every rank reported its RSS\n" + \
      job.describe()
  for rank, growth in found.items():
    assert growth < 5.0, (f"rank {rank}: RSS grew {growth:+.2f} % between "
                          f"step 100 and 300\n" + job.describe())
  assert job.returncode == 0, job.describe()


@pytest.mark.timeout(180)
def test_allreduce_bench_smoke(launch):
  """bench/allreduce.py runs every form and prints a verdict per target.

  Tiny sizes and few iterations: this checks the script, not the numbers
  (its own result checks fail the run if a collective is wrong).
  """
  job = launch(os.path.join(ROOT, "bench", "allreduce.py"), np=2,
               timeout=150,
               args=["--sizes", "4KB,3x4KB", "--iters", "10", "--rounds", "2"])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  text = "\n".join(job.rank_lines(0))
  for row in ["| 4 KB, one tf.function call |", "| 4 KB, one eager call |",
              "| 4 KB, per op, 30 chained in one tf.function |",
              "| 3 x 4 KB grouped_allreduce vs raw fused, per op, 30 chained",
              "| 3 x 4 KB as separate allreduces in one tf.function |"]:
    assert row in text, f"missing row {row!r}\n" + job.describe()
  verdicts = re.findall(r"^- 4 KB latency < 0\.1 ms \((.*)\): .* -> "
                        r"(PASS|MISS)$", text, re.M)
  assert [form for form, _ in verdicts] == [
      "one tf.function call, incl. TF dispatch", "one eager call",
      "per op, chained in one tf.function"], job.describe()


@pytest.mark.timeout(120)
def test_group_floor_bench_smoke(launch):
  """bench/group_floor.py times its three variants in a world of one."""
  job = launch(os.path.join(ROOT, "bench", "group_floor.py"), mpi=False,
               timeout=90,
               args=["--tensors", "3", "--elements", "4", "--chain", "2",
                     "--calls", "2", "--blocks", "1"])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  rows = re.findall(r"^\| (.+?) \| ([0-9.]+) \| ([0-9.]+) \|$", job.stdout,
                    re.M)
  assert [label for label, _, _ in rows] == [
      "tf.identity_n", "tf.split(tf.concat(...))", "ops.grouped_allreduce"
  ], job.describe()
  for label, fastest, median in rows:
    assert 0 < float(fastest) <= float(median), (label, job.describe())


@pytest.mark.timeout(120)
def test_group_floor_bench_refuses_several_ranks(launch):
  job = launch(os.path.join(ROOT, "bench", "group_floor.py"), np=2,
               timeout=90, args=["--blocks", "1"])
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode != 0, job.describe()
  assert "run it without mpirun" in job.output, job.describe()


@pytest.mark.timeout(180)
def test_grouped_allreduce_in_place_takes_no_group_buffer(launch):
  """Shared memory reduces the group in place: peak as one allreduce each."""
  job = launch("group_memory.py", np=2, timeout=150)
  job.assert_no_leftovers()
  assert not job.timed_out and job.returncode == 0, job.describe()
  for rank in range(2):
    peaks = {}
    for event in job.events("PEAK", rank=rank):
      name, mib, verdict = event.text.split(" ", 2)
      assert verdict == "ok", event.text + "\n" + job.describe()
      peaks[name] = float(mib)
    assert sorted(peaks) == ["grouped", "single"], job.describe()
    # The old kernel allocated 32 MiB more (the two tensors' buffer).
    assert peaks["grouped"] <= peaks["single"] + 4, (
        f"rank {rank}: {peaks}\n" + job.describe())
