"""`python -m mpistrategy.run` (`mpistrategyrun`): runs a script on N ranks.

The launcher lives in `mpistrategy.launch` (see its docstring for what it
does); this module is its entry point and keeps the names it always had.
"""

import sys

from mpistrategy.launch.check import check
from mpistrategy.launch.cli import main
from mpistrategy.launch.cli import make_parser
from mpistrategy.launch.cli import parse_args
from mpistrategy.launch.command import build_command
from mpistrategy.launch.command import Command
from mpistrategy.launch.command import detect_mpi_flavour
from mpistrategy.launch.command import find_launcher
from mpistrategy.launch.supervise import run

__all__ = ["Command", "build_command", "check", "detect_mpi_flavour",
           "find_launcher", "main", "make_parser", "parse_args", "run"]

if __name__ == "__main__":
  sys.exit(main())
