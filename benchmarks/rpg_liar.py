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
  R_max" (L, H = 1..6), against 1/N for an honest client;
- best over H rounds (issue 48: a rising ramp beat every low/high pattern over 8 rounds): the liar's largest mean
  weight over its first H rounds (H = 8 and 200) over every sequence of reports, found by dynamic programming over
  its state (φ, σ) on a grid (`optimal_mean`), then replayed through `RPGAggregator` (`liar_weights`): the figure
  printed is the replayed one, a sequence the liar can send, and the DP's own estimate of the optimum beside it;
- ceiling: the per-round bound no sequence can pass, ω ≤ 1 / (1 + (N − 1) exp(−h_max / τ)) against steady honest
  clients (h = 0), the liar's h at most h_max (rewards spanning 1 cap it lower, at 1 / (ι σ_min + (1 − ι)) = 6.9).

    python benchmarks/rpg_liar.py                        # the table of docs/reliability.md
    python benchmarks/rpg_liar.py --clients 3 --ranges 2 --taus 2.5
"""

from __future__ import annotations

import argparse
import itertools
import math

import numpy as np

from trl_federated import ClientUpdate
from trl_federated.aggregation import RPGAggregator

HONEST_REWARD = 0.5  # any steady value in the range: an honest client's h is then 0


def liar_weights(pattern: list[float], num_clients: int, tau: float | None) -> list[float]:
    """The liar's weight in each round when it reports `pattern` (its R̄, round by round) beside `num_clients` − 1
    steady honest clients, with the temperature held at `tau` (None: the default annealing from round 0, τ from 2.5
    towards 1.5)."""
    aggregator = RPGAggregator() if tau is None else RPGAggregator(tau_min=tau, tau_max=tau)
    weights = []
    for round_idx, reward in enumerate(pattern):
        updates = [ClientUpdate("liar", {}, 1, reward)] + [
            ClientUpdate(f"honest-{index}", {}, 1, HONEST_REWARD) for index in range(num_clients - 1)
        ]
        weights.append(aggregator.client_weights(updates, round_idx)[0])
    return weights


def peak(num_clients: int, tau: float | None, low: float, high: float) -> float:
    """The liar's largest one-round weight."""
    best = 0.0
    for lows in range(21):
        best = max(best, liar_weights([low] * lows + [high], num_clients, tau)[-1])
    return best


def sustained(
    num_clients: int, tau: float | None, low: float, high: float, rounds: int = 200
) -> tuple[float, str]:
    """The liar's largest mean weight over `rounds` rounds among periodic low/high patterns, and the pattern."""
    best, best_pattern = 0.0, ""
    for lows, highs in itertools.product(range(1, 7), range(1, 7)):
        period = [low] * lows + [high] * highs
        weights = liar_weights((period * (rounds // len(period) + 1))[:rounds], num_clients, tau)
        mean = sum(weights) / len(weights)
        if mean > best:
            best, best_pattern = mean, f"{lows} low, {highs} high"
    return best, best_pattern


def optimal_mean(
    num_clients: int, tau: float | None, span: float, horizon: int, grid: int = 161, sigma_grid: int = 61
) -> tuple[float, float, list[float]]:
    """The liar's best mean weight over its first `horizon` rounds beside `num_clients` − 1 steady honest clients at
    temperature `tau` (None: the default annealing, the liar joining in round 0), rewards in [0, `span`]: (the mean
    of the best sequence found, replayed through `RPGAggregator`;
    the dynamic programme's estimate of the optimum; that sequence). The programme runs over the liar's state after
    a report, its baseline φ and volatility σ (`grid` × `sigma_grid` points, values between them interpolated
    bilinearly), and its next report R̄ (`grid` values in [0, span]); its first report sets φ to it and σ to σ_min
    (h = 0, weight 1/N)."""
    defaults = RPGAggregator()
    lam, iota, eps, h_max = defaults.lambda_base, defaults.iota, defaults.eps, defaults.h_max
    sigma_min, sigma_max = defaults.sigma_min, defaults.sigma_max
    phis, sigmas, reports = np.linspace(0, span, grid), np.linspace(sigma_min, sigma_max, sigma_grid), np.linspace(
        0, span, grid)
    phi, sigma, report = np.meshgrid(phis, sigmas, reports, indexing="ij")  # (φ, σ, R̄)

    def step(phi, sigma, report):
        gap = report - phi
        new_sigma = np.clip(iota * sigma + (1 - iota) * np.abs(gap), sigma_min, sigma_max)
        gain = np.clip(gap / (new_sigma + eps), -h_max, h_max)
        return gain, lam * report + (1 - lam) * phi, new_sigma

    def weight(gain, round_idx):
        temperature = defaults.temperature(round_idx) if tau is None else tau
        return 1 / (1 + (num_clients - 1) * np.exp(-gain / temperature))

    def interpolate(values, phi, sigma):
        x = np.clip((phi - phis[0]) / (phis[1] - phis[0]), 0, grid - 1 - 1e-9)
        y = np.clip((sigma - sigmas[0]) / (sigmas[1] - sigmas[0]), 0, sigma_grid - 1 - 1e-9)
        i, j = np.floor(x).astype(int), np.floor(y).astype(int)
        dx, dy = x - i, y - j
        return ((1 - dx) * (1 - dy) * values[i, j] + dx * (1 - dy) * values[i + 1, j]
                + (1 - dx) * dy * values[i, j + 1] + dx * dy * values[i + 1, j + 1])

    gain, next_phi, next_sigma = step(phi, sigma, report)
    # values[k]: the most weight rounds horizon − k .. horizon − 1 can add, from the state before round horizon − k
    values = [np.zeros((grid, sigma_grid))]
    for remaining in range(1, horizon):
        round_idx = horizon - remaining
        values.append((weight(gain, round_idx) + interpolate(values[-1], next_phi, next_sigma)).max(axis=2))
    first = 1 / num_clients + interpolate(values[-1], phis, np.full(grid, sigma_min))
    estimate = float(first.max()) / horizon
    sequence = [float(phis[int(first.argmax())])]
    state = (sequence[0], sigma_min)
    for remaining in range(horizon - 2, -1, -1):
        gain_now, phi_next, sigma_next = step(state[0], state[1], reports)
        weight_now = weight(gain_now, horizon - 1 - remaining)
        best = int((weight_now + interpolate(values[remaining], phi_next, sigma_next)).argmax())
        sequence.append(float(reports[best]))
        state = (float(phi_next[best]), float(sigma_next[best]))
    replayed = liar_weights(sequence, num_clients, tau)
    return sum(replayed) / len(replayed), estimate, sequence


def ceiling(num_clients: int, tau: float, span: float) -> float:
    """The most weight any one report can take beside steady honest clients (h = 0): h = gap / σ with σ at least
    min(σ_max, ι σ_min + (1 − ι) gap) (σ grows with the gap reported), largest at the widest gap, the span; and
    h ≤ h_max."""
    defaults = RPGAggregator()
    sigma = min(defaults.sigma_max, defaults.iota * defaults.sigma_min + (1 - defaults.iota) * span)
    gain = min(defaults.h_max, span / sigma)
    return 1 / (1 + (num_clients - 1) * math.exp(-gain / tau))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--taus", nargs="+", default=["2.5", "1.5", "anneal"],
                        help="temperatures held fixed, or 'anneal': the default schedule from round 0 (2.5 → 1.5)")
    parser.add_argument("--ranges", type=float, nargs="+", default=[1.0, 2.0],
                        help="R_max − R_min of the declared reward range (R_min = 0)")
    parser.add_argument("--horizons", type=int, nargs="+", default=[8, 200],
                        help="rounds over which the liar's best mean weight is searched (dynamic programming)")
    args = parser.parse_args()
    print("| reward range | N | τ | honest ω (1/N) | ceiling ω | liar's peak ω | low/high pattern mean ω (pattern) | "
          + " | ".join(f"best mean ω, {horizon} rounds (DP estimate)" for horizon in args.horizons) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(args.horizons))
    taus = [None if tau == "anneal" else float(tau) for tau in args.taus]
    for span, num_clients, tau in itertools.product(args.ranges, args.clients, taus):
        coldest = RPGAggregator().tau_min if tau is None else tau  # annealed: the ceiling of its late rounds
        top = peak(num_clients, tau, 0.0, span)
        mean, pattern = sustained(num_clients, tau, 0.0, span)
        best = [optimal_mean(num_clients, tau, span, horizon) for horizon in args.horizons]
        label = "anneal" if tau is None else f"{tau:g}"
        print(f"| [0, {span:g}] | {num_clients} | {label} | {1 / num_clients:.3f} | "
              f"{ceiling(num_clients, coldest, span):.3f} | {top:.3f} | {mean:.3f} ({pattern}) | "
              + " | ".join(f"{replayed:.3f} ({estimate:.3f})" for replayed, estimate, _ in best) + " |")


if __name__ == "__main__":
    main()
