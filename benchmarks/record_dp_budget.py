"""What record-level DP needs to learn: the noise multiplier σ a client calibrates for a budget, and the noise against
the signal of one step, for clients of N prompts taking steps of b prompts (`local.record_privacy`).

    python benchmarks/record_dp_budget.py [--epsilon 8] [--steps 300] [--records 1000 10000 100000] \
        [--batch 2 64 512 4096]

σ is what `dp_record_epsilon` calibrates (each client's own RDP accountant, R̄ released every round with σ_R = σ,
rounds of 10 steps). A step's noise per coordinate has std 2σC/b, while the mean of b clipped record gradients is at
most C long: spread evenly over the adapter's d coordinates, C/√d each. Their ratio, 2σ√d/b, is printed for the
quickstart's adapter (LoRA r = 16 on every linear layer of SmolLM2-135M, d = 4,884,480) and for a rank-1 adapter on
the query and value projections alone (d = 57,600): above 1, a single step is mostly noise.
"""

from __future__ import annotations

import argparse
import math
import sys

from trl_federated.local.record_privacy import calibrated_noise_multiplier

ADAPTERS = {"r16 all-linear": 4_884_480, "r1 q,v": 57_600}
STEPS_PER_ROUND = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--records", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 64, 512, 4096])
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rounds = math.ceil(args.steps / STEPS_PER_ROUND)
    print(f"ε = {args.epsilon:g} at δ = {args.delta:g} over {args.steps} steps ({rounds} rounds of "
          f"{STEPS_PER_ROUND}, R̄ released each round)")
    print(f"| N prompts | b a step | σ | {' | '.join(f'2σ√d/b, {name}' for name in ADAPTERS)} |")
    print(f"|---|---|---|{'---|' * len(ADAPTERS)}")
    for records in args.records:
        for batch in args.batch:
            if batch > records:
                continue
            sigma = calibrated_noise_multiplier(args.epsilon, args.delta, rounds, STEPS_PER_ROUND, records, batch, 1,
                                                None)
            ratios = " | ".join(f"{2 * sigma * math.sqrt(d) / batch:,.3g}" for d in ADAPTERS.values())
            print(f"| {records:,} | {batch:,} | {sigma:.3g} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
