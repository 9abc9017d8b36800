"""Renders one training step of an engine timeline as a Gantt chart (PNG).

    MPISTRATEGY_TIMELINE=/tmp/trace.json mpirun -np 2 python train.py
    python bench/plot_timeline.py --trace /tmp/trace.json --out step.png
    python bench/plot_timeline.py --trace /tmp/trace.json --out step.png \
        --step 5
    python bench/plot_timeline.py --trace /tmp/trace.json --out w.png \\
        --start-ms 1450 --window-ms 20

The trace is the Chrome-trace JSON the engine writes (README "Timeline",
cc/engine/timeline.h): "X" spans (NEGOTIATE, QUEUE, MEMCPY_IN_FUSION_BUFFER,
ALLREDUCE, ...) on one row per collective name, CYCLE spans on the
"negotiation cycles" row, rows named by "M" thread_name events.  Only the
first process in the file (rank 0, unless several files were concatenated)
is drawn.

How a step is found (`find_steps`): every span on a collective row covers
part of the time from when a tensor was enqueued until its collective
finished, so the union of those spans is the time some collective was in
flight.  Neighbouring pieces closer than `--min-gap-ms` are merged into one
burst.  A training step submits the same collectives every time, so bursts
are grouped by the set of collective names they contain, and the most
frequent set is taken as "the training step"; bursts with other sets
(variable broadcasts, eager metric reductions, evaluation) are skipped.
`--step N` picks the N-th such step, counting from 0; the default, 3, skips
the first steps, which run the slow negotiation path and warm up.  The step
is widened to the negotiation cycles that overlap it.  With Keras'
`steps_per_execution=k` the k batches of one train-function call usually
follow each other within less than 1 ms, so a "step" is then one call
(k batches); run with `steps_per_execution=1` to see one batch.

The chart has the "negotiation cycles" row on top, then one row per
collective in order of first activity (at most `--max-rows`), labelled with
the shortest unique suffix of the collective's name and the tensor's shape.
The x axis is milliseconds since the start of the step (or of `--start-ms`),
with 3 % of the step's length shown on either side.  Spans shorter than
1/400 of the shown time are widened to that so they stay visible.
"""

import argparse
import collections
import json
import os
import sys

# The engine's span names, in pipeline order, and their colours.
SPAN_COLORS = {
    "NEGOTIATE": "#c7c7c7",
    "QUEUE": "#ffbb78",
    "MEMCPY_IN_FUSION_BUFFER": "#98df8a",
    "ALLREDUCE": "#1f77b4",
    "ALLGATHER": "#9467bd",
    "BROADCAST": "#8c564b",
    "REDUCESCATTER": "#e377c2",
    "ALLTOALL": "#bcbd22",
    "BARRIER": "#7f7f7f",
    "MEMCPY_OUT_FUSION_BUFFER": "#2ca02c",
    "CYCLE": "#d62728",
}
_EXTRA_COLORS = ["#17becf", "#ff9896", "#c5b0d5", "#dbdb8d", "#9edae5"]

CYCLE_ROW = "negotiation cycles"
DEFAULT_STEP = 3
DEFAULT_MIN_GAP_MS = 1.0
DEFAULT_MAX_ROWS = 24
MIN_VISIBLE_FRACTION = 1.0 / 400

Span = collections.namedtuple("Span", ["row", "name", "start_ms", "end_ms",
                                       "args"])


def load_spans(path):
  """Reads the "X" spans of the first process in a Chrome-trace file.

  Accepts a JSON array of events, a {"traceEvents": [...]} object, and an
  array without its closing bracket (what a crashed process leaves).

  Args:
    path: the trace file.

  Returns:
    A list of `Span`s sorted by start time; `row` is the row's name (the
    thread_name metadata, or "tid N" if there is none), times are in
    milliseconds as written in the file.

  Raises:
    ValueError: naming `path`, when the file is not a Chrome trace or holds
      no complete ("X") spans.
  """
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    data = json.loads(text)
  except ValueError:
    # A crashed process leaves "[ev,\nev" without the closing bracket.
    try:
      data = json.loads(text.rstrip().rstrip(",") + "]")
    except ValueError:
      raise ValueError(
          f"{path}: not a Chrome-trace JSON file (expected a JSON array of "
          "events, as written by MPISTRATEGY_TIMELINE)") from None
  if isinstance(data, dict):
    data = data.get("traceEvents")
  if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
    raise ValueError(f"{path}: not a Chrome-trace JSON file (expected a JSON "
                     "array of event objects, or {\"traceEvents\": [...]})")
  pids = [e.get("pid") for e in data if e.get("ph") == "X"]
  if not pids:
    raise ValueError(f"{path}: the trace holds no complete (\"X\") spans; "
                     "did the job run any collective?")
  pid = pids[0]
  names = {}
  for e in data:
    if (e.get("ph") == "M" and e.get("name") == "thread_name" and
        e.get("pid") == pid):
      names[e.get("tid")] = e.get("args", {}).get("name")
  spans = []
  for e in data:
    if e.get("ph") != "X" or e.get("pid") != pid:
      continue
    try:
      start = float(e["ts"]) / 1e3
      end = start + float(e.get("dur", 0)) / 1e3
    except (KeyError, TypeError, ValueError):
      raise ValueError(f"{path}: a complete (\"X\") event without a numeric "
                       f"ts/dur: {e}") from None
    tid = e.get("tid")
    spans.append(Span(names.get(tid) or f"tid {tid}", e.get("name", "?"),
                      start, end, e.get("args") or {}))
  spans.sort(key=lambda s: (s.start_ms, s.end_ms))
  return spans


def find_bursts(spans, min_gap_ms=DEFAULT_MIN_GAP_MS):
  """Splits the collective activity into bursts separated by idle gaps.

  Args:
    spans: `Span`s, as from `load_spans`.
    min_gap_ms: pieces of activity less than this far apart are merged.

  Returns:
    A list of (start_ms, end_ms, rows) in time order, where rows is the
    frozenset of collective names active in the burst.  Spans on the
    "negotiation cycles" row are ignored.
  """
  bursts = []
  for s in sorted((s for s in spans if s.row != CYCLE_ROW),
                  key=lambda s: s.start_ms):
    if bursts and s.start_ms - bursts[-1][1] < min_gap_ms:
      last = bursts[-1]
      last[1] = max(last[1], s.end_ms)
      last[2].add(s.row)
    else:
      bursts.append([s.start_ms, s.end_ms, {s.row}])
  return [(b[0], b[1], frozenset(b[2])) for b in bursts]


def find_steps(spans, min_gap_ms=DEFAULT_MIN_GAP_MS):
  """The bursts of the most frequent kind: the repeated training steps.

  Args:
    spans: `Span`s, as from `load_spans`.
    min_gap_ms: see `find_bursts`.

  Returns:
    A list of (start_ms, end_ms) in time order: the bursts whose set of
    collective names is the most frequent one (ties: the set seen first).
    Empty when there are no spans.
  """
  bursts = find_bursts(spans, min_gap_ms)
  counts = collections.Counter(rows for _, _, rows in bursts)
  if not counts:
    return []
  best = max(counts.values())
  kind = next(rows for _, _, rows in bursts if counts[rows] == best)
  return [(start, end) for start, end, rows in bursts if rows == kind]


def select_step(spans, step=DEFAULT_STEP, min_gap_ms=DEFAULT_MIN_GAP_MS):
  """The time interval of one training step.

  Args:
    spans: `Span`s, as from `load_spans`.
    step: which step, counting from 0 (see `find_steps`).
    min_gap_ms: see `find_bursts`.

  Returns:
    (start_ms, end_ms): the step from `find_steps`, widened to the
    negotiation cycles that overlap it.

  Raises:
    ValueError: when the trace has no step number `step`.
  """
  steps = find_steps(spans, min_gap_ms)
  if not 0 <= step < len(steps):
    raise ValueError(f"--step {step}: the trace has {len(steps)} repeated "
                     f"steps (numbered from 0; bursts split at gaps of "
                     f"{min_gap_ms} ms)")
  start, end = steps[step]
  for s in spans:
    if s.row == CYCLE_ROW and s.start_ms <= end and s.end_ms >= start:
      start, end = min(start, s.start_ms), max(end, s.end_ms)
  return start, end


def row_labels(names, shapes=None, min_parts=3, max_chars=48):
  """Short, unique labels for collective names.

  Each name is cut to its shortest suffix of "/"-separated components (at
  least `min_parts`) that no other name in `names` shares; over-long labels
  keep their end, after an ellipsis.

  Args:
    names: the collective names.
    shapes: optional {name: shape string}, appended to the label.
    min_parts: the fewest trailing name components a label keeps.
    max_chars: labels are cut to this length (before the shape).

  Returns:
    A list of labels, parallel to `names`.
  """
  parts = [n.split("/") for n in names]
  labels = []
  for p in parts:
    k = min(min_parts, len(p))
    while k < len(p) and sum(q[-k:] == p[-k:] for q in parts) > 1:
      k += 1
    label = "/".join(p[-k:])
    if len(label) > max_chars:
      label = "\u2026" + label[-(max_chars - 1):]
    labels.append(label)
  if shapes:
    labels = [f"{label} {shapes[n]}" if shapes.get(n) else label
              for label, n in zip(labels, names)]
  return labels


def plot_window(spans, start_ms, end_ms, out, title=None,
                max_rows=DEFAULT_MAX_ROWS, margin_fraction=0.03,
                xlabel="ms since the start of the window"):
  """Draws the spans overlapping [start_ms, end_ms] as a Gantt chart.

  Args:
    spans: `Span`s, as from `load_spans`.
    start_ms: window start, in the trace's milliseconds; becomes x = 0.
    end_ms: window end.
    out: the PNG file to write.
    title: the chart title (default: the window's position in the trace).
    max_rows: at most this many collective rows (the first active ones);
      the title says how many were left out.
    margin_fraction: the chart also shows this fraction of the window's
      length before and after it.
    xlabel: the x axis label.

  Returns:
    The number of rows drawn, including the cycle row.

  Raises:
    ValueError: when no span overlaps the window.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  margin = (end_ms - start_ms) * margin_fraction
  lo, hi = start_ms - margin, end_ms + margin
  shown = [s for s in spans if s.end_ms >= lo and s.start_ms <= hi]
  if not shown:
    raise ValueError(f"no span between {start_ms:.3f} and {end_ms:.3f} ms")
  order, shapes = [], {}
  for s in shown:
    if s.row != CYCLE_ROW and s.row not in shapes:
      order.append(s.row)
      shapes[s.row] = None
    if s.row != CYCLE_ROW and "shape" in s.args:
      shapes[s.row] = s.args["shape"]
  hidden = max(0, len(order) - max_rows)
  order = order[:max_rows]
  rows = ([CYCLE_ROW] if any(s.row == CYCLE_ROW for s in shown) else []) + order
  labels = row_labels(order, shapes)
  if rows and rows[0] == CYCLE_ROW:
    labels = [CYCLE_ROW] + labels
  index = {r: i for i, r in enumerate(rows)}

  colors = dict(SPAN_COLORS)
  min_width = (hi - lo) * MIN_VISIBLE_FRACTION
  bars = collections.defaultdict(list)  # (row, span name) -> [(x, w)]
  for s in shown:
    if s.row not in index:
      continue
    if s.name not in colors:
      colors[s.name] = _EXTRA_COLORS[(len(colors) - len(SPAN_COLORS)) %
                                     len(_EXTRA_COLORS)]
    x0 = max(s.start_ms, lo) - start_ms
    x1 = min(s.end_ms, hi) - start_ms
    bars[(s.row, s.name)].append((x0, max(x1 - x0, min_width)))

  height = 1.2 + 0.32 * len(rows)
  fig, ax = plt.subplots(figsize=(11, height))
  rank = {n: i for i, n in enumerate(colors)}  # later stages drawn on top
  for (row, name), xs in sorted(bars.items(), key=lambda kv: rank[kv[0][1]]):
    # White edges keep back-to-back cycles apart.
    ax.broken_barh(xs, (index[row] - 0.38, 0.76), facecolors=colors[name],
                   edgecolors="white" if name == "CYCLE" else "none",
                   linewidth=0.6)
  # How many tensors each negotiation cycle ran, where the bar has room.
  for s in shown:
    x0, x1 = max(s.start_ms, lo), min(s.end_ms, hi)
    if (s.row == CYCLE_ROW and "tensors" in s.args and
        x1 - x0 > 0.06 * (hi - lo)):
      n = s.args["tensors"]
      ax.text((x0 + x1) / 2 - start_ms, index[CYCLE_ROW],
              f"{n} tensor{'s' if n != 1 else ''}", ha="center",
              va="center", fontsize=7, color="white")
  ax.set_yticks(range(len(rows)))
  ax.set_yticklabels(labels, fontsize=8, family="monospace")
  ax.set_ylim(len(rows) - 0.5, -0.5)
  ax.set_xlim(lo - start_ms, hi - start_ms)
  ax.set_xlabel(xlabel)
  ax.grid(True, axis="x", alpha=0.3)
  if title is None:
    title = f"engine timeline, {start_ms:.1f}-{end_ms:.1f} ms of the trace"
  if hidden:
    title += f" ({hidden} more rows not shown)"
  ax.set_title(title, fontsize=10)
  used = [n for n in colors if any(name == n for _, name in bars)]
  ax.legend(handles=[Patch(color=colors[n], label=n) for n in used],
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
            frameon=False)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return len(rows)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trace", required=True,
                 help="Chrome-trace JSON from MPISTRATEGY_TIMELINE")
  p.add_argument("--out", required=True, help="PNG file to write")
  p.add_argument("--step", type=int, default=DEFAULT_STEP,
                 help="which repeated step to draw, from 0 (default "
                 f"{DEFAULT_STEP}: skips the warm-up steps)")
  p.add_argument("--min-gap-ms", type=float, default=DEFAULT_MIN_GAP_MS,
                 help="idle time that separates two steps (default "
                 f"{DEFAULT_MIN_GAP_MS})")
  p.add_argument("--start-ms", type=float,
                 help="draw this window instead of a step: its start, in "
                 "the trace's ms (Perfetto shows the same numbers)")
  p.add_argument("--window-ms", type=float, default=20.0,
                 help="with --start-ms: the window's length (default 20)")
  p.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS,
                 help=f"at most this many collective rows (default "
                 f"{DEFAULT_MAX_ROWS})")
  p.add_argument("--title", help="chart title")
  args = p.parse_args(argv)
  if args.window_ms <= 0:
    p.error("--window-ms must be positive")
  if args.max_rows < 1:
    p.error("--max-rows must be at least 1")
  try:
    spans = load_spans(args.trace)
    if args.start_ms is not None:
      start, end = args.start_ms, args.start_ms + args.window_ms
      plot_window(spans, start, end, args.out, args.title, args.max_rows,
                  margin_fraction=0.0, xlabel=f"ms since {start:g} ms")
    else:
      start, end = select_step(spans, args.step, args.min_gap_ms)
      title = args.title or (
          f"{os.path.basename(args.trace)}: step {args.step}, "
          f"{end - start:.2f} ms (from {start:.1f} ms in the trace)")
      plot_window(spans, start, end, args.out, title, args.max_rows,
                  xlabel="ms since the start of the step")
  except (OSError, ValueError) as e:
    print(f"bench/plot_timeline.py: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {start:.3f}-{end:.3f} ms of {args.trace}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
