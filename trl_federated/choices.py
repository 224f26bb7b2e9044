"""The values the configuration's choice fields take, declared once: `FedGRPOConfig` validates its fields against
them and the modules that implement each choice build from the same names. A leaf: it imports nothing of the
package, so the configuration imports no implementation to know its own choices."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


class Registry(dict):
    """The names of one kind that a configuration may give (`aggregation`, `server_optimizer`), each with what
    implements it: one registry per kind of name, filled by one registration line per name in the package that
    implements it (`aggregation.register_aggregation`, `aggregation.register_server_optimizer`). The config's checks
    and the command line's choices read it when they run (a field's `choices` is the registry itself), so a name
    registered after import is a valid choice.

    The package that registers the built-in names (`filled_by`) is imported when the registry is first read, not
    when this package is: `import trl_federated` and the command line's `--help` and typos need neither it nor the
    torch it imports. A name, not an import: the configuration, a leaf, knows no implementation (tests/
    test_architecture.py), and the registry reads whatever that package registers."""

    def __init__(self, kind: str, entries=(), filled_by: str = "trl_federated.aggregation"):
        super().__init__(entries)
        self.kind, self.filled_by = kind, filled_by

    def _fill(self) -> None:
        if self.filled_by is not None:
            filled_by, self.filled_by = self.filled_by, None  # once, and not again while it registers
            importlib.import_module(filled_by)

    def __getitem__(self, name):
        self._fill()
        return super().__getitem__(name)

    def __contains__(self, name) -> bool:
        self._fill()
        return super().__contains__(name)

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def get(self, name, default=None):
        self._fill()
        return super().get(name, default)

    def names_so_far(self) -> list[str]:
        """The names declared or registered so far, without importing the package that fills the registry: beyond
        the built-in names, those registered in this process (`arguments.flags.recorded_parser`)."""
        return list(super().keys())

    def declared(self, name):
        """`name`'s entry as this module declares it, without importing the package that fills the registry: for a
        value read when a module imports (`methods.FGRPO_STEP`, which `trl-federated compare --help` reads), where
        that import would cost torch. Registering a declared aggregation keeps its server optimizer
        (`aggregation.register_aggregation`), so the declared one is the registered one."""
        return super().__getitem__(name)

    def items(self):
        self._fill()
        return super().items()

    def keys(self):
        self._fill()
        return super().keys()

    def values(self):
        self._fill()
        return super().values()


# `FedGRPOConfig.server_optimizer`: the server step on the pseudo-gradient Δ, each name with its `ServerOptimizer`
# class (`aggregation.server_optim`: "adam", "sgd", "fedadam", "adam-norm", "nesterov").
SERVER_OPTIMIZERS = Registry("server_optimizer")


@dataclass(frozen=True)
class Aggregation:
    """A value of `FedGRPOConfig.aggregation`: the server strategy (`aggregator_class.from_config` builds it; None
    until the aggregation package registers it) and the server optimizer it takes when `server_optimizer` is unset."""

    aggregator_class: type | None
    server_optimizer: str = "sgd"

# `FedGRPOConfig.aggregation`, each with its strategy and the server optimizer it takes when `server_optimizer` is
# left unset (`Aggregation`). FedAvg, FedProx
# and SCAFFOLD as their papers define them: the weighted mean of the client models, i.e. SGD with learning rate 1
# (SCAFFOLD's global step size η_g = 1). FGRPO: the RPG-weighted mean, the server step chosen by experiment
# (benchmarks/server_step.py, docs/methods.md): the paper's Adam (Algorithm 1, line 23) with its ε = 1e-8 moves
# nearly every coordinate by ±lr each round whatever the clients' change, and at the grid's budget it learned less
# than FedAvg, while the RPG-weighted mean learned as much as FedAvg on the validation slice. `server_optimizer: adam`
# (the `fgrpo-paper` method) is the paper's step. `aggregation.register_aggregation` adds a row with its strategy.
AGGREGATIONS = Registry("aggregation", {name: Aggregation(None) for name in ("rpg", "fedavg", "fedprox", "scaffold")})

# `FedGRPOConfig.rpg_gain`: how RPG turns a client's R̄ into its gain h (`aggregation.rpg`): the paper's Eq. rpg, or
# the same with the gap soft-thresholded at its standard error (`NoiseAwareGain`).
RPG_GAINS = ("paper", "noise-aware")
# `FedGRPOConfig.rpg_signal`: what a client reports as R̄ (`local.client.train_local_round`): the paper's mean reward of
# its last `reward_window` local steps, or its local model's greedy reward on a fixed slice of its own items.
RPG_SIGNALS = ("reward-window", "held-out")

# `FedGRPOConfig.update_norm_action`: what happens to an update over `update_norm_bound` (`admission.UpdateGate`).
NORM_ACTIONS = ("reject", "clip")

# `FedGRPOConfig.robust_aggregation`: each name with its combiner class (`aggregation.robust`, one registration line
# each); 'none' is the weighted mean, no combiner.
ROBUST_AGGREGATIONS = Registry("robust_aggregation", {"none": None})

# `FedGRPOConfig.scaffold_correction`: where SCAFFOLD's correction c − c_i meets a local Adam
# (`aggregation.scaffold.ScaffoldCorrection`).
SCAFFOLD_CORRECTIONS = ("decoupled", "gradient")

# `FedGRPOConfig.transfer_dtype`: the precision of a client's update on the wire, each name with its codec (`wire`,
# one registration line each): a dtype, or a blockwise quantization (`wire.blockwise`).
TRANSFER_DTYPES = Registry("transfer_dtype", filled_by="trl_federated.wire")
# `FedGRPOConfig.lora_aggregation`: "freeze_a" freezes and never sends LoRA A (`wire.WireFormat`).
LORA_AGGREGATIONS = ("separate", "freeze_a")

# `FedGRPOConfig.generation_dtype`: the weights dtype of fast generation ("auto" picks one, `fast_generation`).
GENERATION_DTYPES = ("float32", "bfloat16")
GENERATION_DTYPE_CHOICES = ("auto", *GENERATION_DTYPES)


def either(choices) -> str:
    """The choices of a field as an error message names them: "'a', 'b' or 'c'"."""
    *others, last = choices
    return f"{', '.join(map(repr, others))} or {last!r}" if others else repr(last)


def choice_error(name: str, value, choices) -> str | None:
    """The one message for a value of the field `name` that is not among its `choices` (None when it is): the
    configuration yields it, and an implementation given the value directly raises it (`check_choice`)."""
    return None if value in choices else f"`{name}` must be {either(tuple(choices))}, got {value!r}."


def check_choice(name: str, value, choices) -> None:
    """`ValueError` (`choice_error`) unless `value` is one of the field `name`'s `choices`."""
    if message := choice_error(name, value, choices):
        raise ValueError(message)
