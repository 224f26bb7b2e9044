"""Learning parity of the bf16 loss: a client's local steps with the loss in float32 and under bf16 autocast, from the
same adapter and seed, on the quickstart's largest client (its configuration, fast generation as configured).

    python benchmarks/bf16_parity.py --config examples/configs/quickstart.yaml [--steps 4] [--seeds 0 1] \
        [--tiny] [any `trl-federated run` flag]

bf16 autocast (`bf16: true`, as `Trainer` applies it through accelerate) runs the model's matrix products in bf16;
the adapter, its gradients and the optimizer state stay float32, and TRL computes the log-probabilities from the
autocast logits as it does on a GPU. Printed per seed:
- the update after ONE step, where both sides trained on the same completions (the same weights sampled them
  under the same seed): |Δ_bf16 − Δ_fp32| / |Δ_fp32| and their cosine: the loss's numerics alone;
- after `--steps` steps (the completions differ from the second step on): the same two figures, and as the yardstick
  the float32 runs of two different seeds (what sampling alone moves);
- the reward of every step on each side, and the loss forward + backward seconds per step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile

import torch

from harness.trainers import Bench


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[key].float().flatten() for key in sorted(state)])


def local_run(bench: Bench, bf16: bool, seed: int, steps: int) -> dict:
    """`steps` local steps from the bench's adapter with the loss in bf16 autocast or float32."""
    from trl_federated.adapters import get_adapter_state

    bench.args.seed = seed
    trainer = bench.trainer(True, steps, bf16=bf16)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    seconds = bench.phases.take()
    update = flat(get_adapter_state(bench.model)) - flat(bench.adapter)
    return {"update": update, "rewards": rewards, "loss_s": seconds["loss"] / steps}


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """|a − b| / |b| and the cosine of a and b (NaN where b is zero: no reward varied, nothing was learned)."""
    if b.norm() == 0:
        return float("nan"), float("nan")
    return (a - b).norm().item() / b.norm().item(), torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", type=int, default=4)
    own.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    own.add_argument("--tiny", action="store_true", help="the tiny model: a smoke test")
    options, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        bench = Bench(rest, options.tiny, tmp)
        for seed in options.seeds:
            runs = {(bf16, steps): local_run(bench, bf16, seed, steps) for steps in (1, options.steps)
                    for bf16 in (False, True)}  # fmt: skip
            results[seed] = runs
    lines = [
        f"{options.steps} local steps per run; loss in float32 vs bf16 autocast, same adapter and seed",
        "",
        "| seed | after 1 step: rel. distance / cosine | after all steps: rel. distance / cosine | float32 seed vs "
        "next seed | rewards float32 | rewards bf16 | loss s/step fp32 / bf16 |",
        "|---:|---:|---:|---:|---|---|---:|",
    ]
    seeds = list(results)
    for index, seed in enumerate(seeds):
        runs = results[seed]
        one = compare(runs[(True, 1)]["update"], runs[(False, 1)]["update"])
        many = compare(runs[(True, options.steps)]["update"], runs[(False, options.steps)]["update"])
        other = seeds[(index + 1) % len(seeds)]
        noise = compare(results[other][(False, options.steps)]["update"], runs[(False, options.steps)]["update"])
        loss = [statistics.fmean([runs[(bf16, s)]["loss_s"] for s in (1, options.steps)]) for bf16 in (False, True)]
        rewards = [", ".join(f"{r:.3f}" for r in runs[(bf16, options.steps)]["rewards"]) for bf16 in (False, True)]
        lines.append(
            f"| {seed} | {one[0]:.3f} / {one[1]:.4f} | {many[0]:.3f} / {many[1]:.4f} | "
            f"{noise[0]:.3f} / {noise[1]:.4f} | {rewards[0]} | {rewards[1]} | {loss[0]:.2f} / {loss[1]:.2f} |"
        )
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
