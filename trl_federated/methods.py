"""The federated methods the paper compares, each described once: its name in `trl-federated compare`, its name in the
paper and on the model card, and the configuration that makes it (aggregation, server optimizer, local algorithm).

The paper's Table 3 pairs each RPG method with its "w/o RPG" ablation, the same method with FedAvg's data-volume
weights in place of RPG's; `ABLATIONS` derives the pairs from `METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .choices import AGGREGATIONS


@dataclass(frozen=True)
class Method:
    """A named method: the `FedGRPOConfig` values that make it of a shared base configuration."""

    name: str  # `trl-federated compare --methods` and the grid's cell folders
    display_name: str  # the paper's name, on the model card and in Table 3
    aggregation: str  # `FedGRPOConfig.aggregation`
    server_optimizer: str  # `FedGRPOConfig.server_optimizer`
    algorithm: str = "grpo"  # the local algorithm, `trl-federated run --algorithm` (a key of `config.CONFIG_CLASSES`)
    settings: tuple[tuple[str, str], ...] = ()  # any other `FedGRPOConfig` field the method sets, as (name, value)

    def overrides(self) -> dict[str, str]:
        """The `trl-federated run` settings that make this method of a base config. GRPO, the command line's default
        algorithm, is not passed, so a GRPO method leaves the base config's `algorithm` as it is."""
        algorithm = {} if self.algorithm == "grpo" else {"algorithm": self.algorithm}
        return {**algorithm, "aggregation": self.aggregation, "server_optimizer": self.server_optimizer,
                **dict(self.settings)}


# FGRPO's server step when `server_optimizer` is unset (`choices.AGGREGATIONS`): the RPG-weighted
# mean. With it, "FGRPO w/o RPG" (the same step with FedAvg's weights) is FedAvg itself. Read as declared, so that
# importing this table (`trl-federated compare --help`) imports neither the aggregation package nor torch.
FGRPO_STEP = AGGREGATIONS.declared("rpg").server_optimizer

METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method("fgrpo", "FGRPO", "rpg", FGRPO_STEP),
        # RPG's gain soft-thresholded at R̄'s standard error (`aggregation.rpg`, `rpg_gain`)
        Method("fgrpo-noise-aware", "FGRPO (noise-aware RPG)", "rpg", FGRPO_STEP,
               settings=(("rpg_gain", "noise-aware"),)),
        # RPG's gain read on R̄ measured greedily on a fixed held-out slice of each client's items (`rpg_signal`)
        Method("fgrpo-held-out", "FGRPO (held-out R̄)", "rpg", FGRPO_STEP, settings=(("rpg_signal", "held-out"),)),
        # The paper's literal step, Adam with ε = 1e-8 and no bias correction, and its ablation.
        Method("fgrpo-paper", "FGRPO (paper's Adam step)", "rpg", "adam"),
        Method("fgrpo-paper-wo-rpg", "FGRPO (paper's Adam step) w/o RPG", "fedavg", "adam"),
        # FGRPO's RPG weights with another server step (`server_optim`), the designs `benchmarks/server_step.py`
        # compares; `fgrpo-sgd` names FGRPO's own step there.
        Method("fgrpo-fedadam", "FGRPO (FedAdam step)", "rpg", "fedadam"),
        Method("fgrpo-adam-norm", "FGRPO (norm-matched Adam step)", "rpg", "adam-norm"),
        Method("fgrpo-nesterov", "FGRPO (Nesterov step)", "rpg", "nesterov"),
        Method("fgrpo-sgd", "FGRPO (server SGD)", "rpg", "sgd"),
        Method("fedavg", "FedAvg", "fedavg", "sgd"),
        Method("fedprox", "FedProx", "fedprox", "sgd"),
        Method("scaffold", "SCAFFOLD", "scaffold", "sgd"),
        Method("fdapo", "FDAPO", "rpg", FGRPO_STEP, algorithm="dapo"),
        Method("fdapo-wo-rpg", "FDAPO w/o RPG", "fedavg", FGRPO_STEP, algorithm="dapo"),
        Method("fgspo", "FGSPO", "rpg", FGRPO_STEP, algorithm="gspo"),
        Method("fgspo-wo-rpg", "FGSPO w/o RPG", "fedavg", FGRPO_STEP, algorithm="gspo"),
    )
}

# Table 3: each RPG method's display name -> (its name, its "w/o RPG" ablation's name), the ablation being the method
# with the same local algorithm and server optimizer and FedAvg's weights.
ABLATIONS: dict[str, tuple[str, str]] = {
    method.display_name: (method.name, ablation.name)
    for method in METHODS.values()
    if method.aggregation == "rpg"
    for ablation in METHODS.values()
    if (ablation.aggregation, ablation.server_optimizer, ablation.algorithm)
    == ("fedavg", method.server_optimizer, method.algorithm)
}
