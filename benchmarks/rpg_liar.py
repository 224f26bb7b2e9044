"""How much RPG weight a client takes by lying about R̄ inside the declared reward range (issue 26).

A client's R̄ is its own report: the server checks that it lies in the range the reward functions declare
(`reward_range`) and that it is the mean of the last W step rewards sent with it, but it cannot check that those
rewards were earned. So a liar picks any sequence of R̄ in [R_min, R_max]. RPG weighs a client by its gain over its
own history, h = (R̄ − φ) / (σ + ε), clipped to ±`rpg_h_max`: the most it can gain in one round is reporting R_max
after enough rounds at R_min to bring its baseline φ down to R_min and its volatility σ to σ_min.

This runs the server's own `RPGAggregator` (the defaults of `FedGRPOConfig`: λ_base 0.8, ι 0.9, σ in [0.05, 0.2],
h_max 10) against N − 1 honest clients whose reward is steady (h = 0, an honest client's typical gain), at a fixed
temperature τ (the ends of the default annealing range, 2.5 in round 0 down to 1.5), and searches the liar's
strategies:

- peak: its largest weight in any one round, over "L rounds at R_min, then R_max" for L = 0..20;
- sustained: its largest mean weight over 200 rounds, over the periodic patterns "L rounds at R_min, H rounds at
  R_max" (L, H = 1..6), against 1/N for an honest client.

    python benchmarks/rpg_liar.py
"""

from __future__ import annotations

import argparse
import itertools

from trl_federated import ClientUpdate
from trl_federated.aggregation import RPGAggregator

HONEST_REWARD = 0.5  # any steady value in the range: an honest client's h is then 0


def liar_weights(pattern: list[float], num_clients: int, tau: float) -> list[float]:
    """The liar's weight in each round when it reports `pattern` (its R̄, round by round) beside `num_clients` − 1
    steady honest clients, with the temperature held at `tau`."""
    aggregator = RPGAggregator(tau_min=tau, tau_max=tau)
    weights = []
    for round_idx, reward in enumerate(pattern):
        updates = [ClientUpdate("liar", {}, 1, reward)] + [
            ClientUpdate(f"honest-{index}", {}, 1, HONEST_REWARD) for index in range(num_clients - 1)
        ]
        weights.append(aggregator.client_weights(updates, round_idx)[0])
    return weights


def peak(num_clients: int, tau: float, low: float, high: float) -> float:
    """The liar's largest one-round weight."""
    best = 0.0
    for lows in range(21):
        best = max(best, liar_weights([low] * lows + [high], num_clients, tau)[-1])
    return best


def sustained(num_clients: int, tau: float, low: float, high: float, rounds: int = 200) -> tuple[float, str]:
    """The liar's largest mean weight over `rounds` rounds among periodic low/high patterns, and the pattern."""
    best, best_pattern = 0.0, ""
    for lows, highs in itertools.product(range(1, 7), range(1, 7)):
        period = [low] * lows + [high] * highs
        weights = liar_weights((period * (rounds // len(period) + 1))[:rounds], num_clients, tau)
        mean = sum(weights) / len(weights)
        if mean > best:
            best, best_pattern = mean, f"{lows} low, {highs} high"
    return best, best_pattern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[3, 5, 10])
    parser.add_argument("--taus", type=float, nargs="+", default=[2.5, 1.5])
    parser.add_argument("--ranges", type=float, nargs="+", default=[1.0, 2.0],
                        help="R_max − R_min of the declared reward range (R_min = 0)")
    args = parser.parse_args()
    print("| reward range | N | τ | honest ω (1/N) | liar's peak ω | liar's sustained mean ω (pattern) |")
    print("|---|---:|---:|---:|---:|---:|")
    for span, num_clients, tau in itertools.product(args.ranges, args.clients, args.taus):
        top = peak(num_clients, tau, 0.0, span)
        mean, pattern = sustained(num_clients, tau, 0.0, span)
        print(f"| [0, {span:g}] | {num_clients} | {tau:g} | {1 / num_clients:.3f} | {top:.3f} | "
              f"{mean:.3f} ({pattern}) |")


if __name__ == "__main__":
    main()
