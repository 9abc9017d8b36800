"""Not provided: Horovod on Ray (`horovod.ray`).

Importing this module raises `NotImplementedError` instead of a
`ModuleNotFoundError`.
"""

raise NotImplementedError(
    "horovod.ray (running Horovod jobs on Ray) is not provided by "
    "mpistrategy.horovod: start the script with `mpirun -np N python "
    "script.py` or `mpistrategyrun -np N script.py` (under Slurm: srun)")
