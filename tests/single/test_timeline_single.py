"""The engine timeline in a world of size 1 (no mpirun).

    .venv/bin/python -m pytest tests/single/test_timeline_single.py
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops
from mpistrategy.ops import collectives


pytestmark = pytest.mark.usefixtures("single_process_engine")


@pytest.fixture
def restore_options():
  previous = mpistrategy.current_options()
  yield
  mpistrategy.shutdown()
  mpistrategy.init(previous)


def test_unwritable_path_is_value_error_naming_it(tmp_path, restore_options,
                                                 monkeypatch):
  path = str(tmp_path / "no-such-directory" / "trace.json")
  mpistrategy.shutdown()
  # As under mpirun: the message names the rank, since no excepthook
  # prefixes a traceback before the engine started.
  monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
  with pytest.raises(ValueError) as info:
    mpistrategy.init(mpistrategy.Options(timeline=path))
  monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
  message = str(info.value)
  assert message.startswith("mpistrategy.init (rank 0): Options.timeline")
  assert f'"{path}"' in message
  assert "No such file or directory" in message
  assert not mpistrategy.is_initialized()
  # Nothing half-started: a plain init works.
  mpistrategy.init()
  assert ops.allreduce(tf.ones([2])).numpy().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("name", ["trace.json", "trace.{rank}.json"])
def test_single_rank_trace(tmp_path, restore_options, name):
  path = str(tmp_path / name)
  mpistrategy.shutdown()
  mpistrategy.init(mpistrategy.Options(timeline=path))
  # pack=False: two engine entries fused in one bucket (the packed default
  # would be a single entry without fusion-buffer copies).
  ys = collectives._grouped_allreduce_unpacked(  # pylint: disable=protected-access
      [tf.ones([5]), tf.ones([7])], "g")
  np.testing.assert_array_equal(ys[1].numpy(), np.ones([7]))
  mpistrategy.shutdown()
  written = path.replace("{rank}", "0")
  assert os.listdir(tmp_path) == [os.path.basename(written)]
  with open(written) as f:
    events = json.load(f)
  rows = {e["args"]["name"]: e["tid"] for e in events
          if e["ph"] == "M" and e["name"] == "thread_name"}
  assert {"g.0", "g.1", "negotiation cycles"} <= set(rows)
  spans = [e["name"] for e in events
           if e["ph"] == "X" and e["tid"] == rows["g.1"]]
  assert spans == ["NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER",
                   "ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
  cycles = [e for e in events if e["name"] == "CYCLE"]
  assert [c["args"]["tensors"] for c in cycles] == [2]
  assert cycles[0]["args"]["fused_buckets"] == 1


def test_repeated_eager_calls_reuse_one_name(tmp_path, restore_options):
  # A name that changed per eager call would make TensorFlow build a new
  # kernel for every call (the name is an op attribute) and miss the
  # engine's response cache; the timeline shows one row per name.
  path = str(tmp_path / "trace.json")
  mpistrategy.shutdown()
  mpistrategy.init(mpistrategy.Options(timeline=path))
  for _ in range(3):
    ops.allreduce(tf.ones([2]))
    ops.allgather(tf.ones([1, 2]))
  mpistrategy.shutdown()
  with open(path) as f:
    events = json.load(f)
  rows = {e["args"]["name"] for e in events
          if e["ph"] == "M" and e["name"] == "thread_name"}
  assert rows - {"negotiation cycles"} == {"eager/allreduce",
                                           "eager/allgather"}


def test_chained_allreduces_reduce_in_place(tmp_path, restore_options):
  # Each allreduce in the chain gets the previous one's output, which
  # nothing else holds, so TF may forward it and the op reduces in place.
  # The kernel must let go of its input before TF sees the op done;
  # otherwise every other op of the chain found the buffer still shared
  # and copied into a new one.
  path = str(tmp_path / "trace.json")
  mpistrategy.shutdown()
  mpistrategy.init(mpistrategy.Options(timeline=path))

  @tf.function
  def chain(x):
    for i in range(4):
      x = ops.allreduce(x, name=f"chain.{i}")
    return x

  x = tf.ones([1024])
  for _ in range(3):
    np.testing.assert_array_equal(chain(x).numpy(), np.ones([1024]))
  mpistrategy.shutdown()
  with open(path) as f:
    events = json.load(f)
  rows = {e["tid"]: e["args"]["name"] for e in events
          if e["ph"] == "M" and e["name"] == "thread_name"}
  in_place = {}
  for e in events:
    if e["ph"] == "X" and e["name"] == "ALLREDUCE":
      in_place.setdefault(rows[e["tid"]], []).append(e["args"]["in_place"])
  # The first op's input is the function's argument, held by the caller.
  assert in_place == {"chain.0": [0, 0, 0], "chain.1": [1, 1, 1],
                      "chain.2": [1, 1, 1], "chain.3": [1, 1, 1]}


def test_start_and_stop_timeline_record_a_window(tmp_path):
  assert mpistrategy.current_options().timeline == ""
  ops.allreduce(tf.ones([2]), name="window/before")
  # Named as the call, not as Options.timeline.
  with pytest.raises(ValueError, match=r"^mpistrategy.start_timeline: cannot "
                     r"open the timeline file .*no-such-directory"):
    mpistrategy.start_timeline(tmp_path / "no-such-directory" / "t.json")
  with pytest.raises(ValueError, match="stop_timeline"):
    mpistrategy.start_timeline("")
  path = tmp_path / "window.json"
  mpistrategy.start_timeline(path)
  ops.allreduce(tf.ones([2]), name="window/during")
  mpistrategy.stop_timeline()
  ops.allreduce(tf.ones([2]), name="window/after")
  mpistrategy.stop_timeline()  # none open: nothing to do
  with open(path) as f:
    events = json.load(f)  # complete once stop_timeline returned
  rows = {e["args"]["name"] for e in events
          if e["ph"] == "M" and e["name"] == "thread_name"}
  assert "window/during" in rows
  assert not {"window/before", "window/after"} & rows
