"""Collective names carry the Keras/TF call they are made in (one process).

The multi-rank behaviour (a rank-0-only `evaluate` fails naming it) is in
tests/launcher/test_rank0_only_call.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy.ops import _naming


def test_default_names_start_with_the_entry_stack():
  assert _naming.entry_points() == ()
  assert _naming.tensor_name(None, "allreduce") == "eager/allreduce"
  with _naming.entry_point("Model.fit"):
    with _naming.entry_point("Model.fit"):  # super().fit(): recorded once
      with _naming.entry_point("Model.evaluate"):
        assert _naming.entry_points() == ("Model.fit", "Model.evaluate")
        assert _naming.tensor_name(None, "allreduce") == (
            "Model.fit/Model.evaluate/eager/allreduce")
        # An explicit name is used as it is.
        assert _naming.tensor_name("mine", "allreduce") == "mine"

        @tf.function
        def traced():
          return tf.constant(_naming.tensor_name(None, "allgather"))

        name = traced().numpy().decode()
        assert name.startswith("Model.fit/Model.evaluate/traced/"), name
      assert _naming.entry_points() == ("Model.fit",)
    assert _naming.entry_points() == ("Model.fit",)
  assert _naming.entry_points() == ()


def test_entry_stack_is_per_thread():
  import threading
  seen = []
  with _naming.entry_point("Model.predict"):
    t = threading.Thread(target=lambda: seen.append(_naming.entry_points()))
    t.start()
    t.join()
  assert seen == [()]


@pytest.mark.timeout(120)
def test_keras_calls_are_entry_points():
  strategy = mpistrategy.MPIStrategy()
  seen = {}

  class Record(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      seen.setdefault("train", _naming.entry_points())

    def on_test_batch_begin(self, batch, logs=None):
      seen.setdefault("test", _naming.entry_points())

    def on_predict_batch_begin(self, batch, logs=None):
      seen.setdefault("predict", _naming.entry_points())

  x = np.ones([8, 2], "float32")
  with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0,
            validation_data=(x, x[:, :1]), callbacks=[Record()])
  assert seen["train"] == ("Model.fit",)
  assert seen["test"] == ("Model.fit", "Model.evaluate")
  model.predict(x, verbose=0, callbacks=[Record()])
  assert seen["predict"] == ("Model.predict",)
  assert _naming.entry_points() == ()
  # The wrappers keep the signature and the documentation.
  import inspect
  assert "validation_data" in inspect.signature(keras.Model.fit).parameters
  evaluate = keras.Model.evaluate
  assert evaluate.__doc__ == evaluate.__wrapped__.__doc__
