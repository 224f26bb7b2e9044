"""FGRPO's server side: relative-performance-gain (RPG) weighting, Section 3.2.2 of the paper."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..choices import RPG_GAINS, choice_error
from .base import Aggregator
from .server_optim import ServerAdam, ServerOptimizer
from .update import ClientUpdate, RoundMetric, check_number

# |h| with `h_max=None`: far beyond any honest gain, far below where h / τ overflows a float for any τ_min ≥ 1e-290.
UNBOUNDED_GAIN_LIMIT = 1e12
NULL_PERMUTATIONS = 200  # permutations of each client's reports behind `gain_predictiveness_z`: its null's sd to ~5%


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

    `gain="noise-aware"` reads R̄'s own noise: R̄ is the mean of W step rewards, with standard error s_i
    (`Aggregator.reward_stderr`), and φ an EMA of earlier R̄, whose variance is λ_base / (2 − λ_base) s_i² for
    independent reports, so the gap g = R̄ − φ has standard error s_g = s_i √(2 / (2 − λ_base)). Then

        σ_i^{[t]} = clip(ι σ_i^{[t-1]} + (1 − ι) |g|, max(σ_min, s_g), max(σ_max, s_g))
        h_i^{[t]} = sign(g) max(|g| − κ s_g, 0) / (σ_i^{[t]} + ε)           (κ = `noise_threshold`)

    a gap within κ standard errors earns nothing (soft thresholding, the positive-part shrinkage of a noisy mean
    toward 0), and one beyond counts only its excess, in units no smaller than its own noise. The paper's gain reads
    a lucky window as progress, and the next window's regression to the mean pulls h's correlation with the next change
    of R̄ below 0 even where R̄ carries no information at all (see `gain_predictiveness_z` below: on the premise pilot
    the gains sat at or above that no-information value, never detectably below it; on the balanced benchmark's, the
    paper's gain on the window's R̄ read z −0.72 and −2.08, on a held-out R̄ +1.70 and +1.12). A client that sends no step
    rewards (or one) has s_i = 0: its gain is the paper's.

    A client whose step rewards all tie (every window's groups scored alike) also has s_i = 0 and takes the paper's
    gain: with no spread to measure, its R̄ counts as exact.

    Every round also measures how well the gains predict: the Pearson correlation, over the clients, between a
    client's h at its previous report and the change of its R̄ since (`gain_predictiveness`, None with fewer than 3
    such pairs or no spread), and the same over every pair of the run so far (`gain_predictiveness_run`). Its
    no-information value is not 0 but negative: h_{t−1} holds +R̄_{t−1} and the change R̄_t − R̄_{t−1} holds −R̄_{t−1},
    so for R̄ pure noise around a fixed level the paper's gain gives about
    −1/√(2(1 + λ_base/(2 − λ_base))) = −0.55 (λ_base 0.8). `gain_predictiveness_z` reads the run's statistic against
    that null, measured on the run's own reports: each client's reports (R̄ with its standard error) are permuted over
    its rounds `NULL_PERMUTATIONS` times, the gains recomputed by the same equations, and the pooled correlation taken
    each time; z = (observed − the null's mean) / its standard deviation (`gain_predictiveness_null`: that mean).
    Shuffling keeps every client's level and spread and removes any order in time, which is the information a gain
    would carry about the next change: z ≈ 0 says the weights carried none detectable, z > 2 that they did.
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
        gain: str = "paper",
        noise_threshold: float = 1.0,
    ):
        super().__init__(server_optimizer if server_optimizer is not None else ServerAdam(), combiner)
        for message in self.setting_errors(
            lambda_base, iota, sigma_min, sigma_max, tau_min, tau_max, lambda_anneal, eps, h_max, gain, noise_threshold
        ):
            raise ValueError(message)
        self.lambda_base, self.iota, self.eps, self.h_max = lambda_base, iota, eps, h_max
        self.sigma_min, self.sigma_max = sigma_min, sigma_max
        self.tau_min, self.tau_max, self.lambda_anneal = tau_min, tau_max, lambda_anneal
        self.gain, self.noise_threshold = gain, noise_threshold
        self.baselines: dict[str, float] = {}  # φ_i, per client
        self.volatilities: dict[str, float] = {}  # σ_i, per client
        self.last_reports: dict[str, tuple[float, float]] = {}  # (h_i, R̄_i) of each client's last report
        self.prediction_sums = PredictionSums()  # every (h at a report, change of R̄ by the next) of the run
        self.last_gains: dict[str, float] = {}
        self.last_temperature: float | None = None
        self.last_predictiveness: float | None = None
        # Every report's (R̄, the gap's standard error) per client, in order: the permutation null's material.
        self.report_history: dict[str, list[tuple[float, float]]] = {}
        self.last_z: float | None = None
        self.last_null: float | None = None

    @staticmethod
    def setting_errors(
        lambda_base, iota, sigma_min, sigma_max, tau_min, tau_max, lambda_anneal, eps, h_max, gain, noise_threshold
    ) -> Iterator[str]:
        """One message per RPG setting out of its range, named as `FedGRPOConfig`'s `rpg_*` field: the one rule for
        this class's arguments and the config's fields (`config_errors`)."""
        for name, value in (("rpg_lambda_base", lambda_base), ("rpg_iota", iota)):
            if not 0 < value <= 1:
                yield f"`{name}` must lie in (0, 1], got {value}."
        for name, value in (("rpg_sigma_min", sigma_min), ("rpg_tau_min", tau_min), ("rpg_eps", eps)):
            if not value > 0:
                yield f"`{name}` must be > 0, got {value}."
        if sigma_min > sigma_max:
            yield f"`rpg_sigma_min` ({sigma_min}) must not exceed `rpg_sigma_max` ({sigma_max})."
        if tau_min > tau_max:
            yield f"`rpg_tau_min` ({tau_min}) must not exceed `rpg_tau_max` ({tau_max})."
        if lambda_anneal < 0:
            yield f"`rpg_lambda_anneal` must be >= 0, got {lambda_anneal}."
        if h_max is not None and not h_max > 0:
            yield f"`rpg_h_max` must be > 0 or None, got {h_max}."
        if message := choice_error("rpg_gain", gain, RPG_GAINS):
            yield message
        if not noise_threshold >= 0:
            yield f"`rpg_noise_threshold` must be >= 0, got {noise_threshold}."

    @classmethod
    def config_errors(cls, args) -> Iterable[str]:
        """The config's `rpg_*` fields out of their ranges (`setting_errors`)."""
        return cls.setting_errors(
            args.rpg_lambda_base, args.rpg_iota, args.rpg_sigma_min, args.rpg_sigma_max, args.rpg_tau_min,
            args.rpg_tau_max, args.rpg_lambda_anneal, args.rpg_eps, args.rpg_h_max, args.rpg_gain,
            args.rpg_noise_threshold,
        )

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
            gain=args.rpg_gain,
            noise_threshold=args.rpg_noise_threshold,
        )

    def temperature(self, round_idx: int) -> float:
        """τ^{[t]}: from τ_max at t = 0 down towards τ_min."""
        return self.tau_min + (self.tau_max - self.tau_min) * math.exp(-self.lambda_anneal * round_idx)

    def client_weights(self, updates: list[ClientUpdate], round_idx: int) -> list[float]:
        for update in updates:
            check_number(update.reward, f"RPG: client {update.client_id!r}'s reward")
        gains, round_sums = [], PredictionSums()
        for update in updates:
            reward = float(update.reward)
            previous_baseline = self.baselines.get(update.client_id, reward)
            previous_volatility = self.volatilities.get(update.client_id, self.sigma_min)
            # the gap's standard error (noise-aware gain only): R̄'s and its EMA baseline's, taken independent
            gap_stderr = 0.0
            if self.gain == "noise-aware":
                gap_stderr = (self.reward_stderr(update) or 0.0) * math.sqrt(2 / (2 - self.lambda_base))
            gain, volatility = map(float, self.gain_step(previous_baseline, previous_volatility, reward, gap_stderr))
            self.report_history.setdefault(update.client_id, []).append((reward, gap_stderr))
            if update.client_id in self.last_reports:
                previous_gain, previous_reward = self.last_reports[update.client_id]
                round_sums.add(previous_gain, reward - previous_reward)
            self.last_reports[update.client_id] = (gain, reward)
            self.baselines[update.client_id] = self.lambda_base * reward + (1 - self.lambda_base) * previous_baseline
            self.volatilities[update.client_id] = volatility
            gains.append(gain)

        temperature = self.temperature(round_idx)
        weights = torch.softmax(torch.tensor(gains, dtype=torch.float64) / temperature, dim=0).tolist()
        self.last_gains = {update.client_id: gain for update, gain in zip(updates, gains)}
        self.last_temperature = temperature
        self.last_predictiveness = round_sums.correlation()
        self.prediction_sums.merge(round_sums)
        self.last_z, self.last_null = self.predictiveness_z()
        return weights

    def gain_step(self, baseline, volatility, reward, gap_stderr):
        """Eq. rpg for one report, from the client's previous φ and σ: (h, σ). Numbers or numpy arrays alike (the
        null of `predictiveness_z` runs many reports at once through the same equations)."""
        with np.errstate(over="ignore", invalid="ignore"):
            gap = np.subtract(reward, baseline)
            floor, ceiling = np.maximum(self.sigma_min, gap_stderr), np.maximum(self.sigma_max, gap_stderr)
            volatility = np.minimum(np.maximum(self.iota * volatility + (1 - self.iota) * np.abs(gap), floor), ceiling)
            shrunk = np.copysign(np.maximum(np.abs(gap) - self.noise_threshold * gap_stderr, 0.0), gap)
            signal = np.where(np.asarray(gap_stderr) > 0, shrunk, gap)
            # R̄ far apart in a float's range (±1e308) makes the gap, and so h, infinite: held to a finite bound, the
            # softmax stays finite (its largest h takes the weight) whatever finite R̄ a client reports.
            bound = self.h_max if self.h_max is not None else UNBOUNDED_GAIN_LIMIT
            return np.clip(signal / (volatility + self.eps), -bound, bound), volatility

    def predictiveness_null(self, permutations: int = NULL_PERMUTATIONS) -> tuple[float, float] | None:
        """The mean and standard deviation of `gain_predictiveness_run` with each client's reports permuted over its
        rounds (`permutations` draws, seeded by the number of reports, so a resumed run recomputes the same); None
        without 3 pairs or without spread."""
        rng = np.random.default_rng(sum(map(len, self.report_history.values())))
        sums = np.zeros((6, permutations))  # count, Σx, Σy, Σxx, Σyy, Σxy per permutation
        # R̄ far apart in a float's range overflows the sums: that null is NaN, and so None, as the statistic itself.
        with np.errstate(over="ignore", invalid="ignore"):
            for reports in self.report_history.values():
                if len(reports) < 2:
                    continue
                order = rng.permuted(np.tile(np.arange(len(reports)), (permutations, 1)), axis=1)
                rewards, stderrs = (np.asarray(column)[order] for column in zip(*reports))
                baseline, volatility = rewards[:, 0], np.full(permutations, self.sigma_min)
                previous_gain = None
                for step in range(len(reports)):
                    gain, volatility = self.gain_step(baseline, volatility, rewards[:, step], stderrs[:, step])
                    if previous_gain is not None:
                        x, y = previous_gain, rewards[:, step] - rewards[:, step - 1]
                        sums += np.stack([np.ones(permutations), x, y, x * x, y * y, x * y])
                    previous_gain = gain
                    baseline = self.lambda_base * rewards[:, step] + (1 - self.lambda_base) * baseline
        correlations = [PredictionSums(*column).correlation() for column in sums.T]
        correlations = [value for value in correlations if value is not None]
        if len(correlations) < 2 or not np.std(correlations) > 0:
            return None
        return float(np.mean(correlations)), float(np.std(correlations, ddof=1))

    def predictiveness_z(self) -> tuple[float | None, float | None]:
        """(`gain_predictiveness_run` in standard deviations from its permutation null, the null's mean); Nones where
        either is undefined."""
        observed = self.prediction_sums.correlation()
        # A run resumed from a checkpoint written before reports were kept has sums over pairs it cannot permute.
        pairs = sum(max(len(reports) - 1, 0) for reports in self.report_history.values())
        null = self.predictiveness_null() if pairs == self.prediction_sums.count else None
        if observed is None or null is None:
            return None, None if null is None else null[0]
        return (observed - null[0]) / null[1], null[0]

    def round_metrics(self) -> list[RoundMetric]:
        """Each client's gain h_i^{[t]} (`rpg_gain` in the round log) and the temperature τ^{[t]} of the last round,
        then the metrics every aggregator reports (under DP: ε, the noise and R̃)."""
        return [
            RoundMetric("gains", "h", dict(self.last_gains), per_client=True, format="+.4f", log_name="rpg_gain",
                        legend="RPG's gain of the client: its R̄ over its own EMA baseline φ, in units of σ (`gains`)"),
            RoundMetric("temperature", "τ", self.last_temperature, format=".3f",
                        legend="the round's softmax temperature: ω = softmax(h / τ) (`temperature`)"),
            RoundMetric("gain_predictiveness", "corr(h, next ΔR̄)", self.last_predictiveness, format="+.3f",
                        legend="over the clients, the correlation of each one's h at its previous report with the "
                        "change of its R̄ since: positive when RPG's gain predicts progress ('-' with fewer than 3 "
                        "clients to compare; `gain_predictiveness`)"),
            RoundMetric("gain_predictiveness_run", "over the run", self.prediction_sums.correlation(),
                        format="+.3f", legend="the same correlation over every pair of the run so far "
                        "(`gain_predictiveness_run`); its no-information value is about -0.5, not 0"),
            RoundMetric("gain_predictiveness_null", "no-information value", self.last_null, format="+.3f",
                        legend="the mean of that correlation with each client's R̄ permuted over its rounds "
                        "(`gain_predictiveness_null`)"),
            RoundMetric("gain_predictiveness_z", "z vs no information", self.last_z, format="+.2f",
                        legend="the run's correlation in standard deviations from that null: above 2, RPG's weights "
                        "carried information (`gain_predictiveness_z`)"),
            *super().round_metrics(),
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "baselines": dict(self.baselines),
            "volatilities": dict(self.volatilities),
            "last_gains_rewards": {key: list(value) for key, value in self.last_reports.items()},
            "prediction_sums": self.prediction_sums.as_list(),
            "report_history": {key: [list(report) for report in value] for key, value in self.report_history.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.baselines = {key: float(value) for key, value in state["baselines"].items()}
        self.volatilities = {key: float(value) for key, value in state["volatilities"].items()}
        # A checkpoint written before the predictiveness was measured starts its sums afresh.
        self.last_reports = {
            key: (float(gain), float(reward)) for key, (gain, reward) in state.get("last_gains_rewards", {}).items()
        }
        self.prediction_sums = PredictionSums(*state.get("prediction_sums", ()))
        # Before the null was measured no history was kept: z stays None for such a run, whose sums are partial.
        self.report_history = {
            key: [(float(reward), float(stderr)) for reward, stderr in value]
            for key, value in state.get("report_history", {}).items()
        }


class PredictionSums:
    """Running sums of pairs (x, y) = (h at a report, the change of R̄ by the client's next report): their Pearson
    correlation without keeping the pairs."""

    def __init__(self, count: float = 0, x: float = 0.0, y: float = 0.0, xx: float = 0.0, yy: float = 0.0,
                 xy: float = 0.0):
        self.count, self.x, self.y, self.xx, self.yy, self.xy = count, x, y, xx, yy, xy

    def add(self, x: float, y: float) -> None:
        self.count += 1
        self.x, self.y = self.x + x, self.y + y
        self.xx, self.yy, self.xy = self.xx + x * x, self.yy + y * y, self.xy + x * y

    def merge(self, other: PredictionSums) -> None:
        for name, value in zip(("count", "x", "y", "xx", "yy", "xy"), other.as_list()):
            setattr(self, name, getattr(self, name) + value)

    def as_list(self) -> list[float]:
        return [self.count, self.x, self.y, self.xx, self.yy, self.xy]

    def correlation(self) -> float | None:
        """Pearson's r of the pairs; None with fewer than 3 pairs or without spread in either."""
        if self.count < 3:
            return None
        sxx = self.xx - self.x * self.x / self.count
        syy = self.yy - self.y * self.y / self.count
        if not (sxx > 1e-12 and syy > 1e-12):
            return None
        return max(-1.0, min(1.0, (self.xy - self.x * self.y / self.count) / math.sqrt(sxx * syy)))
