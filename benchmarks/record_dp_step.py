"""What record-level DP-SGD costs a local step, and the per-record gradient norms its clip norm is set against
(`local.record_privacy`, `dp_record_clip_norm`), on the quickstart's largest client.

    python benchmarks/record_dp_step.py --config examples/configs/quickstart.yaml [--steps 2] [--repeats 2] [--tiny]

Both paths run alternately in this process, each a fresh client trainer from the same adapter (a trained-looking one:
LoRA B drawn small, as `harness.trainers.Bench` sets it) for `--steps` local steps: the non-private step, and the
private one (one forward and backward per record, then clipping and noise) at σ = 1 with clipping off (C = 1e9), so
that every record's norm ‖g_r‖ is the unclipped one. Prints seconds per step (medians over `--repeats`), their ratio,
and ‖g_r‖ at 0, ¼, ½, ¾ and 1 over every record of the private runs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile

from harness.timing import alternated, wall_seconds
from harness.trainers import Bench


def run_steps(bench: Bench, private: bool, steps: int, norms: list[float]) -> float:
    """Seconds per local step of a fresh trainer (record-level DP with `private`); a private run's ‖g_r‖ join
    `norms`."""
    from accelerate.state import AcceleratorState

    from trl_federated.adapters import set_adapter_state
    from trl_federated.local.local_trainer import local_trainer
    from trl_federated.trainer import FedGRPOTrainer

    set_adapter_state(bench.model, bench.adapter)
    args = copy.deepcopy(bench.args)
    args.max_steps = args.local_steps = args.reward_window = steps
    args.dp_record_noise_multiplier = 1.0 if private else None
    args.dp_record_clip_norm = 1e9
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer = local_trainer(FedGRPOTrainer, args)(
        model=bench.model, reward_funcs=bench.reward_funcs, args=args, train_dataset=bench.client_data,
        processing_class=bench.tokenizer,
    )
    seconds = wall_seconds(trainer.train) / steps
    if private:
        norms.extend(norm for step in trainer.record_norms for norm in step)
    return seconds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="A tiny model instead of the config's (tests).")
    own, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as output_dir:
        bench = Bench(rest, own.tiny, output_dir)
        norms: list[float] = []
        runs = alternated({private: (lambda private=private: run_steps(bench, private, own.steps, norms))
                           for private in (False, True)}, own.repeats)
    plain, private = (statistics.median(runs[side]) for side in (False, True))
    quartiles = [min(norms), *statistics.quantiles(norms, n=4, method="inclusive"), max(norms)]
    records = bench.args.generation_batch_size // bench.args.num_generations
    print(f"client of {len(bench.client_data)} prompts, {records} records a step, {own.steps} steps x {own.repeats} "
          "repeats")
    print(f"seconds per local step: non-private {plain:.2f}, record-level DP {private:.2f}, "
          f"ratio {private / plain:.2f}")
    print(f"per-record gradient norms ‖g_r‖ over {len(norms)} records: min, quartiles, max "
          f"{', '.join(f'{norm:.3g}' for norm in quartiles)}")
    nonzero = [norm for norm in norms if norm > 0]  # a group whose completions all scored alike has no gradient
    if len(nonzero) > 1:
        quartiles = [min(nonzero), *statistics.quantiles(nonzero, n=4, method="inclusive"), max(nonzero)]
        print(f"the {len(nonzero)} non-zero ones: min, quartiles, max {', '.join(f'{norm:.3g}' for norm in quartiles)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
