"""The grid's cells, run: every (setting, seed, method) cell is one `trl-federated run` of a base config
(`compare.cell_command`), skipped when its `result.json` exists and resumed from its last round checkpoint when it
was interrupted, so rerunning the same command resumes a grid. `--parallel` runs several cells at a time, each a
process limited to its share of the cores; each attempt that ends records its CPU and wall seconds and the machine
it ran on in the cell's `cost.json`; after every cell the script's report is rewritten, and with `--commit` the
cell's small files (`CELL_FILES`: never adapters or checkpoints) and the report are committed. The folder's
`budget.json` records the config and flags its cells ran with: a rerun with another budget is refused (its finished
cells would be skipped, not rerun). `grid_main` is the command line's tail that every grid script shares."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from trl_federated.core.evaluation import COMPLETIONS_FILE
from trl_federated.reports.compare import Cell, cell_command

from .cells import BUDGET_FILE, COST_FILE, TEST_ITEMS_FILE, base_evaluation

DEFAULT_CONFIG = "examples/configs/grid.yaml"
DEFAULT_OUTPUT_DIR = "benchmarks/results/grid"
# A finished cell's files that are committed (`--commit`): small, and enough to recheck every figure of the report
# and each client's curves, and to read what the final adapter answered. Adapters (`adapter_model.safetensors`,
# `round-<t>/`) and checkpoints stay out.
CELL_FILES = ("result.json", "metrics.jsonl", COST_FILE, "summary.md", "rewards.png", "weights.png", "accuracy.png",
              "validation.json", COMPLETIONS_FILE)
REPORT_FILES = ("verdict.md", "verdict.csv", "paired.csv", "verdict.json", BUDGET_FILE, TEST_ITEMS_FILE)
MAX_COMMITTED_BYTES = 5 * 2**20  # a cell file larger than this is not committed (and said so)
# What limits a cell process to its share of the cores under `--parallel`: torch's intra-op threads follow OMP.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Recorded with every cell attempt (`machine_record`): the CPU flags that choose torch's kernels, and the libraries
# whose versions change what a cell computes.
KERNEL_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"})
KERNEL_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "numpy")


def grid_cells(methods: list[str], seeds: list[int], extra_seeds: dict[str, list[int]], num_clients: list[int],
               alphas: list[str]) -> list[Cell]:
    """Every (setting, seed, method) cell, methods innermost: after each seed every method that runs it has its
    cell, so a partial grid is already a paired comparison, and the seeds only some methods run come last."""
    method_seeds = {method: list(dict.fromkeys([*seeds, *extra_seeds.get(method, [])])) for method in methods}
    all_seeds = list(dict.fromkeys(seed for method in methods for seed in method_seeds[method]))
    return [
        Cell(method, seed, clients, alpha)
        for clients, alpha, seed in itertools.product(num_clients, alphas, all_seeds)
        for method in methods
        if seed in method_seeds[method]
    ]


def parse_extra_seeds(specs: Iterable[str], methods: list[str]) -> dict[str, list[int]]:
    """`["fgrpo,fedavg:3,4,5"]` -> `{"fgrpo": [3, 4, 5], "fedavg": [3, 4, 5]}`: seeds that only some methods run,
    on top of `--seeds`; every named method must be among `methods`."""
    extra: dict[str, list[int]] = {}
    for spec in specs:
        names, colon, seeds = spec.partition(":")
        try:
            values = [int(seed) for seed in seeds.split(",") if seed.strip()]
        except ValueError:
            values = []
        if not colon or not values or not names.strip():
            raise ValueError(f"--extra_seeds takes METHOD[,METHOD...]:SEED[,SEED...] (e.g. fgrpo,fedavg:3,4,5), "
                             f"got {spec!r}.")
        for name in (name.strip() for name in names.split(",")):
            if name not in methods:
                raise ValueError(f"--extra_seeds names {name!r}, which is not among --methods ({', '.join(methods)}).")
            extra[name] = [*extra.get(name, []), *(seed for seed in values if seed not in extra.get(name, []))]
    return extra


def extra_seeds_argument(
    parser: argparse.ArgumentParser, specs: Iterable[str], methods: list[str]
) -> dict[str, list[int]]:
    """`parse_extra_seeds` of a script's `--extra_seeds`, a malformed one a usage error of `parser`."""
    try:
        return parse_extra_seeds(specs, methods)
    except ValueError as error:
        parser.error(str(error))


class BudgetError(ValueError):
    """A grid folder holds cells of another budget (`check_budget`)."""


def check_budget(root: Path, config: str, extra: list[str]) -> None:
    """Record in `root/budget.json` the config (its values) and the flags the cells of `root` run with, or refuse
    with a `BudgetError`, naming the differences, when the folder already holds cells of another budget: their finished
    cells would be skipped, not rerun, and mixed into the report."""
    with open(config, encoding="utf-8") as stream:
        budget = json.loads(json.dumps({"config": yaml.safe_load(stream) or {}, "flags": list(extra)}))
    path = root / BUDGET_FILE
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(budget, indent=1) + "\n", encoding="utf-8")
        return
    saved = json.loads(path.read_text(encoding="utf-8"))
    if saved == budget:
        return
    keys = sorted(key for key in saved["config"].keys() | budget["config"].keys()
                  if saved["config"].get(key) != budget["config"].get(key))
    changes = [f"{key}: {saved['config'].get(key)!r} -> {budget['config'].get(key)!r}" for key in keys]
    if saved["flags"] != budget["flags"]:
        changes.append(f"flags: {saved['flags']} -> {budget['flags']}")
    raise BudgetError(
        f"{root} holds cells of another budget ({'; '.join(changes)}; recorded in {path}): give this budget its own "
        "--output_dir, or delete that file if the change cannot alter any result."
    )


def cell_environment(parallel: int) -> dict[str, str] | None:
    """The environment of a cell process when `parallel` cells share the machine: each gets its share of the cores
    (`THREAD_VARIABLES`); None (inherit) for one cell at a time."""
    if parallel <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(max(1, cores // parallel)))}


def machine_record(environment: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine a cell attempt runs on: bf16 kernels (AVX512-BF16, AMX) differ between CPUs, and threaded kernels
    between thread counts, so the same seed need not give the same numbers elsewhere. CPU model and the flags that pick
    kernels (/proc/cpuinfo), the cell's threads (`THREAD_VARIABLES` of `environment`, else the cores) and the versions
    of the libraries that compute."""
    from importlib import metadata

    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as stream:
        for line in stream:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = (environment or os.environ).get(THREAD_VARIABLES[0])
    versions = {}
    for package in KERNEL_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "cpu": info.get("model name", platform.processor() or "unknown"),
        "cpu_flags": sorted(set(info.get("flags", "").split()) & KERNEL_FLAGS),
        "cores": cores,
        "threads": int(threads) if threads and threads.isdigit() else cores,
        "python": platform.python_version(),
        "versions": versions,
    }


def record_cost(
    directory: Path, cpu_seconds: float, wall_seconds: float, machine: dict[str, Any] | None = None,
    stopped: bool = False,
) -> None:
    path = directory / COST_FILE
    attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    attempts.append({"cpu_seconds": cpu_seconds, "wall_seconds": wall_seconds,
                     **({"machine": machine} if machine else {}), **({"stopped": True} if stopped else {})})
    path.write_text(json.dumps(attempts, indent=1), encoding="utf-8")


def run_cells(
    cells: list[Cell],
    root: Path,
    command: Callable[[Cell], list[str] | None],
    parallel: int = 1,
    on_finish: Callable[[Cell, bool], None] | None = None,
) -> list[tuple[Cell, int]]:
    """Run `command(cell)` for every cell, at most `parallel` processes at a time (`cell_environment`), in order; a
    None command is a finished cell, skipped. Each attempt that exits 0 appends its CPU seconds (the process's and
    its children's, `os.wait4`) and wall seconds to the cell's cost.json, and so does one this run stops (`"stopped":
    true`); an attempt killed with the machine records nothing, so such a cell's cost is a lower bound
    (`cells.cell_cost` says which). `on_finish(cell, ran)` follows every finished cell, skipped ones
    included (`ran` False). A failing cell stops the launch of further cells; those running are waited for. Returns
    the failures, (cell, exit status). Stopped (SIGTERM, or Ctrl-C), it stops the running cells with SIGTERM, waits
    for them (each resumes from its last round checkpoint on the next run) and exits (status 143 for SIGTERM)."""
    environment = cell_environment(parallel)
    pending, running, failures = list(cells), {}, []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    try:
        _run_cells(pending, running, failures, root, command, parallel, on_finish, environment)
    except (_Stopped, KeyboardInterrupt) as stop:
        for cell, process, _ in running.values():
            print(f"[verdict] stopping {cell.method} {cell.setting} seed {cell.seed}", flush=True)
            process.terminate()
        for cell, process, started in running.values():
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen.wait
            record_cost(cell.directory(root), usage.ru_utime + usage.ru_stime, time.perf_counter() - started,
                        machine_record(environment), stopped=True)
        if isinstance(stop, _Stopped):
            raise SystemExit(128 + stop.signum) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return failures


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    raise _Stopped(signum)


def _run_cells(pending, running, failures, root, command, parallel, on_finish, environment) -> None:
    while pending or running:
        while pending and len(running) < max(1, parallel) and not failures:
            cell = pending.pop(0)
            argv = command(cell)
            if argv is None:
                if on_finish is not None:
                    on_finish(cell, False)
                continue
            cell.directory(root).mkdir(parents=True, exist_ok=True)
            process = subprocess.Popen(argv, env=environment)
            running[process.pid] = (cell, process, time.perf_counter())
        if not running:
            break
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:  # not a cell of this grid
            continue
        cell, process, started = running.pop(pid)
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen.wait
        if process.returncode != 0:
            print(f"[verdict] {cell.method} {cell.setting} seed {cell.seed}: failed with exit status "
                  f"{process.returncode}; no further cell is started", flush=True)
            failures.append((cell, process.returncode))
            continue
        record_cost(cell.directory(root), usage.ru_utime + usage.ru_stime, time.perf_counter() - started,
                    machine_record(environment))
        if on_finish is not None:
            on_finish(cell, True)


def run_timed_cell(cell: Cell, config: str, root: Path, extra: list[str]) -> None:
    """One cell (`run_cells`), its cost recorded in its cost.json; raises if it fails."""
    failures = run_cells([cell], root, lambda cell: cell_command(cell, config, root, extra))
    if failures:
        raise subprocess.CalledProcessError(failures[0][1], f"trl-federated run of {cell}")


def committed_files(directory: Path) -> list[Path]:
    """A finished cell's files that `--commit` commits: `CELL_FILES` that exist and are at most
    `MAX_COMMITTED_BYTES`, and under record-level DP each client's ledger of what it released (σ, N, b, counts);
    never its adapters, round adapters or checkpoints."""
    from trl_federated.local.record_privacy import RECORD_LEDGER

    files = []
    for path in [*(directory / name for name in CELL_FILES), *sorted(directory.glob(f"clients/*/{RECORD_LEDGER}"))]:
        if not path.is_file():
            continue
        if path.stat().st_size > MAX_COMMITTED_BYTES:
            print(f"[verdict] {path} is {path.stat().st_size / 2**20:.1f} MiB: not committed", flush=True)
            continue
        files.append(path)
    return files


def report_files(root: Path) -> list[Path]:
    """The grid folder's report (`REPORT_FILES`, the gate's report and the curves) that exists."""
    names = [*REPORT_FILES, "gate.md", "gate.json"]
    return [root / name for name in names if (root / name).is_file()] + sorted(root.glob("curves-*.png"))


def commit(paths: list[Path], message: str) -> bool:
    """`git add` and `git commit` exactly `paths` (nothing else staged goes in) in the repository holding them; False
    when there is nothing new to commit or git fails (said on stdout: the grid goes on, and the next run of the
    same command commits what this one could not)."""
    if not paths:
        return False
    cwd = paths[0].parent
    names = [str(path.resolve()) for path in paths]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)

    for args in (("add", "--force", "--", *names), ("diff", "--cached", "--name-only", "--", *names)):
        result = git(*args)
        if result.returncode != 0:
            print(f"[verdict] not committed: git {args[0]} failed ({result.stderr.strip()})", flush=True)
            return False
    if not result.stdout.strip():  # every file is committed as it is
        return False
    result = git("commit", "--quiet", "--only", "-m", message, "--", *names)
    if result.returncode != 0:
        print(f"[verdict] not committed: git commit failed ({(result.stderr or result.stdout).strip()})", flush=True)
        return False
    print(f"[verdict] committed: {message}", flush=True)
    return True


def add_run_arguments(parser: argparse.ArgumentParser, output_dir: str = DEFAULT_OUTPUT_DIR) -> None:
    """The flags the grid shares with the gate (`benchmarks/gate.py`): which config, where, how many at a time."""
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="Base config of every cell.")
    parser.add_argument("--output_dir", default=output_dir,
                        help="Grid folder: one sub-folder per cell, and the report; finished cells are skipped.")
    parser.add_argument("--parallel", type=int, default=1,
                        help="Cells run at a time, each a process with its share of the cores (OMP_NUM_THREADS etc.).")
    parser.add_argument("--commit", action="store_true",
                        help="After each finished cell, git-commit its small files (result, metrics, summary, curves, "
                        "cost) and the report; never adapters or checkpoints.")
    parser.add_argument("--report_only", action="store_true", help="Run nothing: report the cells finished so far.")


def run_grid(cells: list[Cell], args: argparse.Namespace, extra: list[str], report: Callable[[], str],
             label: str, reports: Callable[[Path], list[Path]] = report_files) -> int:
    """Run `cells` (`run_cells`) in `args.output_dir` after `check_budget`, rewriting the report after every finished
    cell and committing it and the report's files (`reports`) with `args.commit`; 1 when a cell failed. The base
    model is evaluated in one cell only, the first, unless a finished cell of the folder has evaluated it already
    (`base_evaluation`): every cell starts from the same base model and is tested on the same split."""
    root = Path(args.output_dir)
    check_budget(root, args.config, extra)
    shared_base = base_evaluation(root) is not None

    def command(cell: Cell) -> list[str] | None:
        evaluate_base = cell == cells[0] and not shared_base
        return cell_command(cell, args.config, root, [*extra, *([] if evaluate_base else ["--eval_initial", "false"])])

    def on_finish(cell: Cell, ran: bool) -> None:
        if ran:
            report()
        if args.commit:
            name = f"{cell.method} {cell.setting} seed {cell.seed}"
            commit([*committed_files(cell.directory(root)), *reports(root)], f"{label}: {name} finished")

    failures = run_cells(cells, root, command, args.parallel, on_finish)
    if args.commit:
        report()
        commit(reports(root), f"{label}: report")
    return 1 if failures else 0


def grid_main(parser: argparse.ArgumentParser, cells: list[Cell], args: argparse.Namespace, extra: list[str],
              report: Callable[[], str], label: str, reports: Callable[[Path], list[Path]] = report_files) -> int:
    """The tail of a grid script's `main`: unless `--report_only`, run the cells (`run_grid`; a folder of another
    budget is a usage error), then print the report. 1 when a cell failed."""
    status = 0
    if not args.report_only:
        try:
            status = run_grid(cells, args, extra, report, label, reports)
        except BudgetError as error:
            parser.error(str(error))
    print(report())
    return status
