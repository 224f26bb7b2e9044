"""A stand-in for one grid cell's `trl-federated run`, for the harness tests (tests/test_verdict.py and
tests/test_gate.py): it writes what a finished cell writes (result.json last, the small files, an adapter and a
checkpoint folder) in a second, with the results a spec file gives.

    python fake_cell.py CELL_FOLDER SPEC_JSON [run flags ...]

The spec (JSON): "base" and "final" evaluations (`final` per cell under "cells", keyed "<setting>/<method>/seed<s>",
else "default_final"), "fail" (cells that exit 3 at once, writing nothing), "together" and "wait_for" (wait up to
`wait_for` seconds until `together` cells are running at once), "cpu_seconds" (CPU time to burn). Each cell appends to
log.jsonl beside the spec: its key, how many cells it saw running, its OMP_NUM_THREADS and its run flags. The base
evaluation (round -1) is written unless the flags hold `--eval_initial false`, as a real run.
"""

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    directory, spec_path, flags = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    spec = json.loads(spec_path.read_text())
    folder = spec_path.parent
    key = "/".join(directory.parts[-3:])
    if key in spec.get("fail", []):  # at once, before any cell beside it ends
        with (folder / "log.jsonl").open("a") as stream:
            stream.write(json.dumps({"cell": key, "failed": True, "flags": flags}) + "\n")
        return 3
    marker = folder / f"running-{os.getpid()}"
    marker.write_text("")
    deadline = time.monotonic() + spec.get("wait_for", 0)
    while len(list(folder.glob("running-*"))) < spec.get("together", 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    seen = len(list(folder.glob("running-*")))
    busy = time.process_time() + spec.get("cpu_seconds", 0.0)
    while time.process_time() < busy:
        pass
    with (folder / "log.jsonl").open("a") as stream:
        stream.write(json.dumps({"cell": key, "seen": seen, "threads": os.environ.get("OMP_NUM_THREADS"),
                                 "flags": flags}) + "\n")  # fmt: skip
    time.sleep(0.2)  # still running while a cell started beside it counts the others
    marker.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    evaluations = {"1": spec.get("cells", {}).get(key, spec.get("default_final"))}
    if "--eval_initial" not in flags:
        evaluations["-1"] = spec["base"]
    for name in ("metrics.jsonl", "summary.md", "rewards.png", "weights.png", "accuracy.png",
                 "adapter_model.safetensors", "adapter_config.json", "README.md"):  # fmt: skip
        (directory / name).write_text(f"{name} of {key}\n")
    for folder_name in ("checkpoint-1", "round-1"):
        (directory / folder_name).mkdir(exist_ok=True)
        (directory / folder_name / "adapter_model.safetensors").write_text("weights\n")
    result = {"wall_time": 1.0, "evaluations": evaluations,
              "rounds": [{"round_idx": t, "rewards": {"client_0": 0.1 * t}} for t in range(2)]}  # fmt: skip
    (directory / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
