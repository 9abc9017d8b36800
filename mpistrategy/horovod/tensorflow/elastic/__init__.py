"""Not provided: Horovod's elastic training (`horovod.tensorflow.elastic`).

`hvd.elastic.*` (an attribute of `mpistrategy.horovod.tensorflow` and its
`keras` module) refuses each name when called; importing this module, as
some Horovod scripts do (`from horovod.tensorflow.elastic import ...`),
raises the same `NotImplementedError` instead of a `ModuleNotFoundError`.
"""

from mpistrategy.horovod.tensorflow import unsupported as _unsupported

_unsupported.refuse_elastic("horovod.tensorflow.elastic")
