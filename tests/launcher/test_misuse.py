"""Bad configuration, local misuse and cross-rank mismatches, end to end.

One 2-rank job (scripts/misuse.py) goes through every case and prints, per
rank, the exception class and message of each.  The tests check that every
rank got the right error class with a message naming what is wrong (the
option and its accepted values; the tensor and the differing values), that
nothing hung, and that the engine still works afterwards.
"""

import re

import pytest

NP = 2


@pytest.fixture(scope="module")
def misuse_job(launch):
  job = launch("misuse.py", np=NP, timeout=120,
               env={"MPISTRATEGY_FUSION_THRESHOLD_BYTES": "abc",
                    # A broken negotiation fails this job instead of hanging.
                    "MPISTRATEGY_STALL_TIMEOUT_SECONDS": "30"})
  yield job
  job.assert_no_leftovers()


def _case(job, event, case, rank):
  """(exception class or "OK", message) of `case` on `rank`."""
  for ev in job.events(event, rank=rank):
    name, _, rest = ev.text.partition(" ")
    if name == case:
      cls, _, message = rest.partition(" ")
      return cls.rstrip(":"), message
  pytest.fail(f"rank {rank} printed no {event} {case} result (hang or "
              f"crash before it?)\n" + job.describe())
  return None


def _check_all_ranks(job, event, case, classes, *patterns):
  for rank in range(NP):
    cls, message = _case(job, event, case, rank)
    assert cls in classes, (
        f"rank {rank}, {case}: expected one of {classes}, got {cls}: "
        f"{message}\n" + job.describe())
    for pattern in patterns:
      assert re.search(pattern, message, re.IGNORECASE), (
          f"rank {rank}, {case}: message does not match {pattern!r}: "
          f"{message}")


@pytest.mark.timeout(150)
def test_job_completes_on_every_rank(misuse_job):
  job = misuse_job
  assert not job.timed_out, "the job hung\n" + job.describe()
  for rank in range(NP):
    job.event("DONE", rank)
  assert job.returncode == 0, job.describe()


# --- configuration -----------------------------------------------------------


@pytest.mark.timeout(150)
def test_unparsable_env_value(misuse_job):
  _check_all_ranks(misuse_job, "CFG", "env_abc", ("ValueError",),
                   r"MPISTRATEGY_FUSION_THRESHOLD_BYTES", r"'abc'",
                   r"integer")
  for rank in range(NP):
    assert any(e.text == "initialized_after_env_abc False"
               for e in misuse_job.events("CFG", rank=rank)), \
        misuse_job.describe()


@pytest.mark.timeout(150)
def test_negative_env_value(misuse_job):
  _check_all_ranks(misuse_job, "CFG", "env_negative", ("ValueError",),
                   r"fusion_threshold_bytes", r"-5", r">= 0")


@pytest.mark.timeout(150)
def test_invalid_options_fields(misuse_job):
  _check_all_ranks(misuse_job, "CFG", "options_negative", ("ValueError",),
                   r"fusion_threshold_bytes", r">= 0")
  _check_all_ranks(misuse_job, "CFG", "options_type", ("TypeError",),
                   r"cycle_time_ms", r"number")
  _check_all_ranks(misuse_job, "CFG", "init_not_options", ("TypeError",),
                   r"Options")


@pytest.mark.timeout(150)
def test_world_query_after_a_failed_start_raises_instead_of_waiting(
    misuse_job):
  for rank in range(NP):
    cls, message = _case(misuse_job, "CFG", "start_fails", rank)
    assert cls == ("ValueError" if rank == 0 else "FailedPreconditionError"), (
        message)
    cls, message = _case(misuse_job, "CFG", "rank_after_failed_start", rank)
    if rank == 0:
      assert cls == "ValueError" and "failed to start on this rank" in (
          message), message
    else:  # its engine stopped on rank 0's error: it knows the world
      assert cls == "OK" and message.startswith(str(rank)), message


# --- local misuse ------------------------------------------------------------

_LOCAL_ERRORS = ("ValueError", "TypeError", "InvalidArgumentError")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["root_too_large", "root_negative"])
def test_bad_root_rank(misuse_job, case):
  _check_all_ranks(misuse_job, "MISUSE", case, _LOCAL_ERRORS,
                   r"root", r"\b(0|size|range|rank)")


@pytest.mark.timeout(150)
def test_non_tensor_input(misuse_job):
  _check_all_ranks(misuse_job, "MISUSE", "dict_input",
                   ("ValueError", "TypeError"), r"dict|tensor")


@pytest.mark.timeout(150)
def test_unknown_reduce_op(misuse_job):
  _check_all_ranks(misuse_job, "MISUSE", "bad_reduce_op",
                   ("ValueError", "TypeError"), r"median",
                   r"sum|average|ReduceOp")


# --- cross-rank mismatches ---------------------------------------------------

_MISMATCHES = {
    # case: regexes that must all be in the message (besides the name)
    "shape": [r"\b2\b", r"\b3\b", r"shape"],
    "dtype": [r"float32", r"float64"],
    "op": [r"sum", r"max"],
    "root": [r"root", r"\b0\b", r"\b1\b"],
    "collective": [r"allreduce", r"allgather"],
    "gather_shape": [r"\b3\b", r"\b4\b", r"shape"],
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(_MISMATCHES))
def test_mismatch_fails_on_every_rank(misuse_job, case):
  _check_all_ranks(misuse_job, "MM", case, ("FailedPreconditionError",),
                   rf"mm_{case}\b", *_MISMATCHES[case])


@pytest.mark.timeout(150)
def test_mismatch_inside_tf_function(misuse_job):
  _check_all_ranks(misuse_job, "MM", "shape_in_function",
                   ("FailedPreconditionError",), r"\b5\b", r"\b6\b")


@pytest.mark.timeout(150)
def test_engine_usable_after_errors(misuse_job):
  for rank in range(NP):
    cls, message = _case(misuse_job, "FINAL", "allreduce", rank)
    assert cls == "OK", f"rank {rank}: {cls}: {message}"
    assert any(e.text == "correct"
               for e in misuse_job.events("FINAL", rank=rank)), \
        misuse_job.describe()


@pytest.mark.timeout(150)
def test_uncaught_bad_env_value_ends_every_rank(launch):
  """A user who does not catch the ValueError: every rank exits, no hang.

  Also: a misspelt MPISTRATEGY_* variable is reported with a warning
  instead of being silently ignored, by rank 0 (ranks > 0 do not repeat
  Python warnings unless MPISTRATEGY_VERBOSE=1; see mpistrategy.quiet).
  """
  job = launch("single.py", np=NP, timeout=120,
               env={"MPISTRATEGY_CYCLE_TIME_MS": "-1",
                    "MPISTRATEGY_FUSION_TRESHOLD_BYTES": "1"})
  job.assert_no_leftovers()
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert job.returncode != 0, job.describe()
  for rank in range(NP):
    text = job.rank_text(rank)
    assert not job.events("INIT", rank=rank), job.describe()
    assert re.search(r"ValueError: .*cycle_time_ms.*> 0.*"
                     r"MPISTRATEGY_CYCLE_TIME_MS='-1'", text), (
                         f"rank {rank} did not report the bad value\n"
                         + job.describe())
    warned = re.search(r"unknown environment variable "
                       r"MPISTRATEGY_FUSION_TRESHOLD_BYTES", text)
    assert bool(warned) == (rank == 0), (
        f"rank {rank}: the misspelt variable's warning should be printed "
        "by rank 0 only\n" + job.describe())
