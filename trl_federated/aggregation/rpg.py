"""FGRPO's server side: relative-performance-gain (RPG) weighting, Section 3.2.2 of the paper."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import rpg_errors
from .base import Aggregator, ClientUpdate, RoundMetric, check_number
from .server_optim import ServerAdam, ServerOptimizer

# |h| with `h_max=None`: far beyond any honest gain, far below where h / τ overflows a float for any τ_min ≥ 1e-290.
UNBOUNDED_GAIN_LIMIT = 1e12


class RPGAggregator(Aggregator):
    """Weights every reporting client i by how much its reward beats its own history:

        σ_i^{[t]} = clip(ι σ_i^{[t-1]} + (1 − ι) |R̄_i^{[t]} − φ_i^{[t-1]}|, σ_min, σ_max)
        h_i^{[t]} = (R̄_i^{[t]} − φ_i^{[t-1]}) / (σ_i^{[t]} + ε)                          (Eq. rpg)
        φ_i^{[t]} = λ_base R̄_i^{[t]} + (1 − λ_base) φ_i^{[t-1]}                          (Eq. ema)
        τ^{[t]}   = τ_min + (τ_max − τ_min) exp(−λ_anneal t)
        ω_i^{[t]} = exp(h_i^{[t]} / τ^{[t]}) / Σ_{i'} exp(h_{i'}^{[t]} / τ^{[t]})        (Eq. weight)

    then Δ = Σ_i ω_i (θ_i − θ) (Eq. model_diff) goes through `server_optimizer`, by default the paper's Adam
    without bias correction (Eqs. momentum, model_update).

    Conventions the paper leaves open:
    - a client's first report sets φ^{[t-1]} to its own R̄ (so h = 0 in Eq. rpg) and σ^{[t-1]} to σ_min, in whichever
      round t it comes (with client sampling, `fraction_train` < 1, a client may first train in any round);
    - t is the 0-based round index of the federation, so τ^{[0]} = τ_max and the annealing follows the rounds, not
      how often a client took part;
    - the softmax (Eq. weight) runs over the clients that reported this round; a client that did not report (not
      sampled, or dropped) keeps its φ, σ bit for bit: Eq. ema is applied once per report, never decayed in a round
      the client sat out, so φ^{[t-1]} in Eq. rpg is the baseline of its last report;
    - `h_max` clips h to [−h_max, h_max], the bound of the paper's Assumption 5, so a client that inflates its
      self-reported reward gains at most a factor exp(2 h_max / τ) in weight. The default 10 is never reached by an
      honest client with the default ι, σ_max and rewards spanning at most 2: below σ_max, σ ≥ (1 − ι)|gap| gives
      |h| ≤ 1 / (1 − ι) = 10; at σ_max, |h| ≤ |gap| / σ_max ≤ 2 / 0.2. None leaves h unbounded.
    """

    weighs_by_reward = True

    def __init__(
        self,
        lambda_base: float = 0.8,
        iota: float = 0.9,
        sigma_min: float = 0.05,
        sigma_max: float = 0.2,
        tau_min: float = 1.5,
        tau_max: float = 2.5,
        lambda_anneal: float = 0.1,
        eps: float = 1e-8,
        h_max: float | None = 10.0,
        server_optimizer: ServerOptimizer | None = None,
        combiner=None,
    ):
        super().__init__(server_optimizer if server_optimizer is not None else ServerAdam(), combiner)
        for message in rpg_errors(
            lambda_base, iota, sigma_min, sigma_max, tau_min, tau_max, lambda_anneal, eps, h_max
        ):
            raise ValueError(message)
        self.lambda_base, self.iota, self.eps, self.h_max = lambda_base, iota, eps, h_max
        self.sigma_min, self.sigma_max = sigma_min, sigma_max
        self.tau_min, self.tau_max, self.lambda_anneal = tau_min, tau_max, lambda_anneal
        self.baselines: dict[str, float] = {}  # φ_i, per client
        self.volatilities: dict[str, float] = {}  # σ_i, per client
        self.last_gains: dict[str, float] = {}
        self.last_temperature: float | None = None

    @classmethod
    def from_config(cls, args, num_clients, server_optimizer, combiner=None) -> RPGAggregator:
        """RPG with the config's `rpg_*` settings."""
        return cls(
            lambda_base=args.rpg_lambda_base,
            iota=args.rpg_iota,
            sigma_min=args.rpg_sigma_min,
            sigma_max=args.rpg_sigma_max,
            tau_min=args.rpg_tau_min,
            tau_max=args.rpg_tau_max,
            lambda_anneal=args.rpg_lambda_anneal,
            eps=args.rpg_eps,
            h_max=args.rpg_h_max,
            server_optimizer=server_optimizer,
            combiner=combiner,
        )

    def temperature(self, round_idx: int) -> float:
        """τ^{[t]}: from τ_max at t = 0 down towards τ_min."""
        return self.tau_min + (self.tau_max - self.tau_min) * math.exp(-self.lambda_anneal * round_idx)

    def client_weights(self, updates: list[ClientUpdate], round_idx: int) -> list[float]:
        for update in updates:
            check_number(update.reward, f"RPG: client {update.client_id!r}'s reward")
        gains = []
        for update in updates:
            reward = float(update.reward)
            previous_baseline = self.baselines.get(update.client_id, reward)
            previous_volatility = self.volatilities.get(update.client_id, self.sigma_min)
            gap = reward - previous_baseline
            volatility = min(
                max(self.iota * previous_volatility + (1 - self.iota) * abs(gap), self.sigma_min), self.sigma_max
            )
            gain = gap / (volatility + self.eps)
            # R̄ far apart in a float's range (±1e308) makes the gap, and so h, infinite: held to a finite bound, the
            # softmax stays finite (its largest h takes the weight) whatever finite R̄ a client reports.
            bound = self.h_max if self.h_max is not None else UNBOUNDED_GAIN_LIMIT
            gain = min(max(gain, -bound), bound)
            self.baselines[update.client_id] = self.lambda_base * reward + (1 - self.lambda_base) * previous_baseline
            self.volatilities[update.client_id] = volatility
            gains.append(gain)

        temperature = self.temperature(round_idx)
        weights = torch.softmax(torch.tensor(gains, dtype=torch.float64) / temperature, dim=0).tolist()
        self.last_gains = {update.client_id: gain for update, gain in zip(updates, gains)}
        self.last_temperature = temperature
        return weights

    def round_metrics(self) -> list[RoundMetric]:
        """Each client's gain h_i^{[t]} (`rpg_gain` in the round log) and the temperature τ^{[t]} of the last round,
        then the metrics every aggregator reports (under DP: ε, the noise and R̃)."""
        return [
            RoundMetric("gains", "h", dict(self.last_gains), per_client=True, format="+.4f", log_name="rpg_gain"),
            RoundMetric("temperature", "τ", self.last_temperature, format=".3f"),
            *super().round_metrics(),
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "baselines": dict(self.baselines),
            "volatilities": dict(self.volatilities),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.baselines = {key: float(value) for key, value in state["baselines"].items()}
        self.volatilities = {key: float(value) for key, value in state["volatilities"].items()}
