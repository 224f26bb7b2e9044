"""The local algorithms' recipes: `FedDAPOConfig` and `FedGSPOConfig` (`CONFIG_CLASSES`, by name), and
`federated_config`, which adds the federation's fields to the config of any other trainer a federation trains (a
`GRPOConfig` or `RLOOConfig` subclass)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from trl import GRPOConfig, RLOOConfig

from .declared_fields import declared_annotations
from .fields import FederatedConfig, FedGRPOConfig


@dataclass
class FedDAPOConfig(FedGRPOConfig):
    r"""
    Federated DAPO (Yu et al., 2025): [`FedGRPOConfig`] with the defaults of TRL's DAPO recipe.

    Token-level loss normalisation (`loss_type="dapo"`), clip-higher (`epsilon_high=0.28`), truncated completions
    masked out of the loss, and no KL term (`beta=0`). Add `trl.rewards.get_soft_overlong_punishment` to the
    reward functions for DAPO's overlong reward shaping. Reward-window tracking and the round callbacks are those
    of every `FedGRPOConfig`; the paper's FDAPO and "FDAPO w/o RPG" are in `trl_federated.methods`.

    Parameters:
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            DAPO's token-level loss normalisation: every token of the batch weighs the same.
        epsilon_high (`float`, *optional*, defaults to `0.28`):
            Upper clipping bound of the importance ratio (DAPO's clip-higher).
        mask_truncated_completions (`bool`, *optional*, defaults to `True`):
            Exclude truncated completions from the loss (DAPO's overlong filtering).
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient; DAPO drops the KL term.
    """

    loss_type: str = field(default="dapo", metadata={"help": "DAPO's token-level loss normalisation."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clipping bound (clip-higher)."})
    mask_truncated_completions: bool = field(
        default=True, metadata={"help": "Exclude truncated completions from the loss (DAPO's overlong filtering)."}
    )
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; DAPO drops the KL term."})


@dataclass
class FedGSPOConfig(FedGRPOConfig):
    r"""
    Federated GSPO (Zheng et al., 2025): [`FedGRPOConfig`] with the defaults of TRL's GSPO recipe.

    Sequence-level importance ratios (`importance_sampling_level="sequence"`) clipped in the narrow range
    [1 − 3e-4, 1 + 4e-4], no KL term, and `steps_per_generation=4` so that each generation batch is reused for
    off-policy steps, without which the ratio is always 1 and GSPO equals GRPO. The paper's FGSPO and "FGSPO w/o
    RPG" are in `trl_federated.methods`.

    Parameters:
        importance_sampling_level (`str`, *optional*, defaults to `"sequence"`):
            GSPO's sequence-level importance ratio: the geometric mean of a completion's token ratios.
        loss_type (`str`, *optional*, defaults to `"grpo"`):
            Sequence-mean loss, as in TRL's GSPO recipe.
        epsilon (`float`, *optional*, defaults to `3e-4`):
            Lower clipping bound of the sequence ratio.
        epsilon_high (`float`, *optional*, defaults to `4e-4`):
            Upper clipping bound of the sequence ratio.
        steps_per_generation (`int`, *optional*, defaults to `4`):
            Optimisation steps per generation batch: above 1 the later steps are off-policy, where the ratio acts.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient; GSPO's recipe uses none.
    """

    importance_sampling_level: str = field(
        default="sequence", metadata={"help": "GSPO's sequence-level importance sampling ratio."}
    )
    loss_type: str = field(default="grpo", metadata={"help": "Sequence-mean loss, as in TRL's GSPO recipe."})
    epsilon: float = field(default=3e-4, metadata={"help": "Lower clipping bound of the sequence ratio."})
    epsilon_high: float | None = field(default=4e-4, metadata={"help": "Upper clipping bound of the sequence ratio."})
    steps_per_generation: int | None = field(
        default=4, metadata={"help": "Optimisation steps per generation batch: >1 makes updates off-policy."}
    )
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; GSPO's recipe uses none."})


# The local algorithms by name (`trl-federated run --algorithm`, `methods.Method.algorithm`): each one's config
# class, whose defaults are the algorithm's recipe.
CONFIG_CLASSES = {"grpo": FedGRPOConfig, "dapo": FedDAPOConfig, "gspo": FedGSPOConfig}


# TRL's online RL trainer families a federation trains: each one's root trainer class, by import path, with the TRL
# config that configures it (`federated_config` adds the federation's fields to it). The one table of the families:
# the client side imports the trainers from it (`local.local_trainer.family_roots`); the configuration names them
# only, as importing a trainer costs seconds that a config does not need. What a client round relies on, every class
# of a family has: `reward_funcs` that score completions it generates from a prompt dataset, the mean `reward` it logs
# every step (R̄), `compute_loss` (FedProx's and SCAFFOLD's loss terms), a `peft_config` or `PeftModel` whose LoRA
# adapter it trains (the update), and the KL reference adapter `ref` (which the client keeps at θ^{[0]}).
FEDERATED_FAMILIES = {"trl.GRPOTrainer": GRPOConfig, "trl.RLOOTrainer": RLOOConfig}


def federable_configs() -> tuple[type, ...]:
    """The config classes of the federated families (`FEDERATED_FAMILIES`)."""
    return tuple(FEDERATED_FAMILIES.values())


def family_config_names() -> str:
    """The families' config classes as a message names them, beside their trainers: "`trl.GRPOConfig` or
    `trl.RLOOConfig`"."""
    return " or ".join(f"`{path.rpartition('.')[0]}.{config.__name__}`" for path, config in FEDERATED_FAMILIES.items())


def federated_config(config_class: type[GRPOConfig] | type[RLOOConfig]) -> type[FederatedConfig]:
    """`config_class` (a `GRPOConfig` subclass, such as TRL's `GMPOConfig`, or `RLOOConfig` or a subclass of it) with
    the federation's fields: a dataclass that is both a `FederatedConfig` and a `config_class` (and a `FedGRPOConfig`
    when `config_class` is a `GRPOConfig`), for the trainer `federated(...)` makes of the trainer that `config_class`
    configures.

    Its defaults are `config_class`'s for every field `config_class` (or a class between it and `GRPOConfig`)
    declares itself, the algorithm's recipe, as `FedDAPOConfig` overrides `FedGRPOConfig`; `FedGRPOConfig`'s for
    every other field, the federation's and Algorithm 1's (`loss_type`, `lr_scheduler_type`, `beta`). An
    `RLOOConfig` gets the federation's fields and those of Algorithm 1's defaults that it has (`lr_scheduler_type`;
    its own `beta`), and no GRPO field it lacks. Both `__post_init__` validations run. The class is made once per
    `config_class` and parses like any TRL config (`TrlParser`, YAML); its instances pickle as long as `config_class`
    does. A federated config class is returned as it is.
    """
    if not (isinstance(config_class, type) and issubclass(config_class, federable_configs())):
        raise TypeError(f"`federated_config` needs a {family_config_names()} subclass, got {config_class!r}.")
    if issubclass(config_class, FederatedConfig):
        return config_class
    return _federated_config_class(config_class)


@functools.cache
def _federated_config_class(config_class: type) -> type[FederatedConfig]:
    # Dataclasses take each base's complete field table, inherited fields included, so whichever base comes last in
    # the MRO would reset the other's own defaults to GRPOConfig's: the algorithm's own fields are declared again.
    grpo_fields = GRPOConfig.__dataclass_fields__
    own = [f for name, f in config_class.__dataclass_fields__.items() if grpo_fields.get(name) is not f]
    if issubclass(config_class, GRPOConfig):
        bases, declared = (FedGRPOConfig, config_class), own
    else:
        # Not a GRPOConfig: the class declares the federation's fields itself, with Algorithm 1's defaults of the
        # fields `config_class` inherits from TRL's base config, and none of the GRPO fields it lacks (its trainer
        # would ignore them). Its own fields keep their defaults: `FederatedConfig` has no field table to reset them.
        bases = (FederatedConfig, config_class)
        declared = [
            f for name, f in FedGRPOConfig.__dataclass_fields__.items()
            if grpo_fields.get(name) is not f and (name not in grpo_fields or name in config_class.__dataclass_fields__)
            and name not in {f.name for f in own}
        ]  # fmt: skip
    written = declared_annotations(FedGRPOConfig)
    namespace = {
        "__module__": __name__,
        "__qualname__": f"Fed{config_class.__name__}",
        "__doc__": f"`{config_class.__module__}.{config_class.__qualname__}` with the fields of `FedGRPOConfig` "
        "(see `federated_config`).",
        # The federation's fields as `FedGRPOConfig` and its field mixins annotate them (strings, which its type
        # checks read): a parser may have replaced a field's `type` with the type the string names.
        "__annotations__": {f.name: written.get(f.name, f.type) for f in declared},
        "__reduce__": _reduce_federated_config,
        "algorithm_config_class": config_class,
    }
    for f in declared:
        namespace[f.name] = field(
            default=f.default, default_factory=f.default_factory, init=f.init, repr=f.repr, metadata=f.metadata
        )
    return dataclass(type(f"Fed{config_class.__name__}", bases, namespace))


def _reduce_federated_config(config: FederatedConfig):
    # The class is made at run time, so pickle refers to it through the class it federates (Trainer saves its
    # arguments with torch.save in every checkpoint).
    return _rebuild_federated_config, (type(config).algorithm_config_class, config.__dict__)


def _rebuild_federated_config(config_class: type, state: dict) -> FederatedConfig:
    cls = federated_config(config_class)
    config = cls.__new__(cls)
    config.__dict__.update(state)
    return config
