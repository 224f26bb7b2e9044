"""Shared-prefix log-probabilities (`shared_prefix=True`) against TRL's standard forward: tokens through the model
and CPU seconds of the GRPO loss's forward + backward, for groups of K completions.

    OMP_NUM_THREADS=1 python benchmarks/shared_prefix.py [--model tiny|default] [--group-sizes 4 8 16] \
        [--prompts 2] [--micro-batch 8] [--repeats 3]

One step is what an optimisation step computes after generation, as in the quickstart: a generation batch of
`--prompts` prompts x K completions (one prompt of 191 tokens, the others of 130-191, left-padded to 191;
completions of 64 tokens), shuffled and split into micro-batches of `--micro-batch` rows as TRL's
`_prepare_inputs` does, and for each micro-batch `FedGRPOTrainer.compute_loss` (DAPO, TRL's default) and its
backward into the LoRA adapter (r=16 on every linear projection, float32). Token ids are random: the cost does
not depend on them. Both sides run alternately in one process after an untimed warm-up; the figures are medians
over `--repeats` steps of CPU seconds (`time.process_time`, all threads of the process).

Tokens: "model" counts the token positions each decoder layer computes, "head" the positions projected onto the
vocabulary. On CPU TRL's fused head projects every position of the sequence, prompt included (on CUDA it keeps the
labelled ones), so the standard side costs rows x (P + T) and rows x (P + T - 1); the shared side
U x (P - 1) + rows x (T + 1) and rows x T + U, for U distinct prompts in a micro-batch (TRL's shuffle decides U).
The script also reports how far apart the two sides' adapter gradients are (the on-policy loss value itself does
not depend on the log-probabilities: its ratio is exp(logp - logp.detach()) = 1).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch

from harness.timing import alternated
from harness.trainers import COMPLETION_LENGTH, PROMPT_LENGTH, build_trainer, generation_batch


def step(trainer, micro_batches: list[dict], shared_prefix: bool) -> tuple[float, torch.Tensor]:
    """CPU seconds of one step's forward + backward over its micro-batches, and the adapter gradient it gave."""
    trainer.args.shared_prefix = shared_prefix
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    trainer.model.zero_grad(set_to_none=True)
    start = time.process_time()
    for inputs in micro_batches:
        trainer.compute_loss(trainer.model, inputs).backward()
    seconds = time.process_time() - start
    return seconds, torch.cat([param.grad.flatten() for param in trainer.model.parameters() if param.requires_grad])


def token_counts(micro_batches: list[dict]) -> dict[str, int]:
    """Decoder and LM-head positions of both sides, as the module docstring counts them."""
    rows = sum(inputs["prompt_ids"].size(0) for inputs in micro_batches)
    distinct = sum(
        torch.unique(torch.cat([inputs["prompt_ids"], inputs["prompt_mask"]], 1), dim=0).size(0)
        for inputs in micro_batches
    )
    length = PROMPT_LENGTH + COMPLETION_LENGTH
    return {
        "rows": rows,
        "distinct_prompts": distinct,
        "standard_model": rows * length,
        "shared_model": distinct * (PROMPT_LENGTH - 1) + rows * (COMPLETION_LENGTH + 1),
        "standard_head": rows * (length - 1),
        "shared_head": rows * COMPLETION_LENGTH + distinct,
    }


def measure(model: str, group_sizes: list[int], num_prompts: int, micro_batch: int, repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        if model == "tiny":
            from trl_federated.testing import save_tiny_model

            model_path = str(save_tiny_model(f"{tmp}/tiny"))
        else:
            model_path = None  # the embedded SmolLM2-135M-Instruct
        trainer = build_trainer(model_path, f"{tmp}/run", micro_batch)
    warm_up = generation_batch(trainer, num_prompts, min(group_sizes), micro_batch, seed=0)
    for shared_prefix in (False, True):
        step(trainer, warm_up, shared_prefix)
    results = []
    for group_size in group_sizes:
        micro_batches = generation_batch(trainer, num_prompts, group_size, micro_batch, seed=group_size)
        rows_before, prompt_rows_before = trainer.shared_prefix_stats.rows, trainer.shared_prefix_stats.prompt_rows
        runs = alternated({shared: functools.partial(step, trainer, micro_batches, shared) for shared in (False, True)},
                          repeats)
        seconds = {shared: [cpu_seconds for cpu_seconds, _ in runs[shared]] for shared in runs}
        gradients = {shared: runs[shared][-1][1] for shared in runs}  # each side's last step
        counts = token_counts(micro_batches)
        # what the shared path itself counted agrees with the count above
        assert trainer.shared_prefix_stats.rows - rows_before == repeats * counts["rows"]
        assert trainer.shared_prefix_stats.prompt_rows - prompt_rows_before == repeats * counts["distinct_prompts"]
        standard_s, shared_s = statistics.median(seconds[False]), statistics.median(seconds[True])
        results.append({
            "group_size": group_size, **counts, "micro_batches": len(micro_batches),
            "standard_cpu_s": standard_s, "shared_cpu_s": shared_s, "cpu_ratio": shared_s / standard_s,
            "gradient_relative_difference":
                ((gradients[True] - gradients[False]).norm() / gradients[False].norm()).item(),
        })  # fmt: skip
    assert not trainer.shared_prefix_stats.fallbacks, trainer.shared_prefix_stats.fallbacks
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[4, 8, 16], help="K values")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per generation batch (quickstart: 2)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (quickstart: 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    results = measure(options.model, options.group_sizes, options.prompts, options.micro_batch, options.repeats)
    print(
        f"model={options.model} prompts={options.prompts} micro_batch={options.micro_batch} "
        f"repeats={options.repeats} threads={options.threads}; "
        f"prompt {PROMPT_LENGTH}, completion {COMPLETION_LENGTH} tokens"
    )
    print("| K | rows | micro-batches | prompt passes | model tokens std / shared (ratio) "
          "| head positions std / shared (ratio) | CPU s std | CPU s shared | CPU ratio | gradient rel. diff |")
    print("|---:|---:|---:|---:|---|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['group_size']} | {r['rows']} | {r['micro_batches']} | {r['distinct_prompts']} "
            f"| {r['standard_model']} / {r['shared_model']} ({r['shared_model'] / r['standard_model']:.3f}) "
            f"| {r['standard_head']} / {r['shared_head']} ({r['shared_head'] / r['standard_head']:.3f}) "
            f"| {r['standard_cpu_s']:.2f} | {r['shared_cpu_s']:.2f} | {r['cpu_ratio']:.3f} "
            f"| {r['gradient_relative_difference']:.1e} |"
        )


if __name__ == "__main__":
    main()
