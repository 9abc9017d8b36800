"""`python -m mpistrategy.quiet PROGRAM [ARGS ...]`: a quiet rank.

On rank 0 (or with MPISTRATEGY_VERBOSE=1, or outside an MPI job) it execs
PROGRAM.  On other ranks it runs PROGRAM with Python warnings ignored and
TensorFlow's C++ INFO/WARNING lines dropped from its stderr; errors,
tracebacks and everything else pass.  `python -m mpistrategy.run` puts it
in front of every rank's program; with plain mpirun:

```bash
mpirun -np 4 python -m mpistrategy.quiet python train.py
```

See `mpistrategy._output` for the details.
"""

import sys

from mpistrategy._output import main

if __name__ == "__main__":
  sys.exit(main())
