"""The gated MLPs' recomputed activations (`trl_federated/gated_mlp.py`) against autograd's own: peak memory and CPU
seconds of a quickstart step's loss forward + backward, and whether the gradients are the same.

    python benchmarks/gated_mlp.py [--model default|tiny] [--repeats 4] [--threads 2]

One step is what the quickstart trains after generation: 2 prompts (191 and 130-191 tokens, left-padded) x 4
completions of 64 tokens, re-cut by prompt into 2 micro-batches of 4 rows (one prompt each, as
`micro_batches_by_prompt` cuts them), through `FedGRPOTrainer.compute_loss` with the shared-prefix path and its
backward into the LoRA adapter (r=16 on every projection, float32); the setup of `benchmarks/shared_prefix.py`.
The "autograd" side runs the same trainer with `recompute_gated_mlp` off, the other with it on. The sides
alternate in one process (which goes first alternates too), after an untimed warm-up of each. Per side: the median
CPU seconds (`time.process_time`, all threads) and the largest rise of the resident set over the step (VmHWM
reset through /proc/self/clear_refs at its start, freed heap handed back before it), over `--repeats` steps.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch

from harness.timing import alternated, read_peak_rss_mib, reset_peak_rss, resident_mib
from harness.trainers import build_trainer, generation_batch


def step(trainer, micro_batches: list[dict], recompute: bool) -> tuple[float, float, torch.Tensor]:
    """CPU seconds and resident-memory rise (MiB) of one step's forward + backward, and its adapter gradient."""
    from trl_federated.runtime.memory import release_free_memory

    trainer.args.recompute_gated_mlp = recompute
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    trainer.model.zero_grad(set_to_none=True)
    release_free_memory()
    start_mib = resident_mib()
    reset_peak_rss()
    start = time.process_time()
    for inputs in micro_batches:
        trainer.compute_loss(trainer.model, inputs).backward()
    seconds = time.process_time() - start
    rise = read_peak_rss_mib() - start_mib
    return seconds, rise, torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad])


def measure(model: str, repeats: int) -> dict:
    from trl_federated.local.shared_prefix import micro_batches_by_prompt

    with tempfile.TemporaryDirectory() as tmp:
        if model == "tiny":
            from trl_federated.testing import save_tiny_model

            model_path = str(save_tiny_model(f"{tmp}/tiny", hidden_size=64))
        else:
            model_path = None  # the embedded SmolLM2-135M-Instruct
        trainer = build_trainer(model_path, f"{tmp}/run", micro_batch=4)
    trainer.args.shared_prefix = True
    micro_batches = micro_batches_by_prompt(
        generation_batch(trainer, num_prompts=2, group_size=4, micro_batch=4, seed=0)
    )
    for recompute in (False, True):
        step(trainer, micro_batches, recompute)
    runs = alternated({recompute: functools.partial(step, trainer, micro_batches, recompute)
                       for recompute in (False, True)}, repeats)
    seconds, rises, gradients = ({side: [run[index] for run in runs[side]] for side in runs} for index in range(3))
    autograd_s, recomputed_s = statistics.median(seconds[False]), statistics.median(seconds[True])
    reference = gradients[False][0]

    def difference(gradient):
        return ((gradient - reference).norm() / reference.norm()).item()

    return {
        "autograd_cpu_s": autograd_s, "recomputed_cpu_s": recomputed_s, "cpu_ratio": recomputed_s / autograd_s,
        "autograd_peak_rise_mib": max(rises[False]), "recomputed_peak_rise_mib": max(rises[True]),
        "gradients_equal": all(torch.equal(gradient, reference) for gradient in gradients[True]),
        # Against the first autograd step: the recomputed side's gradients, and the other autograd steps' (how far
        # the same computation moves between steps: BLAS kernels can depend on the operands' memory alignment).
        "recomputed_relative_difference": max(map(difference, gradients[True])),
        "autograd_relative_difference": max(map(difference, gradients[False][1:]), default=float("nan")),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="default")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.model, args.repeats)
    print(f"model={args.model} threads={args.threads} repeats={args.repeats}")
    print("| side | loss forward + backward, CPU s (median) | peak RSS rise over the step (MiB) |")
    print("|---|---:|---:|")
    print(f"| autograd keeps silu(g) and h | {result['autograd_cpu_s']:.2f} | {result['autograd_peak_rise_mib']:.0f} |")
    print(f"| recomputed (gated_mlp) | {result['recomputed_cpu_s']:.2f} | {result['recomputed_peak_rise_mib']:.0f} |")
    print(f"CPU ratio {result['cpu_ratio']:.3f}; gradients bit for bit equal: {result['gradients_equal']}; relative "
          f"difference to the first autograd step: recomputed {result['recomputed_relative_difference']:.2e}, other "
          f"autograd steps {result['autograd_relative_difference']:.2e}")


if __name__ == "__main__":
    main()
