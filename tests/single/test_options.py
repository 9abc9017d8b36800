"""mpistrategy.Options: validation, environment overrides, merge/replace."""

import ctypes
import dataclasses
import warnings

import pytest

from mpistrategy import Options
from mpistrategy import options as options_lib


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


# The messages are the C++ validation's (cc/engine/config.cc), unchanged.
@pytest.mark.parametrize("field, value, message", [
    ("fusion_threshold_bytes", -1, "Options.fusion_threshold_bytes must be "
     "an integer >= 0 (0 disables fusion), got -1"),
    ("fusion_threshold_bytes", 2**64, "Options.fusion_threshold_bytes must "
     "be an integer that fits in 64 bits, got 18446744073709551616"),
    ("cycle_time_ms", 0, "Options.cycle_time_ms must be a finite number > 0, "
     "got 0"),
    ("cycle_time_ms", float("nan"), "Options.cycle_time_ms must be a finite "
     "number > 0, got nan"),
    ("cycle_time_ms", float("inf"), "Options.cycle_time_ms must be a finite "
     "number > 0, got inf"),
    ("cycle_time_ms", 4000, "Options.cycle_time_ms must be at most 1000 (an "
     "idle rank joins the negotiation this often, so a longer period delays "
     "stall warnings and timeouts), got 4000"),
    ("cache_capacity", -3, "Options.cache_capacity must be an integer in "
     "[0, 2147483647] (0 disables the response cache), got -3"),
    ("cache_capacity", 2**31, "Options.cache_capacity must be an integer in "
     "[0, 2147483647] (0 disables the response cache), got 2147483648"),
    ("stall_warning_seconds", -0.5, "Options.stall_warning_seconds must be a "
     "finite number >= 0 (0 disables the warning), got -0.5"),
    ("stall_timeout_seconds", -1, "Options.stall_timeout_seconds must be a "
     "finite number >= 0 (0 waits forever), got -1"),
    ("peer_timeout_seconds", -1, "Options.peer_timeout_seconds must be a "
     "finite number >= 0 (0 waits for silent peers forever), got -1"),
    ("peer_timeout_seconds", float("inf"), "Options.peer_timeout_seconds "
     "must be a finite number >= 0 (0 waits for silent peers forever), got "
     "inf"),
    ("fusion_wait_ms", -0.1, "Options.fusion_wait_ms must be a number in "
     "[0, 1000] (0 negotiates at once), got -0.1"),
    ("fusion_wait_ms", 1500, "Options.fusion_wait_ms must be a number in "
     "[0, 1000] (0 negotiates at once), got 1500"),
    ("fusion_wait_ms", float("nan"), "Options.fusion_wait_ms must be a "
     "number in [0, 1000] (0 negotiates at once), got nan"),
    ("checkpoint_read_timeout_seconds", 0, "Options."
     "checkpoint_read_timeout_seconds must be a finite number > 0, got 0"),
])
def test_out_of_range_values_name_field_accepted_values_and_value(field, value,
                                                                  message):
  with pytest.raises(ValueError) as info:
    Options(**{field: value})
  assert str(info.value) == message


def _c_validate(text):
  """Calls mpistrategy_validate_config itself: (code, message)."""
  library = ctypes.CDLL(options_lib._config_library()._name)  # pylint: disable=protected-access
  error = ctypes.create_string_buffer(4096)
  library.mpistrategy_validate_config.argtypes = [
      ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int]
  code = library.mpistrategy_validate_config(text, len(text), error,
                                             len(error))
  return code, error.value.decode()


@pytest.mark.parametrize("field, value, text", [
    ("cycle_time_ms", 0.0, b"cycle_time_ms=0.0\0"),
    ("cache_capacity", 2**31, b"cache_capacity=2147483648\0"),
    ("fusion_wait_ms", float("nan"), b"fusion_wait_ms=nan\0"),
    ("checkpoint_read_timeout_seconds", -2.5,
     b"checkpoint_read_timeout_seconds=-2.5\0"),
])
def test_validation_has_one_place_the_c_library(field, value, text):
  """Python raises exactly what the C ABI answers: no checks of its own."""
  code, message = _c_validate(text)
  assert code == 3 and message.startswith(f"Options.{field} must be ")
  with pytest.raises(ValueError) as info:
    Options(**{field: value})
  assert str(info.value) == message


def test_every_validated_field_goes_to_the_c_library(monkeypatch):
  """A value the C++ side rejects is rejected, whatever Python thinks of it."""
  seen = []

  def fake(text):
    seen.append(text)
    if b"cycle_time_ms=7.0\0" in text:
      return "rejected by C++ (test)"
    return None

  monkeypatch.setattr(options_lib, "validation_error", fake)
  with pytest.raises(ValueError, match=r"^rejected by C\+\+ \(test\)$"):
    Options(cycle_time_ms=7)
  keys = {e.split(b"=", 1)[0].decode() for e in seen[-1].split(b"\0") if e}
  python_only = {"abort_on_exception", "verbose"}
  assert keys == {f.name for f in dataclasses.fields(Options)} - python_only


def test_nul_in_a_path_is_rejected():
  with pytest.raises(ValueError, match="Options.timeline must not contain a "
                     "NUL character"):
    Options(timeline="/tmp/a\0b")


def test_missing_validation_library_says_to_build(monkeypatch, tmp_path):
  monkeypatch.setattr(options_lib, "CONFIG_LIBRARY_PATHS",
                      [str(tmp_path / "_config.so")])
  monkeypatch.setattr(options_lib, "_library", None)
  with pytest.raises(ImportError, match="make build"):
    Options()


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


def test_horovod_variables_count_once_the_horovod_layer_says_so(monkeypatch):
  environ = {"HOROVOD_FUSION_THRESHOLD": "1000000", "HOROVOD_AUTOTUNE": "1",
             "HOROVOD_CYCLE_TIME": "3.5", "MPISTRATEGY_CYCLE_TIME_MS": "2.5"}
  monkeypatch.setattr(options_lib, "_count_horovod_variables", False)
  plain = Options.from_env(environ=environ)
  assert plain.fusion_threshold_bytes == Options().fusion_threshold_bytes
  assert not plain.autotune and plain.cycle_time_ms == 2.5
  monkeypatch.setattr(options_lib, "_count_horovod_variables", True)
  o = Options.from_env(environ=environ)
  assert o.fusion_threshold_bytes == 1000000 and o.autotune
  assert o.cycle_time_ms == 2.5  # MPISTRATEGY_* wins
  assert not Options.from_env(environ={"HOROVOD_AUTOTUNE": "0"}).autotune
  # Switches: Horovod's integers, and the words.  "false" turned
  # autotuning on (anything but "0" did).
  for variable, field in (("HOROVOD_AUTOTUNE", "autotune"),
                          ("HOROVOD_HIERARCHICAL_ALLREDUCE",
                           "hierarchical_allreduce")):
    for text, on in (("1", True), ("2", True), ("true", True), ("On", True),
                     ("0", False), ("-1", False), ("false", False),
                     ("off", False), ("no", False)):
      got = getattr(Options.from_env(environ={variable: text}), field)
      assert got == on, (variable, text)
    with pytest.raises(ValueError, match=rf"{variable}='maybe' is not a valid "
                       rf"Options.{field}; accepted values are an integer"):
      Options.from_env(environ={variable: "maybe"})
  # What is wrong, and what is accepted (the message said only "not a
  # valid Options.fusion_threshold_bytes").
  for variable, text, accepts in (
      ("HOROVOD_FUSION_THRESHOLD", "64MB", "accepts a decimal integer"),
      ("HOROVOD_CACHE_CAPACITY", "1.5", "accepts a decimal integer"),
      ("HOROVOD_CYCLE_TIME", "abc", "accepts a decimal number")):
    with pytest.raises(ValueError, match=rf"{variable}='{text}' is not an? "
                       rf"(integer|number); Options\.\w+ {accepts}"):
      Options.from_env(environ={variable: text})
  with pytest.raises(ValueError, match=r"from the environment: "
                     r"HOROVOD_CYCLE_TIME='-1'"):
    Options.from_env(environ={"HOROVOD_CYCLE_TIME": "-1"})


def test_engine_errors_name_the_horovod_variable_that_was_set(monkeypatch):
  monkeypatch.setattr(options_lib, "_count_horovod_variables", True)
  message = ("Options.timeline (MPISTRATEGY_TIMELINE): cannot open; "
             "Options.autotune_log (MPISTRATEGY_AUTOTUNE_LOG): cannot open")
  name = options_lib.name_horovod_sources
  assert name(message, {"HOROVOD_TIMELINE": "/x"}) == message.replace(
      "MPISTRATEGY_TIMELINE", "HOROVOD_TIMELINE")
  # MPISTRATEGY_* wins over HOROVOD_*, so it is the one named.
  assert name(message, {"HOROVOD_TIMELINE": "/x",
                        "MPISTRATEGY_TIMELINE": "/y"}) == message
  assert name(message, {}) == message
  monkeypatch.setattr(options_lib, "_count_horovod_variables", False)
  assert name(message, {"HOROVOD_TIMELINE": "/x"}) == message


def test_importing_the_horovod_layer_counts_its_variables(monkeypatch):
  monkeypatch.setattr(options_lib, "_count_horovod_variables", False)
  import mpistrategy.horovod  # pylint: disable=import-outside-toplevel
  import importlib  # pylint: disable=import-outside-toplevel
  importlib.reload(mpistrategy.horovod)
  assert options_lib._count_horovod_variables  # pylint: disable=protected-access


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
    ("MPISTRATEGY_FUSION_THRESHOLD_BYTES", "-5", "Options.fusion_threshold_"
     "bytes must be an integer >= 0 (0 disables fusion), got -5"),
    ("MPISTRATEGY_CYCLE_TIME_MS", "0", "Options.cycle_time_ms must be a "
     "finite number > 0, got 0"),
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
