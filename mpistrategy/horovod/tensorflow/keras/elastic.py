"""Not provided: Horovod's elastic Keras training (`...keras.elastic`).

See `mpistrategy.horovod.tensorflow.elastic`.
"""

from mpistrategy.horovod.tensorflow import unsupported as _unsupported

_unsupported.refuse_elastic("horovod.tensorflow.keras.elastic")
