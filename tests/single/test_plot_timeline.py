"""bench/plot_timeline.py on small synthetic traces (no engine, no MPI).

    .venv/bin/python -m pytest tests/single/test_plot_timeline.py
"""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench", "plot_timeline.py")
_spec = importlib.util.spec_from_file_location("plot_timeline", _PATH)
plot_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_timeline)

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _x(name, tid, start_ms, end_ms, **args):
  event = {"name": name, "ph": "X", "pid": 0, "tid": tid,
           "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3}
  if args:
    event["args"] = args
  return event


def _row(tid, name):
  return {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
          "args": {"name": name}}


def _step(t):
  """One training step starting at t ms: grad_a, then grad_b 0.5 ms later."""
  return [
      _x("NEGOTIATE", 2, t + 0.0, t + 0.4, shape="[4, 3]"),
      _x("QUEUE", 2, t + 0.4, t + 0.45),
      _x("ALLREDUCE", 2, t + 0.45, t + 0.6),
      _x("CYCLE", 0, t + 0.3, t + 0.7, tensors=1),
      # 0.5 ms idle: less than the default --min-gap-ms, same step.
      _x("NEGOTIATE", 3, t + 1.1, t + 1.3, shape="[3]"),
      _x("QUEUE", 3, t + 1.3, t + 1.35),
      _x("ALLREDUCE", 3, t + 1.35, t + 1.5),
      _x("CYCLE", 0, t + 1.2, t + 1.6, tensors=1),
  ]


def _trace():
  """A warm-up broadcast, then two steps at 10 ms and 30 ms."""
  return ([{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": "rank 0"}},
           _row(0, "negotiation cycles"),
           _row(1, "eager/broadcast.0"),
           _row(2, "model/while/one_step/MPIAllReduce/allreduce"),
           _row(3, "model/while/one_step/MPIAllReduce_1/allreduce"),
           _x("NEGOTIATE", 1, 0.0, 0.5, shape="[4, 3]"),
           _x("BROADCAST", 1, 0.5, 1.0),
           _x("CYCLE", 0, 0.2, 1.0, tensors=1),
           {"name": "REQUEST", "ph": "i", "pid": 0, "tid": 1, "ts": 100.0,
            "s": "t", "args": {"rank": 1}}]
          + _step(10.0) + _step(30.0))


@pytest.fixture
def trace_file(tmp_path):
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(_trace()))
  return str(path)


def test_load_spans_reads_rows_and_milliseconds(trace_file):
  spans = plot_timeline.load_spans(trace_file)
  assert len(spans) == 3 + 2 * 8  # the REQUEST instant and "M" are not spans
  first = spans[0]
  assert (first.row, first.name) == ("eager/broadcast.0", "NEGOTIATE")
  assert first.start_ms == pytest.approx(0.0)
  assert first.end_ms == pytest.approx(0.5)
  assert first.args == {"shape": "[4, 3]"}
  assert [s.start_ms for s in spans] == sorted(s.start_ms for s in spans)


def test_find_bursts_merges_small_gaps_and_splits_at_large_ones(trace_file):
  spans = plot_timeline.load_spans(trace_file)
  bursts = plot_timeline.find_bursts(spans, min_gap_ms=1.0)
  step_rows = frozenset(["model/while/one_step/MPIAllReduce/allreduce",
                         "model/while/one_step/MPIAllReduce_1/allreduce"])
  assert [(pytest.approx(a), pytest.approx(b), rows)
          for a, b, rows in bursts] == [
              (0.0, 1.0, frozenset(["eager/broadcast.0"])),
              (10.0, 11.5, step_rows),
              (30.0, 31.5, step_rows)]


def test_find_steps_skips_bursts_of_other_collectives(trace_file):
  spans = plot_timeline.load_spans(trace_file)
  steps = plot_timeline.find_steps(spans)
  assert steps == [(pytest.approx(10.0), pytest.approx(11.5)),
                   (pytest.approx(30.0), pytest.approx(31.5))]


def test_find_steps_with_a_smaller_gap_splits_each_step(trace_file):
  # At 0.4 ms each step falls apart into a grad_a and a grad_b burst; both
  # kinds occur twice, and the kind seen first (grad_a) wins.
  spans = plot_timeline.load_spans(trace_file)
  steps = plot_timeline.find_steps(spans, min_gap_ms=0.4)
  assert steps == [(pytest.approx(10.0), pytest.approx(10.6)),
                   (pytest.approx(30.0), pytest.approx(30.6))]


def test_select_step_picks_the_nth_step_and_its_cycles(trace_file):
  spans = plot_timeline.load_spans(trace_file)
  # The last cycle (x.2-x.6) ends after the last span (x.5).
  start, end = plot_timeline.select_step(spans, step=1)
  assert (start, end) == (pytest.approx(30.0), pytest.approx(31.6))
  start, end = plot_timeline.select_step(spans, step=0)
  assert (start, end) == (pytest.approx(10.0), pytest.approx(11.6))


def test_select_step_out_of_range_says_how_many(trace_file):
  spans = plot_timeline.load_spans(trace_file)
  with pytest.raises(ValueError, match=r"--step 2: the trace has 2 "):
    plot_timeline.select_step(spans, step=2)


def test_row_labels_are_the_shortest_unique_suffixes():
  names = ["a/b/c/x/MPIAllReduce/allreduce",
           "a/b/d/x/MPIAllReduce/allreduce",
           "a/b/adam/MPIAllReduce/allreduce_1"]
  labels = plot_timeline.row_labels(names, {names[2]: "[64, 10]"})
  assert labels == ["c/x/MPIAllReduce/allreduce",
                    "d/x/MPIAllReduce/allreduce",
                    "adam/MPIAllReduce/allreduce_1 [64, 10]"]
  long = plot_timeline.row_labels(["p/" + "q" * 80 + "/r/s"], max_chars=20)
  assert long == ["\u2026" + ("q" * 80 + "/r/s")[-19:]]


def test_main_writes_a_png_of_the_chosen_step(trace_file, tmp_path, capsys):
  out = str(tmp_path / "step.png")
  assert plot_timeline.main(["--trace", trace_file, "--out", out,
                             "--step", "1"]) == 0
  with open(out, "rb") as f:
    data = f.read()
  assert data.startswith(_PNG_MAGIC)
  assert len(data) > 5000
  assert "30.000-31.600 ms" in capsys.readouterr().out


def test_plot_window_draws_only_the_rows_in_the_window(trace_file, tmp_path):
  spans = plot_timeline.load_spans(trace_file)
  out = str(tmp_path / "w.png")
  # The cycle row and the two gradient rows; not the warm-up broadcast.
  assert plot_timeline.plot_window(spans, 30.0, 31.6, out) == 3
  assert plot_timeline.plot_window(spans, 0.0, 31.6, out) == 4
  assert plot_timeline.plot_window(spans, 0.0, 31.6, out, max_rows=1) == 2
  with pytest.raises(ValueError, match="no span between"):
    plot_timeline.plot_window(spans, 15.0, 16.0, out)


def test_explicit_window(trace_file, tmp_path):
  out = str(tmp_path / "w.png")
  assert plot_timeline.main(["--trace", trace_file, "--out", out,
                             "--start-ms", "9", "--window-ms", "3"]) == 0
  assert os.path.getsize(out) > 5000


def test_truncated_trace_of_a_crashed_process_loads(tmp_path):
  path = tmp_path / "crashed.json"
  text = json.dumps(_trace())
  path.write_text(text[:-1] + ",\n")  # no closing bracket
  assert len(plot_timeline.load_spans(str(path))) == 3 + 2 * 8


@pytest.mark.parametrize("content", [
    "[]",                                              # no events
    json.dumps([_row(0, "negotiation cycles")]),       # no spans
    '{"foo": 1}',                                      # not a trace
    "this is not JSON",
    "[1, 2, 3]",
    json.dumps([{"name": "ALLREDUCE", "ph": "X", "pid": 0, "tid": 1}]),  # no ts
])
def test_not_a_trace_is_a_value_error_naming_the_file(tmp_path, content):
  path = tmp_path / "bad.json"
  path.write_text(content)
  with pytest.raises(ValueError) as info:
    plot_timeline.load_spans(str(path))
  assert str(path) in str(info.value)


def test_main_reports_a_bad_trace_and_fails(tmp_path, capsys):
  path = tmp_path / "empty.json"
  path.write_text("[]")
  out = tmp_path / "x.png"
  assert plot_timeline.main(["--trace", str(path), "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert str(path) in err and "no complete" in err
  assert not out.exists()
