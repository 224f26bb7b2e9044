"""`flwr run` for a script or CI: the same command line, with the two answers Flower's CLI (1.42) does not give.

    python -m trl_federated.flower.flwr_run examples/flower --stream --run-config "num-server-rounds=5"

- A `--run-config` key that the app's pyproject.toml does not declare is refused before anything starts, naming the
  key and the closest one; Flower's SuperLink refuses such a run as "[code: 15] Invalid run configuration." and
  names the key only in its own log.
- With `--stream`, the exit status is the run's: 1 unless `flwr ls --run-id` reports it `finished:completed`, and 1
  when `flwr run` reported no run id at all (text or `--format json`). `flwr run --stream` exits 0 however the run
  ended: a ServerApp that raised, or a SuperLink that failed to install the app's dependencies (Flower's exit code
  608 in the log); under `--format json` it exits 0 even when no run started.
- Ctrl-C stops the run (`flwr stop`), with its ServerApp, ClientApps and a simulation's Ray processes, and exits 130;
  Ctrl-C on `flwr run --stream` stops only its log stream, and the run goes on.

Every argument goes to `flwr run` unchanged.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

from flwr.common.config import flatten_dict, parse_config_args

from ..names import closest_key_hint
from .run_config import run_config_keys

# What `flwr run` prints once the SuperLink has accepted the run.
STARTED = re.compile(r"Successfully started run (\d+)")
# What it prints instead under `--format json` (Flower 1.41/1.42, `flwr.cli.run.run`): only a JSON object, indented
# by rich's `print_json`, one key a line, whose "run-id" is the id as a string (null where no run started).
JSON_RUN_ID = re.compile(r'"run-id"\s*:\s*"?(\d+)')
# A terminal's colour codes, which rich may add around the JSON's keys and values (FORCE_COLOR).
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# `flwr ls`'s status of a run that finished without error.
COMPLETED = "finished:completed"
# The exit status of a command that Ctrl-C (SIGINT) ended, as shells report it.
INTERRUPTED = 128 + signal.SIGINT


def check_run_config(app: Path, overrides: list[str] | None) -> None:
    """Refuse, naming it and the closest key, a `--run-config` key that `app`'s pyproject.toml does not declare
    (Flower takes no other)."""
    pyproject = app / "pyproject.toml"
    declared = flatten_dict(tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["flwr"]["app"].get("config"))
    for key in parse_config_args(overrides):
        if key in declared:
            continue
        if key in run_config_keys():
            advice = f" It sets a field: declare it there (`{key} = <value>`) to set it with --run-config."
        else:
            advice = closest_key_hint(key, [*declared, *run_config_keys()])
        raise ValueError(
            f"--run-config key `{key}` is not declared in {pyproject} ([tool.flwr.app.config]), so Flower would "
            f"refuse the run.{advice}"
        )


def started_run_id(line: str) -> str | None:
    """The run id `line` of `flwr run`'s output announces: its text line, or its JSON's "run-id" (`--format json`)."""
    line = ANSI_ESCAPE.sub("", line)
    started = STARTED.search(line) or JSON_RUN_ID.search(line)
    return started.group(1) if started else None


def run_status(flwr: str, superlink: str | None, run_id: str) -> tuple[str, str]:
    """(status, details) of run `run_id`, as `flwr ls --run-id` reports them."""
    command = [flwr, "ls", *([superlink] if superlink else []), "--run-id", run_id, "--format", "json"]
    listing = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        run = json.loads(listing.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        return "unknown", f"`{' '.join(command)}` answered {(listing.stdout + listing.stderr).strip()!r}"
    return run["status"], run["status-details"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m trl_federated.flower.flwr_run",
        description="`flwr run` with its arguments, refusing an undeclared --run-config key by name and, with "
        "--stream, exiting 1 unless the run completed; Ctrl-C stops the run.",
    )
    # `flwr run`'s arguments, declared so that their values are not taken for the positional ones.
    parser.add_argument("app", nargs="?", default=".")
    parser.add_argument("superlink", nargs="?")
    parser.add_argument("--run-config", "-c", action="append")
    parser.add_argument("--federation-config", action="append")
    parser.add_argument("--federation")
    parser.add_argument("--format")
    parser.add_argument("--stream", action="store_true")
    args, _ = parser.parse_known_args(argv)
    flwr = shutil.which("flwr")
    if flwr is None:
        parser.error("no `flwr` on PATH: install Flower (pip install -e '.[flower]') and activate its environment.")
    if not args.app.startswith("@"):  # a local app folder; `@account/app` is the Hub's, its keys unknown here
        try:
            check_run_config(Path(args.app), args.run_config)
        except (OSError, ValueError) as error:
            parser.error(str(error))

    process = subprocess.Popen([flwr, "run", *argv], stdout=subprocess.PIPE, text=True)
    run_id = None
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            run_id = run_id or started_run_id(line)
        returncode = process.wait()
    except KeyboardInterrupt:
        if run_id is not None:
            # Ctrl-C ends `flwr run`'s log stream only: the run goes on on the SuperLink (a Simulation Engine's Ray
            # workers with it) until stopped.
            stop = subprocess.run([flwr, "stop", run_id, *([args.superlink] if args.superlink else [])], check=False)
            print(f"Interrupted: run {run_id} " + ("stopped." if stop.returncode == 0 else "could not be stopped."),
                  file=sys.stderr)
        process.send_signal(signal.SIGINT)  # where the interrupt reached this process alone, not its group
        process.wait()
        return INTERRUPTED
    if returncode or not args.stream:
        return returncode
    if run_id is None:  # nothing started, or an answer this wrapper cannot read: either way no run to vouch for
        print("`flwr run` reported no run id (neither 'Successfully started run <id>' nor a JSON \"run-id\"): no "
              "run started, or none that can be followed.", file=sys.stderr)
        return 1
    status, details = run_status(flwr, args.superlink, run_id)
    if status != COMPLETED:
        print(f"Run {run_id} is {status}: {details}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
