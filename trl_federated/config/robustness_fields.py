"""The robustness fields of `FedGRPOConfig` (`RobustnessFields`, a field mixin of it), each documented beside its
declaration: what the server bounds in every client update (`core.admission.UpdateGate`) and how it combines them
(`aggregation.robust`); `checks.ConfigChecks._robustness_errors` checks them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..choices import NORM_ACTIONS, ROBUST_AGGREGATIONS
from .results import ResultHelp


@dataclass
class RobustnessFields:
    r"""
    The robustness fields of [`FedGRPOConfig`]: what the server bounds in every client update, how it combines them.

    Parameters:
        > Robustness: what the server bounds in every client update, and how it combines them

        update_norm_bound (`float` or `None`, *optional*, defaults to `10.0`):
            Bound on each client's update norm ‖θ_i − θ‖, in units of U = `local_steps` × `learning_rate` × √d, d
            the adapter's number of coordinates: the norm of E steps that each move every coordinate by the learning
            rate. An Adam-family local optimizer (TRL's default) moves a coordinate by about lr per step or less (at
            most (1 − β1) / √(1 − β2), about 3.2, under extreme gradient sparsity), so honest updates stay near or
            below 1 U; the default leaves a wide margin. Under SCAFFOLD the correction the server sends a client is
            allowed on top (`local_steps` × `learning_rate` × ‖c − c_i‖), and the control the server keeps for a
            client, ‖c_i + Δc_i‖, is bounded by the same number in units of √d, so every c_i and c stay within it
            over the whole run. Set it explicitly for a non-Adam local optimizer. `None`: no bound.
        update_norm_action (`str`, *optional*, defaults to `"reject"`):
            What happens to an update over `update_norm_bound`: `"reject"` drops it from the round (an invalid
            update), `"clip"` scales θ_i − θ back onto the bound.
        robust_aggregation (`str`, *optional*, defaults to `"none"`):
            Coordinate-wise robust combination of the clients' adapters, for every method: `"none"` (the weighted
            mean Σ_i w_i θ_i), `"trimmed_mean"` (per coordinate, drop the `robust_trim_fraction` largest and smallest
            client values, then the plain mean of the rest, as Flower's FedTrimmedAvg) or `"median"` (the
            coordinate-wise median, as Flower's FedMedian). Every robust combiner averages with equal weights, never
            the method's (RPG's follow each client's own R̄).
        robust_num_malicious (`int`, *optional*, defaults to `1`):
            f, the arbitrary clients `"krum"`, `"multi_krum"` and `"bulyan"` tolerate: they need `min_clients_per_round`
            of at least 2f + 3 (Krum, Multi-Krum; Blanchard et al., 2017) or 4f + 3 (Bulyan; El Mhamdi et al., 2018).
        robust_num_selected (`int` or `None`, *optional*):
            m, the clients `"multi_krum"` keeps and averages with equal weights; `None` keeps n − f. At most
            `min_clients_per_round` − f, and never more than n − f in a round of n clients.
        robust_trim_fraction (`float`, *optional*, defaults to `0.2`):
            Fraction of clients trimmed at each end by `robust_aggregation="trimmed_mean"`, in (0, 0.5): the floor of
            the fraction × the number of clients that reported, as Flower's FedTrimmedAvg, but at least one (so
            `min_clients_per_round` must be 3 or more).
        max_client_samples (`int` or `None`, *optional*, defaults to `1000000`):
            Cap on a client's self-reported number of training rows (FedAvg's and SCAFFOLD's weights), used only
            where the server does not know the count itself (the runner always does; a Flower deployment does for
            clients registered with `num-samples`). `None`: no cap.
    """

    update_norm_bound: float | None = field(
        default=10.0,
        metadata={
            "help": ResultHelp(
                "Bound on each client's update norm ||θ_i − θ||, in units of local_steps x learning_rate x sqrt(d) "
                "(d: the adapter's coordinates), near which honest Adam-family updates stay (SCAFFOLD: plus the "
                "correction the server sent); also bounds the control SCAFFOLD keeps for a client, ||c_i + Δc_i||, "
                "in units of sqrt(d). Set it for a non-Adam local optimizer. None: no bound."
            )
        },
    )
    update_norm_action: str = field(
        default="reject",
        metadata={
            "help": ResultHelp(
                "What happens to an update over `update_norm_bound`: 'reject' drops it from the round, 'clip' scales "
                "θ_i − θ back onto the bound."
            ),
            "choices": list(NORM_ACTIONS),
        },
    )
    robust_aggregation: str = field(
        default="none",
        metadata={
            "help": ResultHelp(
                "Robust combination of the clients' adapters, for every method: 'none' (the weighted mean), "
                "'trimmed_mean' (drop the `robust_trim_fraction` extremes per coordinate, then the weighted mean), "
                "'median' (unweighted, as Flower's FedMedian), 'krum' / 'multi_krum' (the client(s) closest to their "
                "n − f − 2 neighbours) or 'bulyan' (recursive Krum, then a trimmed mean around the median), as "
                "Flower's strategies of those names, tolerating `robust_num_malicious` clients."
            ),
            "choices": ROBUST_AGGREGATIONS,  # the registry itself
        },
    )
    robust_trim_fraction: float = field(
        default=0.2,
        metadata={
            "help": ResultHelp(
                "Fraction of the reporting clients trimmed at each end by robust_aggregation='trimmed_mean' "
                "(rounded down, as Flower's FedTrimmedAvg, but at least one: min_clients_per_round must be 3 or "
                "more), in (0, 0.5)."
            )
        },
    )
    robust_num_malicious: int = field(
        default=1,
        metadata={"help": ResultHelp("f, the arbitrary clients Krum, Multi-Krum and Bulyan tolerate: they need "
                                     "min_clients_per_round of 2f + 3 (Krum) or 4f + 3 (Bulyan).")},
    )
    robust_num_selected: int | None = field(
        default=None,
        metadata={"help": ResultHelp(
            "m, the clients Multi-Krum keeps and averages (at most min_clients_per_round − f); None keeps n − f."
        )},
    )
    max_client_samples: int | None = field(
        default=1_000_000,
        metadata={
            "help": ResultHelp(
                "Cap on a client's self-reported number of training rows (FedAvg's and SCAFFOLD's weights), where "
                "the server does not know the count itself. None: no cap."
            )
        },
    )
