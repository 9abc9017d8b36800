"""Not provided: Horovod on Spark (`horovod.spark`).

Importing this module raises `NotImplementedError` instead of a
`ModuleNotFoundError`.
"""

raise NotImplementedError(
    "horovod.spark (running Horovod jobs on Spark) is not provided by "
    "mpistrategy.horovod: start the script with `mpirun -np N python "
    "script.py` or `mpistrategyrun -np N script.py` (under Slurm: srun)")
