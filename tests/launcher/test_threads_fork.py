"""Collectives from several threads and from forked children (issue #14).

Default-named eager collectives from threads other than the main thread
raise ValueError (they used to pair calls of different threads and return
wrong sums silently); explicitly named ones are all correct.  A forked
child's collective fails at once instead of hanging.
"""

import pytest


@pytest.mark.timeout(200)
def test_threads_get_a_clear_error_or_correct_results(launch):
  job = launch("threads_fork.py", np=2, timeout=150, args=["--case", "threads"])
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode == 0, job.describe()
    for rank in range(2):
      default = job.event("DEFAULT", rank).text
      assert "'wrong': 0" in default, default
      assert "'value_error': 4" in default, default
      assert "'other': 0" in default, default
      assert "pass name=" in default.lower(), default
      named = job.event("NAMED", rank).text
      assert "'ok': 80" in named and "'wrong': 0" in named, named
      job.event("FINISHED", rank)
  finally:
    job.assert_no_leftovers()


@pytest.mark.timeout(200)
def test_forked_child_fails_at_once(launch):
  job = launch("threads_fork.py", np=2, timeout=150, args=["--case", "fork"])
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode == 0, job.describe()
    for rank in range(2):
      for event in ("CHILD", "MP_CHILD"):
        text = job.event(event, rank).text
        assert text.startswith("OK "), text
        took = float(text.split()[1])
        assert took < 5, text
        assert "forked" in text and "fork" in text, text
        assert f"rank {rank} (host " in text, text
      assert "exit 0" in job.event("CHILD", rank).text
      job.event("PARENT_OK", rank)
      job.event("FINISHED", rank)
  finally:
    job.assert_no_leftovers()
