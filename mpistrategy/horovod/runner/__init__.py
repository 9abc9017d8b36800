"""Not provided: Horovod's launcher package (`horovod.runner`).

`horovodrun`, `horovod.run` and the helpers under `horovod.runner` (which
Horovod's data-service example imports first) start and configure the
worker processes; importing this module raises `NotImplementedError`
instead of a `ModuleNotFoundError`.
"""

raise NotImplementedError(
    "horovod.runner (horovodrun, horovod.run and their helpers) is not "
    "provided by mpistrategy.horovod: start the script with `mpirun -np N "
    "python script.py` or `mpistrategyrun -np N script.py`")
