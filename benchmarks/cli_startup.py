"""Wall time of the command line's quick answers: `--version`, `--help`, `run --help`, `compare --help`, a misspelled
YAML key, a value that does not convert (`--num_rounds abc`) and one outside its choices (`--aggregation foo`).

    python benchmarks/cli_startup.py [--baseline /path/to/another/checkout] [--repeats 5]

Each command runs as a user runs it, `python -m trl_federated.cli ...` in a fresh process, with the working directory
at a checkout of this repository, so that it imports that checkout's package: this one, and with `--baseline` another
(`main` before a change), the two alternated command by command so that a busy machine slows both alike. Prints the
median wall seconds and CPU seconds (user + system, of the command's process) of each command per checkout and, with
a baseline, their ratio: on a loaded machine the CPU seconds are the steadier figure.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commands(typo_config: Path) -> dict[str, list[str]]:
    return {
        "--version": ["--version"],
        "--help": ["--help"],
        "run --help": ["run", "--help"],
        "compare --help": ["compare", "--help"],
        "YAML typo": ["run", "--config", str(typo_config)],
        "--num_rounds abc": ["run", "--num_rounds", "abc"],
        "--aggregation foo": ["run", "--aggregation", "foo"],
    }


def seconds(checkout: Path, argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one command."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "trl_federated.cli", *argv], cwd=checkout, capture_output=True, check=False)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to time alternately with this one")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as folder:
        typo_config = Path(folder) / "typo.yaml"
        typo_config.write_text("num_rounds: 2\nlerning_rate: 1.0e-5\n", encoding="utf-8")
        times = {(name, command): [] for name in checkouts for command in commands(typo_config)}
        for _ in range(args.repeats):
            for command, argv in commands(typo_config).items():
                for name, checkout in checkouts.items():
                    times[name, command].append(seconds(checkout, argv))
    print(f"median seconds of {args.repeats} runs" + (f"; baseline {args.baseline}" if args.baseline else ""))
    for index, kind in enumerate(("wall", "CPU")):
        header = "".join(f"{f'{kind} {name}':>16}" for name in checkouts) + ("     ratio" if args.baseline else "")
        print(f"{'command':<20}{header}")
        for command in commands(Path("typo.yaml")):
            medians = [statistics.median(pair[index] for pair in times[name, command]) for name in checkouts]
            ratio = f"{medians[0] / medians[1]:>10.3f}" if args.baseline else ""
            print(f"{command:<20}" + "".join(f"{median:>16.2f}" for median in medians) + ratio)


if __name__ == "__main__":
    main()
