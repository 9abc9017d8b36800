"""A Keras call that communicates, made on rank 0 only, fails naming the call.

Horovod programs often write `if rank == 0: model.evaluate(...)`.  Under
MPIStrategy `evaluate` and `predict` are collective, so the other ranks
never join rank 0's collectives.  Expected: the stall warning names the
collective as `Model.evaluate/...`; rank 0's error names it too and carries
a note stating the rule (every rank must make the same Keras/TF calls that
communicate); the job ends, non-zero, within the stall timeout plus a
margin, and no process is left.
"""

import re

import pytest

WARNING_S = 2
TIMEOUT_S = 5
MARGIN_S = 20  # MPI_Abort, interpreter teardown on a shared 2-core machine
ENV = {"MPISTRATEGY_STALL_WARNING_SECONDS": str(WARNING_S),
       "MPISTRATEGY_STALL_TIMEOUT_SECONDS": str(TIMEOUT_S)}


def _check(job, call):
  assert not job.timed_out, job.describe()
  assert job.returncode != 0, job.describe()
  assert not job.events("UNEXPECTED_OK", rank=0), job.describe()
  assert not job.events("OTHER_ERROR", rank=0), job.describe()
  error = job.event("ERROR", 0).text
  assert f"Model.{call}/" in error, job.describe()  # the collective's name
  assert f"raised in Model.{call}() on rank 0" in error, job.describe()
  assert "Every rank must make the same Keras/TF calls that communicate" \
      in error, job.describe()
  ended = job.end - job.event("CALL", 0).time
  assert ended <= TIMEOUT_S + MARGIN_S, (
      f"the job ended {ended:.1f} s after rank 0's {call}; stall timeout "
      f"{TIMEOUT_S} s\n" + job.describe())
  job.assert_no_leftovers()
  return error


@pytest.mark.timeout(240)
@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_rank_0_only_call_while_the_others_wait(launch, call):
  job = launch("rank0_only_call.py", np=2, timeout=200, env=ENV,
               args=["--call", call, "--others", "barrier"])
  _check(job, call)
  stalled = [l for l in job.output.splitlines() if "Stalled:" in l]
  assert any(f"Model.{call}/" in l for l in stalled), job.describe()
  assert "see the stall message above" in job.event("ERROR", 0).text, \
      job.describe()


@pytest.mark.timeout(240)
def test_rank_0_only_evaluate_while_the_others_exit(launch):
  job = launch("rank0_only_call.py", np=2, timeout=200, env=ENV,
               args=["--call", "evaluate", "--others", "exit"])
  error = _check(job, "evaluate")
  # Rank 1 exited, so no stall message came; the error names rank 1 and
  # says it exited (it said "shut down", as for a shutdown() call).
  assert re.search(r"rank 1 \(host [^)]*\) exited \(its script ended, or "
                   r"called sys.exit\) before the other ranks", error), (
                       job.describe())
  assert "stall message" not in error, job.describe()
  assert "the error above names the rank that stopped" in error, \
      job.describe()


@pytest.mark.timeout(240)
def test_another_ranks_exception_in_fit_is_no_broken_rule(launch):
  # Every rank called fit; rank 1 raised in it.  Rank 0's error reports
  # rank 1's exception, without the note about calls made on some ranks
  # only (nor its "see the stall message above": there is none).
  job = launch("rank0_only_call.py", np=2, timeout=200, env=ENV,
               args=["--others", "raise"])
  assert not job.timed_out, job.describe()
  assert job.returncode != 0, job.describe()
  error = job.event("ERROR", 0).text
  assert "raised RuntimeError: deliberate failure on a rank > 0" in error, \
      job.describe()
  assert "Every rank must make the same" not in error, job.describe()
  job.assert_no_leftovers()
