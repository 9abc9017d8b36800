"""Fixtures shared by the single-process tests (plain pytest, no mpirun)."""

import os

import pytest

import mpistrategy


@pytest.fixture(scope="module")
def single_process_engine():
  """Starts a 1-rank engine for the module; skips the module under mpirun."""
  if "OMPI_COMM_WORLD_SIZE" in os.environ:
    pytest.skip("single-process tests run without mpirun")
  mpistrategy.init()
  yield
