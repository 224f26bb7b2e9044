"""The benchmarks' harness, which the scripts beside it import (and never each other): the grid's cells run,
resumed, costed and committed (`grid`), read back for a report (`cells`), the intervals and tests the reports draw
(`significance`), timing and memory (`timing`), and the trainers the step benchmarks measure (`trainers`).

Importing it puts this checkout's package first on the path, also where another checkout is installed (a worktree
running a grid): a script then reads the same methods table as the cells it runs (`compare.cell_command` runs them
from this checkout)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
