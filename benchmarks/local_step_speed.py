"""A local step at the machine's limit: the machine's floors, and today's path against the new one (fast generation:
`fast_generation=True`, `generation_dtype` as asked; the loss under bf16 autocast where the config's `bf16` resolves
on, as it does unset on a CPU with native bf16), on the quickstart's rows, in one run.

    python benchmarks/local_step_speed.py --config examples/configs/quickstart.yaml [--steps 2] [--repeats 2] \
        [--decode_tokens 32] [--eval_rows 32] [--quick] [--generation_dtype auto] [--tiny] \
        [any `trl-federated run` flag]

`--quick` (a few minutes on a CPU with native bf16) takes 1 step, 1 repeat, 16 decode tokens and 16 evaluation rows
where those flags are not given: the same figures, noisier.

Floors, measured on this machine at the start: the read bandwidth (sum of a 512 MiB tensor) and the matrix-product
throughput (float32 and bfloat16, the best of a prefill's MLP shape and a larger product). A decode step must read
every weight once: its floor is weight bytes / bandwidth, in each dtype. Prefill and loss are compute-bound: their
floors are FLOPs / throughput (2 per weight and token forward, 2 more backward for the input gradients; the frozen
base needs no weight gradients), for the tokens each path computes, in the dtype it computes them in.

Both paths run alternately, on the same adapter (reset before every run) and seed, in this process:
- decode and prefill: `_generate_single_turn` on the first generation batch of the largest client (its prompts
  x `num_generations` rows) with a fixed completion length (`min_new_tokens`): ms per decode step is the difference
  between `--decode_tokens` and 1 new tokens over the steps between; prefill is the 1-token call (for fast
  generation: refreshing the merged copy, the shared prefill and the first step);
- whole local steps: `--steps` steps of `trainer.train()` (a fresh trainer per run, the client's configuration),
  split into generation (+ scoring), loss forward + backward, and the rest;
- the greedy evaluation of `--eval_rows` test rows (`evaluate_accuracy`), with the accuracy each path scored.
Figures are medians of wall seconds over `--repeats` runs; ratios are today / fast. The report ends with one line
of the four ratios the targets are stated in (`summary_line`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
from collections import defaultdict

import torch

from harness.timing import alternated, machine_floors
from harness.trainers import Bench

DEFAULTS = {"steps": 2, "repeats": 2, "decode_tokens": 32, "eval_rows": 32}
QUICK = {"steps": 1, "repeats": 1, "decode_tokens": 16, "eval_rows": 16}


def measure(argv: list[str], steps: int, repeats: int, decode_tokens: int, eval_rows: int, tiny: bool) -> dict:
    from trl_federated.local.fast_generation import resolve_generation_dtype

    results = {"floors": machine_floors(tiny)}
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(argv, tiny, tmp)
        dtype_name = bench.args.generation_dtype
        dtype = resolve_generation_dtype(dtype_name, bench.model.device)
        runs = {False: defaultdict(list), True: defaultdict(list)}
        probe = bench.trainer(False, 1)
        prompt_ids = bench.first_batch_prompt_ids(probe)
        trainers = {False: probe, True: bench.trainer(True, 1)}
        for fast in (False, True):  # warm-up: allocator, the merged copy, lazy initialisation
            bench.generation(trainers[fast], prompt_ids, 2)
            bench.steps(fast, 1)
        def decode(fast: bool) -> dict[str, float]:
            one = bench.generation(trainers[fast], prompt_ids, 1)
            many = bench.generation(trainers[fast], prompt_ids, decode_tokens)
            return {"prefill_s": one, "decode_ms": 1000 * (many - one) / (decode_tokens - 1)}

        def local_steps(fast: bool) -> dict[str, float]:
            figures = {f"{name}_s": seconds for name, seconds in bench.steps(fast, steps).items()}
            if eval_rows:
                figures["evaluation_s"], figures["eval_accuracy"] = bench.evaluation(fast, eval_rows, dtype_name)
            return figures

        for measurement in (decode, local_steps):
            for fast, figures in alternated({fast: functools.partial(measurement, fast) for fast in (False, True)},
                                            repeats).items():
                for figure in figures:
                    for name, value in figure.items():
                        runs[fast][name].append(value)
        fast_stats = trainers[True].fast_generation_stats
        assert not fast_stats.fallbacks, fast_stats.fallbacks

        model = bench.model.get_base_model()
        config = model.config
        parameters = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad is False)
        embedding = config.vocab_size * config.hidden_size
        layer_parameters = parameters - embedding * (1 if config.tie_word_embeddings else 2)
        rows = len(prompt_ids)
        width = max(map(len, prompt_ids))
        distinct = len({tuple(ids) for ids in prompt_ids})
        completion = bench.args.max_completion_length
        floors = results["floors"]

        def compute_floor(tokens: int, head_positions: int, passes: int, dtype_name: str) -> float:
            flops = 2 * passes * (layer_parameters * tokens + embedding * head_positions)
            return flops / (floors[f"matmul_{dtype_name}_gflop_s"] * 1e9)

        generation_dtype = str(dtype).removeprefix("torch.")
        loss_tokens = distinct * (width - 1) + rows * (completion + 1)
        loss_dtype = "bfloat16" if bench.args.bf16 else "float32"
        results["setting"] = {
            "rows": rows, "distinct_prompts": distinct, "prompt_tokens_padded": width, "completion_tokens": completion,
            "decode_tokens": decode_tokens, "steps": steps, "repeats": repeats, "eval_rows": eval_rows,
            "threads": torch.get_num_threads(), "generation_dtype": generation_dtype, "bf16_loss": bench.args.bf16,
            "weights_mb_float32": parameters * 4 / 1e6,
        }  # fmt: skip
        results["floor"] = {
            "decode_ms_float32": parameters * 4 / (floors["read_gb_s"] * 1e9) * 1000,
            "decode_ms_bfloat16": parameters * 2 / (floors["read_gb_s"] * 1e9) * 1000,
            # today: every row's padded prompt; fast: each distinct prompt once, then each row's last token
            "prefill_s_today": compute_floor(rows * width, rows, 1, "float32"),
            "prefill_s_fast": compute_floor(distinct * (width - 1) + rows, rows, 1, generation_dtype),
            # the loss with the quickstart's shared_prefix: each prompt once per step, each completion + 1 token
            "loss_s_today": compute_floor(loss_tokens, rows * completion, 2, "float32"),
            "loss_s_fast": compute_floor(loss_tokens, rows * completion, 2, loss_dtype),
        }
        results["today"] = {name: statistics.median(values) for name, values in runs[False].items()}
        results["fast"] = {name: statistics.median(values) for name, values in runs[True].items()}
    return results


def report(results: dict) -> str:
    setting, floor, today, fast = results["setting"], results["floor"], results["today"], results["fast"]
    floors = results["floors"]
    lines = [
        f"rows {setting['rows']} ({setting['distinct_prompts']} prompts, padded to {setting['prompt_tokens_padded']} "
        f"tokens), completions up to {setting['completion_tokens']} tokens; {setting['threads']} threads; fast "
        f"generation in {setting['generation_dtype']}, loss in {'bf16 autocast' if setting['bf16_loss'] else 'float32'}"
        f"; medians of {setting['repeats']} alternated runs",
        f"machine: read {floors['read_gb_s']:.1f} GB/s, matmul float32 {floors['matmul_float32_gflop_s']:.0f} "
        f"GFLOP/s, bfloat16 {floors['matmul_bfloat16_gflop_s']:.0f} GFLOP/s; weights "
        f"{setting['weights_mb_float32']:.0f} MB in float32",
        "",
        "| | floor | today | fast | today / fast | fast / its floor |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    decode_floor = floor[f"decode_ms_{setting['generation_dtype']}"]

    def row(name, today_value, fast_value, floor_text="", fast_floor=None, unit="s", digits=2):
        ratio = today_value / fast_value if fast_value else float("nan")
        of_floor = f"{fast_value / fast_floor:.1f}x" if fast_floor else ""
        lines.append(
            f"| {name} | {floor_text} | {today_value:.{digits}f} {unit} | {fast_value:.{digits}f} {unit} "
            f"| {ratio:.2f} | {of_floor} |"
        )

    row(
        f"decode step ({setting['decode_tokens']} tokens)", today["decode_ms"], fast["decode_ms"],
        f"{floor['decode_ms_float32']:.1f} ms fp32 / {floor['decode_ms_bfloat16']:.1f} ms bf16", decode_floor,
        unit="ms", digits=1,
    )  # fmt: skip
    row(
        "prefill + first token", today["prefill_s"], fast["prefill_s"],
        f"{floor['prefill_s_today']:.2f} s / {floor['prefill_s_fast']:.2f} s", floor["prefill_s_fast"],
    )  # fmt: skip
    row("local step: generation + scoring", today["generation_s"], fast["generation_s"])
    row(
        "local step: loss forward + backward", today["loss_s"], fast["loss_s"],
        f"{floor['loss_s_today']:.2f} s / {floor['loss_s_fast']:.2f} s", floor["loss_s_fast"],
    )  # fmt: skip
    row("local step: rest (optimizer, logging)", today["rest_s"], fast["rest_s"])
    row("whole local step", today["step_s"], fast["step_s"])
    if "evaluation_s" in today:
        row(f"greedy evaluation ({setting['eval_rows']} rows)", today["evaluation_s"], fast["evaluation_s"])
        lines.append(f"\nevaluation accuracy: today {today['eval_accuracy']:.4f}, fast {fast['eval_accuracy']:.4f}")
    lines.append("\n" + summary_line(results))
    return "\n".join(lines)


def summary_line(results: dict) -> str:
    """The four ratios of this run the targets are stated in: the whole step and the evaluation against TRL's path
    (today / fast), decode and the loss against their floors (fast / its floor)."""
    setting, floor, today, fast = results["setting"], results["floor"], results["today"], results["fast"]
    evaluation = f"{today['evaluation_s'] / fast['evaluation_s']:.2f}x" if "evaluation_s" in today else "not run"
    decode_floor = floor[f"decode_ms_{setting['generation_dtype']}"]
    return (
        f"summary: whole step {today['step_s'] / fast['step_s']:.2f}x faster than TRL's path, decode "
        f"{fast['decode_ms'] / decode_floor:.1f}x its floor, loss "
        f"{fast['loss_s'] / floor['loss_s_fast']:.1f}x its floor, evaluation {evaluation} faster than TRL's path"
    )


def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", type=int, help=f"local steps per timed run (default {DEFAULTS['steps']})")
    own.add_argument("--repeats", type=int, help=f"default {DEFAULTS['repeats']}")
    own.add_argument("--decode_tokens", type=int, help=f"default {DEFAULTS['decode_tokens']}")
    own.add_argument("--eval_rows", type=int, help=f"default {DEFAULTS['eval_rows']}")
    own.add_argument("--quick", action="store_true", help=f"where not given: {QUICK}")
    own.add_argument("--tiny", action="store_true", help="the tiny model, small shapes: a smoke test")
    options, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    for name, value in (QUICK if options.quick else DEFAULTS).items():
        if getattr(options, name) is None:
            setattr(options, name, value)
    with contextlib.redirect_stdout(sys.stderr):  # the trainers' logs
        results = measure(rest, options.steps, options.repeats, options.decode_tokens, options.eval_rows, options.tiny)
    print(report(results))
    return results


if __name__ == "__main__":
    main()
