"""mpistrategy.Options: validation, environment overrides, merge/replace."""

import dataclasses
import warnings

import pytest

from mpistrategy import Options


def test_defaults():
  o = Options()
  assert o.fusion_threshold_bytes == 64 << 20
  assert o.cycle_time_ms == 1.0
  assert o.cache_capacity == 1024
  assert o.stall_warning_seconds == 60.0
  assert o.stall_timeout_seconds == 0.0
  assert o.peer_timeout_seconds == 120.0
  assert o.timeline == ""
  assert o.fusion_wait_ms == 0.0
  assert o.autotune is False
  assert o.autotune_log == ""
  assert o.hierarchical_allreduce is False
  assert o.data_plane == "auto"
  assert o.shm_bytes == 16 << 20
  assert o.abort_on_exception is True


def test_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    Options().cycle_time_ms = 3.0


@pytest.mark.parametrize("field, value, accepted", [
    ("fusion_threshold_bytes", -1, "an integer >= 0"),
    ("cycle_time_ms", 0, "a finite number > 0"),
    ("cycle_time_ms", float("nan"), "a finite number > 0"),
    ("cycle_time_ms", float("inf"), "a finite number > 0"),
    ("cache_capacity", -3, "an integer >= 0"),
    ("cache_capacity", 2**31, "an integer >= 0"),
    ("stall_warning_seconds", -0.5, "a number >= 0"),
    ("stall_timeout_seconds", -1, "a number >= 0"),
    ("peer_timeout_seconds", -1, "a number >= 0"),
    ("peer_timeout_seconds", float("inf"), "a number >= 0"),
    ("fusion_wait_ms", -0.1, "a number in [0, 1000]"),
    ("fusion_wait_ms", 1500, "a number in [0, 1000]"),
    ("fusion_wait_ms", float("nan"), "a number in [0, 1000]"),
])
def test_out_of_range_values_name_field_and_accepted_values(field, value,
                                                            accepted):
  with pytest.raises(ValueError) as info:
    Options(**{field: value})
  message = str(info.value)
  assert f"Options.{field}" in message
  assert accepted in message
  assert repr(float(value) if "number" in accepted else value) in message


@pytest.mark.parametrize("field, value", [
    ("fusion_threshold_bytes", 1.5),
    ("fusion_threshold_bytes", "64"),
    ("fusion_threshold_bytes", True),
    ("cycle_time_ms", "fast"),
    ("cycle_time_ms", None),
    ("cache_capacity", [1]),
    ("timeline", 3),
    ("autotune_log", 2.5),
    ("autotune", "yes"),
    ("fusion_wait_ms", "1ms"),
    ("hierarchical_allreduce", 1),
    ("data_plane", 1),
    ("shm_bytes", "16M"),
    ("abort_on_exception", "yes"),
])
def test_wrong_types(field, value):
  with pytest.raises(TypeError, match=f"Options.{field}"):
    Options(**{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("data_plane", "nccl", 'must be "auto", "mpi" or "shm", got \'nccl\''),
    ("data_plane", "", 'must be "auto", "mpi" or "shm"'),
    ("shm_bytes", (1 << 20) - 1, "must be an integer >= 1048576"),
    ("shm_bytes", -5, "must be an integer >= 1048576"),
])
def test_data_plane_values(field, value, message):
  with pytest.raises(ValueError, match=f"Options.{field} {message}"):
    Options(**{field: value})
  assert Options(data_plane=" Shm ").data_plane == "shm"


def test_normalization():
  import numpy as np
  o = Options(fusion_threshold_bytes=np.int64(5), cycle_time_ms=2,
              timeline=None)
  assert o.fusion_threshold_bytes == 5 and type(o.fusion_threshold_bytes) is int
  assert o.cycle_time_ms == 2.0 and isinstance(o.cycle_time_ms, float)
  assert o.timeline == ""


def test_zero_disables():
  o = Options(fusion_threshold_bytes=0, cache_capacity=0,
              stall_warning_seconds=0, stall_timeout_seconds=0)
  assert o.fusion_threshold_bytes == 0 and o.cache_capacity == 0


def test_from_env_overrides_every_field():
  env = {
      "MPISTRATEGY_FUSION_THRESHOLD_BYTES": "1024",
      "MPISTRATEGY_CYCLE_TIME_MS": " 2.5 ",
      "MPISTRATEGY_CACHE_CAPACITY": "7",
      "MPISTRATEGY_STALL_WARNING_SECONDS": "5",
      "MPISTRATEGY_STALL_TIMEOUT_SECONDS": "30",
      "MPISTRATEGY_PEER_TIMEOUT_SECONDS": "45",
      "MPISTRATEGY_TIMELINE": "/tmp/t.json",
      "MPISTRATEGY_HIERARCHICAL_ALLREDUCE": "TRUE",
      "MPISTRATEGY_ABORT_ON_EXCEPTION": "off",
      "MPISTRATEGY_FUSION_WAIT_MS": "0.5",
      "MPISTRATEGY_AUTOTUNE": "yes",
      "MPISTRATEGY_AUTOTUNE_LOG": "/tmp/a.csv",
      "MPISTRATEGY_CHECKPOINT_READ_TIMEOUT_SECONDS": "7.5",
      "MPISTRATEGY_VERBOSE": "1",
      "MPISTRATEGY_DATA_PLANE": " MPI",
      "MPISTRATEGY_SHM_BYTES": "2097152",
      "HOME": "/root",
  }
  o = Options.from_env(environ=env)
  assert o == Options(fusion_threshold_bytes=1024, cycle_time_ms=2.5,
                      cache_capacity=7, stall_warning_seconds=5.0,
                      stall_timeout_seconds=30.0, timeline="/tmp/t.json",
                      hierarchical_allreduce=True, abort_on_exception=False,
                      fusion_wait_ms=0.5, autotune=True,
                      autotune_log="/tmp/a.csv",
                      checkpoint_read_timeout_seconds=7.5,
                      peer_timeout_seconds=45.0, verbose=True,
                      data_plane="mpi", shm_bytes=2 << 20)
  # Every field has an environment variable.
  assert {f"MPISTRATEGY_{f.name.upper()}" for f in dataclasses.fields(Options)
         } <= set(env)


def test_from_env_applies_on_top_of_base():
  base = Options(cycle_time_ms=9.0, cache_capacity=3)
  o = Options.from_env(base, environ={"MPISTRATEGY_CACHE_CAPACITY": "11"})
  assert o.cycle_time_ms == 9.0 and o.cache_capacity == 11
  assert Options.from_env(base, environ={}) is base


def test_from_env_reads_os_environ(monkeypatch):
  monkeypatch.setenv("MPISTRATEGY_STALL_TIMEOUT_SECONDS", "12")
  assert Options.from_env().stall_timeout_seconds == 12.0


def test_peer_timeout_from_env(monkeypatch):
  monkeypatch.setenv("MPISTRATEGY_PEER_TIMEOUT_SECONDS", "7.5")
  assert Options.from_env().peer_timeout_seconds == 7.5
  monkeypatch.setenv("MPISTRATEGY_PEER_TIMEOUT_SECONDS", "0")
  assert Options.from_env().peer_timeout_seconds == 0.0
  monkeypatch.setenv("MPISTRATEGY_PEER_TIMEOUT_SECONDS", "-2")
  with pytest.raises(ValueError, match="MPISTRATEGY_PEER_TIMEOUT_SECONDS"):
    Options.from_env()


@pytest.mark.parametrize("variable, value, expected", [
    ("MPISTRATEGY_CYCLE_TIME_MS", "fast", "decimal number"),
    ("MPISTRATEGY_FUSION_THRESHOLD_BYTES", "64MB", "decimal integer"),
    ("MPISTRATEGY_ABORT_ON_EXCEPTION", "maybe", "1, true, yes, on, 0, false"),
    ("MPISTRATEGY_FUSION_THRESHOLD_BYTES", "-5", "an integer >= 0"),
    ("MPISTRATEGY_CYCLE_TIME_MS", "0", "a finite number > 0"),
])
def test_from_env_bad_values_name_variable_value_and_accepted(variable, value,
                                                              expected):
  with pytest.raises(ValueError) as info:
    Options.from_env(environ={variable: value})
  message = str(info.value)
  assert variable in message
  assert repr(value) in message
  assert expected in message


def test_from_env_warns_about_unknown_variables():
  with pytest.warns(UserWarning) as record:
    o = Options.from_env(environ={"MPISTRATEGY_FUSION_TRESHOLD": "1",
                                  "MPISTRATEGY_CYCLE_TIME_MS": "3"})
  assert o.cycle_time_ms == 3.0
  message = str(record[0].message)
  assert "MPISTRATEGY_FUSION_TRESHOLD" in message
  assert "MPISTRATEGY_FUSION_THRESHOLD_BYTES" in message  # the known ones
  assert "MPISTRATEGY_ABORT_ON_EXCEPTION" in message


def test_from_env_does_not_warn_about_build_and_test_variables():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    Options.from_env(environ={"MPISTRATEGY_CUDA_LINK": "tf",
                              "MPISTRATEGY_TEST_TIMEOUT": "60"})


def test_from_env_rejects_non_options_base():
  with pytest.raises(TypeError, match="base"):
    Options.from_env(base={"cycle_time_ms": 1.0})


def test_replace_validates_and_names_unknown_fields():
  o = Options().replace(cycle_time_ms=4.0)
  assert o.cycle_time_ms == 4.0
  with pytest.raises(ValueError, match="Options.cycle_time_ms"):
    o.replace(cycle_time_ms=-1)
  with pytest.raises(TypeError, match="no field 'cycle_time'"):
    o.replace(cycle_time=1)


def test_merge_takes_non_default_fields_of_other():
  a = Options(cycle_time_ms=4.0, cache_capacity=10)
  b = Options(cache_capacity=20, timeline="/tmp/x")
  m = a.merge(b)
  assert (m.cycle_time_ms, m.cache_capacity, m.timeline) == (4.0, 20,
                                                             "/tmp/x")
  assert a.merge(None) is a
  with pytest.raises(TypeError):
    a.merge({"cache_capacity": 1})
