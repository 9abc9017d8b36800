"""Runs one of examples/horovod/*.py unchanged, then reports the weights.

    mpirun -np 2 python horovod_example.py --marker=M --example=PATH \
        --workdir=DIR [-- example args...]

The example runs as `__main__` (runpy) with `sys.argv` set to its own
arguments, in DIR (it writes checkpoints into its working directory).
Every Keras optimizer `apply` is watched (a wrapper on the Keras base
class), so afterwards each rank can print a digest of the trainable
variables the optimizer last updated: `@@ <rank> <time> WEIGHTS <n>
<sha256>`; then `DONE`.  An exception prints `ERROR` and exits 1.
"""

import hashlib
import os
import runpy
import sys

import _rankio


def main():
  argv = sys.argv[1:]
  extra = []
  if "--" in argv:
    extra = argv[argv.index("--") + 1:]
    argv = argv[:argv.index("--")]
  p = _rankio.parser(__doc__)
  p.add_argument("--example", required=True)
  p.add_argument("--workdir", required=True)
  args = p.parse_args(argv)

  import keras
  owner = next(k for k in keras.optimizers.Optimizer.__mro__
               if "apply" in k.__dict__ and k.__name__ == "BaseOptimizer")
  original = owner.__dict__["apply"]
  updated = []

  def apply(self, grads, trainable_variables=None):
    if trainable_variables is not None:
      updated[:] = list(trainable_variables)
    return original(self, grads, trainable_variables)

  owner.apply = apply

  os.makedirs(args.workdir, exist_ok=True)
  os.chdir(args.workdir)
  sys.argv = [args.example] + extra
  try:
    runpy.run_path(args.example, run_name="__main__")
  except SystemExit as e:
    if e.code not in (None, 0):
      _rankio.emit("ERROR", f"example exited with {e.code}")
      raise
  except Exception as e:  # pylint: disable=broad-except
    _rankio.emit("ERROR", _rankio.error_text(e))
    raise
  digest = hashlib.sha256()
  for v in updated:
    digest.update(v.numpy().tobytes())
  _rankio.emit("WEIGHTS", f"{len(updated)} {digest.hexdigest()}")
  _rankio.emit("DONE")


if __name__ == "__main__":
  main()
