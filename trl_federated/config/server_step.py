"""The server step a configuration that leaves it unset takes: `server_optimizer` from `aggregation`, its learning
rate (`derived_server_learning_rate`) and ε, resolved once per run (`ServerStep.resolve_server_step`); a resumed run
takes its checkpoint's instead (`core.run_identity.keep_server_step`)."""

from __future__ import annotations

from ..choices import AGGREGATIONS, SERVER_OPTIMIZERS

# Server Adam's learning rate when `server_learning_rate` is unset: α = SERVER_ADAM_SCALE × E × lr, E the local steps
# and lr the local (peak) learning rate (`derived_server_learning_rate`). SGD's is 1: the weighted average.
SERVER_ADAM_SCALE = 0.5


PAPER_SERVER_EPSILON = 1e-8  # the paper's server Adam ε (Algorithm 1)


# The server step's fields that None derives (`FedGRPOConfig.resolve_server_step`).
SERVER_STEP_FIELDS = ("server_optimizer", "server_learning_rate", "server_epsilon")



class ServerStep:
    """The server-step derivation of `FedGRPOConfig` (a mixin of it: the methods read and set the config's fields)."""

    def resolve_server_step(self, server_optimizer: str | None = None) -> None:
        """Fill the server-step fields left unset (`derived_server_fields`) as their help says: `server_optimizer`
        from `aggregation` (or `server_optimizer` given here: a resumed run's checkpoint), its learning rate
        (`derived_server_learning_rate`) and its ε (the paper's 1e-8 for the Adam steps, FedAdam's derived τ)."""
        if server_optimizer is not None:
            self.server_optimizer = server_optimizer
        elif "server_optimizer" in self.derived_server_fields and self.aggregation in AGGREGATIONS:
            self.server_optimizer = AGGREGATIONS[self.aggregation].server_optimizer  # the method's own
        if "server_learning_rate" in self.derived_server_fields and self.server_optimizer in SERVER_OPTIMIZERS:
            self.server_learning_rate = self.derived_server_learning_rate()
        if "server_epsilon" in self.derived_server_fields:  # the step's own (`ServerOptimizer.default_epsilon`)
            self.server_epsilon = getattr(SERVER_OPTIMIZERS.get(self.server_optimizer), "default_epsilon", None)


    def server_field_origin(self, name: str) -> str:
        """How the logs say where a server-step field's value came from: "derived" when it was left unset
        (`resolve_server_step`), else "set"."""
        return "derived" if name in self.derived_server_fields else "set"


    def derived_server_learning_rate(self) -> float:
        """The server learning rate a config that leaves `server_learning_rate` unset takes (see its help):
        `SERVER_ADAM_SCALE` × `local_steps` × `learning_rate` for the paper's server Adam, the step's own
        `default_learning_rate` for the others: dimensionless multiples of the clients' change, 1 for the steps scaled
        to Δ (FedAvg's length in their first round), DiLoCo's 0.7 for Nesterov."""
        if self.server_optimizer != "adam":
            return SERVER_OPTIMIZERS[self.server_optimizer].default_learning_rate
        return float(f"{SERVER_ADAM_SCALE * self.local_steps * self.learning_rate:.6g}")  # 5e-05, not 4.9999e-05
