"""Differential privacy of the federation, one concern a module: client-level DP with its accountant
(`client_level.ClientLevelPrivacy`, DP-FedAvg), adaptive clipping (`adaptive_clipping`), the server's side of
record-level DP (`record_level`; the clients' DP-SGD is `local.record_privacy`), the ledger every release is
appended to (`ledger`) and its reading (`release_ledger`); and the mechanism a config asks for
(`privacy_from_config`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .adaptive_clipping import AdaptiveClipping
from .client_level import ClientLevelPrivacy
from .ledger import append_ledger_line, load_dp_accounting
from .record_level import RECORD_EPSILON, RecordPrivacyReports
from .release_ledger import DamagedLedgerError

if TYPE_CHECKING:
    from ...config import FedGRPOConfig
    from ..base import Aggregator


def privacy_errors(aggregator: Aggregator) -> list[str]:
    """Why `aggregator` cannot run under DP: per-client state the mechanism neither clips nor noises (SCAFFOLD's
    controls), or a robust combiner, whose sensitivity is not ω_max C."""
    from ..base import Aggregator

    errors = []
    if type(aggregator).client_extras is not Aggregator.client_extras:
        errors.append(
            f"{type(aggregator).__name__} exchanges per-client state with the clients (SCAFFOLD's controls c and c_i) "
            "that the DP mechanism neither clips nor noises: use aggregation 'fedavg', 'fedprox' or 'rpg' with "
            "`dp_noise_multiplier`"
        )
    if aggregator.combiner is not None:
        errors.append(
            f"`robust_aggregation` ({type(aggregator.combiner).__name__}) replaces the weighted sum whose sensitivity "
            "the DP noise is calibrated to: set it to 'none' with `dp_noise_multiplier`"
        )
    return errors


def privacy_from_config(
    args: FedGRPOConfig,
    aggregator: Aggregator,
    num_clients: int,
    sample_size: int,
    clip_norm: float,
    reward_range: tuple[float, float] | None,
    frozen_keys: frozenset[str] = frozenset(),
    release_log: str | Path | None = None,
) -> ClientLevelPrivacy | None:
    """The mechanism `args` asks for (None without `dp_noise_multiplier`) around `aggregator`, for N = `num_clients`,
    m = `sample_size`, the absolute clip norm C (the first round's under `dp_adaptive_clipping`) and the reward
    functions' declared range; `ValueError` naming the
    setting for an aggregation it does not cover, or an RPG run whose rewards declare no range."""
    if args.dp_noise_multiplier is None:
        return None
    if errors := privacy_errors(aggregator):
        raise ValueError("; ".join(errors) + ".")
    if aggregator.weighs_by_reward and reward_range is None:
        raise ValueError(
            f"{type(aggregator).__name__} weighs clients by R̄, which DP releases through a Gaussian mechanism on the "
            "reward functions' declared range; they declare none: give every reward function a `reward_range`."
        )
    reward_noise = args.dp_reward_noise_multiplier
    count_stddev = args.dp_clipped_count_stddev
    if count_stddev is None:
        count_stddev = AdaptiveClipping.default_count_stddev(sample_size, args.dp_noise_multiplier)
    adaptive = None if not args.dp_adaptive_clipping else AdaptiveClipping(
        count_stddev, args.dp_target_quantile, args.dp_clip_norm_lr
    )
    return ClientLevelPrivacy(
        noise_multiplier=args.dp_noise_multiplier,
        clip_norm=clip_norm,
        num_clients=num_clients,
        sample_size=sample_size,
        reward_range=reward_range if aggregator.weighs_by_reward else None,
        reward_noise_multiplier=args.dp_noise_multiplier if reward_noise is None else reward_noise,
        target_delta=args.dp_target_delta,
        max_epsilon=args.dp_max_epsilon,
        noise_seed=args.dp_noise_seed,
        frozen_keys=frozen_keys,
        release_log=release_log,
        adaptive_clipping=adaptive,
    )


__all__ = [
    "RECORD_EPSILON",
    "AdaptiveClipping",
    "ClientLevelPrivacy",
    "DamagedLedgerError",
    "RecordPrivacyReports",
    "append_ledger_line",
    "load_dp_accounting",
    "privacy_errors",
    "privacy_from_config",
]
