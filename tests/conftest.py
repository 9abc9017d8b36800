"""Shared pytest setup for tests/single, tests/parallel and tests/launcher.

* The tests import the *installed* mpistrategy (`make install` puts it into
  .venv), never the checkout: the session stops at once when the package is
  not installed, is imported from the checkout, or differs from the checkout
  (a stale install), naming the fix.
* Under mpirun (tests/mpirun_pytest.sh): every rank runs the same tests in the
  same order; rank 0 reports normally, the other ranks print only failures,
  errors and a one-line summary, each tagged with the rank.
* A session that runs no tests is a failure (exit 1), never a silent success:
  "0 tests collected" usually means a broken import or a wrong path.
"""
import filecmp
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _env_int(*names):
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


# Set by mpirun (Open MPI) / mpiexec (MPICH, PMI); None outside mpirun.
MPI_RANK = _env_int("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
MPI_SIZE = _env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def installed_package_problem():
    """Why the importable mpistrategy is not the installed copy of the checkout.

    Returns:
      None when `import mpistrategy` finds an installed copy (outside the
      checkout) whose Python files and op library equal the checkout's;
      otherwise a message that says what is wrong and how to fix it.
    """
    spec = importlib.util.find_spec("mpistrategy")
    if spec is None or not spec.origin:
        return ("mpistrategy is not installed in %s: run `make install` "
                "(the tests use the installed package)" % sys.executable)
    installed = os.path.dirname(spec.origin)
    checkout = os.path.join(ROOT, "mpistrategy")
    if os.path.realpath(installed) == os.path.realpath(checkout):
        return ("mpistrategy is imported from the checkout (%s), not from the "
                "installed package: run pytest as `python -P -m pytest` (or "
                "the pytest script) without the checkout on PYTHONPATH"
                % checkout)
    stale = []
    for folder, _, files in os.walk(checkout):
        for name in files:
            if not name.endswith((".py", ".so")):
                continue
            source = os.path.join(folder, name)
            copy = os.path.join(installed, os.path.relpath(source, checkout))
            if not os.path.exists(copy) or not filecmp.cmp(source, copy,
                                                          shallow=False):
                stale.append(os.path.relpath(source, ROOT))
    if stale:
        listed = ", ".join(sorted(stale)[:5]) + (
            " ..." if len(stale) > 5 else "")
        return ("the installed mpistrategy (%s) differs from the checkout in "
                "%s: run `make install`" % (installed, listed))
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    problem = installed_package_problem()
    if problem:
        pytest.exit("tests/conftest.py: " + problem, returncode=3)
    if MPI_RANK:  # a non-zero rank: failures and a summary line only
        config.option.verbose = min(config.option.verbose, -2)
        config.option.reportchars = "fE"
        # No "collected N items", no "rootdir:" header.
        config.option.no_header = True
        config.option.no_summary = False


def pytest_report_teststatus(report, config):
    """Non-zero ranks: no progress letters (failures are listed at the end)."""
    if not MPI_RANK or hasattr(report, "wasxfail"):
        return None
    if report.passed and report.when == "call":
        return "passed", "", ""
    if report.failed:
        if report.when == "call":
            return "failed", "", "FAILED"
        return "error", "", "ERROR"
    return None


def pytest_report_header(config):
    if MPI_RANK is not None:
        return ("mpi: rank %d of %s (rank 0 reports; other ranks print "
                "failures only)" % (MPI_RANK, MPI_SIZE))
    return None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Non-zero ranks: tag the failure report with the rank; one status line."""
    if not MPI_RANK:
        return (yield)
    stats = terminalreporter.stats
    failed = len(stats.get("failed", [])) + len(stats.get("error", []))
    tag = "[rank %d/%s]" % (MPI_RANK, MPI_SIZE)
    if failed:
        terminalreporter.write_sep(
            "#", "%s failures and errors of rank %d" % (tag, MPI_RANK),
            red=True)
    try:
        return (yield)
    finally:
        if failed:
            terminalreporter.write_line(
                "%s FAILED: %d failed/errors" % (tag, failed), red=True)
        elif terminalreporter._session is not None and \
                terminalreporter._session.testscollected == 0:
            terminalreporter.write_line("%s no tests ran" % tag, red=True)
        else:
            terminalreporter.write_line("%s ok: %d passed, %d skipped" % (
                tag, len(stats.get("passed", [])),
                len(stats.get("skipped", []))))


def pytest_sessionfinish(session, exitstatus):
    """Turn "no tests ran" (exit 5) into a failure."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED or (
            session.testscollected == 0 and exitstatus == pytest.ExitCode.OK):
        rep = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = ("ERROR: no tests ran (0 collected/selected) -- treated as a "
               "failure; check the test paths, -k/-m filters and import "
               "errors")
        if rep is not None:
            rep.write_line(msg, red=True, bold=True)
        else:
            sys.stderr.write(msg + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
