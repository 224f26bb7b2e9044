"""The server's side of record-level DP, which the clients run (`local.record_privacy`): the ε each reports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..update import RoundMetric

if TYPE_CHECKING:
    from ..update import ClientUpdate


# The metric under which a client reports ε of its records under record-level DP (`local.record_privacy`); not
# `dp_...`, the prefix of the server's own privacy metrics, which no client may send (`callbacks.is_reserved_metric`).
RECORD_EPSILON = "record_epsilon"


class RecordPrivacyReports:
    """The server's side of record-level DP, which the clients run (`local.record_privacy`): the largest ε each client
    reported for its records (a client's own account: the server cannot check it; the gate refuses an update without a
    finite ε ≥ 0, `admission.check_record_epsilon`), and the worst, which the run reports every round
    (`dp_record_epsilon_worst`)."""

    def __init__(self, target_delta: float, clip_norm: float):
        self.target_delta, self.clip_norm = target_delta, clip_norm
        self.epsilons: dict[str, float] = {}

    def observe(self, updates: list[ClientUpdate]) -> None:
        for update in updates:
            if RECORD_EPSILON in update.metrics:  # a client's ε only grows: a lower report does not lower it
                epsilon = float(update.metrics[RECORD_EPSILON])
                self.epsilons[update.client_id] = max(epsilon, self.epsilons.get(update.client_id, epsilon))

    def round_metrics(self) -> list[RoundMetric]:
        worst = max(self.epsilons.values(), default=None)
        return [RoundMetric("dp_record_epsilon_worst", "worst ε_rec", worst, format=".3f")]

    def describe(self) -> str:
        """One line on the guarantee the clients reported, for the model card."""
        worst = max(self.epsilons.values(), default=None)
        epsilon = "no client reported yet" if worst is None else f"worst ε reported by a client = {worst:.3f}"
        return (f"record-level (DP-SGD in each client's local steps, a record one prompt with its completions, clip "
                f"norm {self.clip_norm:g}), {epsilon} at δ = {self.target_delta:g} (replace-one, each client's own RDP "
                "accountant of dp-accounting, its prompts sampled without replacement)")

    def state_dict(self) -> dict[str, Any]:
        return {"epsilons": dict(self.epsilons)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epsilons = {str(key): float(value) for key, value in state["epsilons"].items()}
