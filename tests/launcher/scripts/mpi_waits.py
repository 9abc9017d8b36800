"""One rank late to start (`--late start`) or to end (`--late end`).

Rank 1 sleeps `--seconds` before it imports mpistrategy, or after the
others are done, while rank 0 waits in MPI_Init or MPI_Finalize: outside
the engine, where no peer timeout runs.  Events: STARTED, ENDING.
"""

import time

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--late", choices=("start", "end"), required=True)
p.add_argument("--seconds", type=float, default=4.0)
args = p.parse_args()

rank = io.env_rank()
if rank == 1 and args.late == "start":
  time.sleep(args.seconds)

import mpistrategy  # pylint: disable=g-import-not-at-top,wrong-import-position

mpistrategy.init()
io.emit("STARTED")
if rank == 1 and args.late == "end":
  time.sleep(args.seconds)
io.emit("ENDING")
