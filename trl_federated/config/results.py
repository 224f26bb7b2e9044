"""What a federated config shares with the TRL config it extends: which fields change what a run computes, so that a
resumed run must keep them (`ResultHelp`, `TRL_RESULT_FIELDS`, `result_fields`), and which of TRL's defaults it
changes, said once per process (`notice_changed_trl_defaults`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from trl import GRPOConfig

logger = logging.getLogger(__name__)

class ResultHelp(str):
    """The help of a field that changes what a run computes: a resumed run must keep its value unless
    `resume_allow_changes` names it (`result_fields`). The mark is the help's type because `HfArgumentParser` hands
    every metadata key on to argparse, which accepts no key of ours."""


# The fields TRL declares (`GRPOConfig`, `RLOOConfig` and `TrainingArguments`) that change what a run computes: the
# local optimizer and its schedule, the batch, sampling and the loss. `FedGRPOConfig` and its recipes redeclare some
# of them with other defaults (`loss_type`, `beta`, ...); the rest of TRL's fields (logging, saving, devices) do not
# change the result.
TRL_RESULT_FIELDS = (
    "seed", "learning_rate", "lr_scheduler_type", "warmup_steps", "optim", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "per_device_train_batch_size",
    "gradient_accumulation_steps", "num_generations", "steps_per_generation", "num_iterations",
    "max_completion_length", "temperature", "top_p", "top_k", "beta", "epsilon", "epsilon_high", "loss_type",
    "importance_sampling_level", "scale_rewards", "reward_weights", "mask_truncated_completions",
    "normalize_advantages", "reward_clip_range",
)  # fmt: skip


_NOTICED: set[type] = set()  # the config classes whose changed TRL defaults were said (once per process)


def changed_trl_defaults(config_class: type) -> dict[str, tuple[Any, Any]]:
    """The fields whose default `config_class` changes from the TRL config it extends: name -> (TRL's, this one's)."""
    trl_class = next(c for c in config_class.__mro__ if c.__module__.startswith("trl.") and dataclasses.is_dataclass(c))

    def defaults(cls: type) -> dict[str, Any]:
        return {item.name: item.default for item in dataclasses.fields(cls) if item.default is not dataclasses.MISSING}

    theirs, ours = defaults(trl_class), defaults(config_class)
    return {name: (theirs[name], ours[name]) for name in theirs if name in ours and theirs[name] != ours[name]}


def notice_changed_trl_defaults(args: GRPOConfig) -> None:
    """Say once per process and config class which TRL defaults this config changes and the run keeps (those left at
    the federated default), so that swapping `GRPOConfig` for it changes nothing unannounced."""
    if type(args) in _NOTICED:  # said once; every client round copies the config
        return
    kept = {name: values for name, values in changed_trl_defaults(type(args)).items()
            if getattr(args, name) == values[1]}
    if not kept:
        return
    _NOTICED.add(type(args))
    changes = ", ".join(f"`{name}` {ours!r} (TRL: {theirs!r})" for name, (theirs, ours) in kept.items())
    logger.warning("%s changes TRL's defaults, as the paper's Algorithm 1 trains: %s. Set a field to keep TRL's.",
                   type(args).__name__, changes)


def result_fields(config: GRPOConfig | type[GRPOConfig]) -> tuple[str, ...]:
    """The fields of `config` (an instance or a class) that change what a run computes from a checkpoint on, which a
    resumed run must keep unless `resume_allow_changes` names them: the federation's, whose help is a `ResultHelp`,
    then those of TRL's (`TRL_RESULT_FIELDS`) that `config` has (an `RLOOConfig` has no `loss_type`)."""
    fields = dataclasses.fields(config)
    federation = [f.name for f in fields if isinstance(f.metadata.get("help"), ResultHelp)]
    names = {f.name for f in fields}
    return (*federation, *(name for name in TRL_RESULT_FIELDS if name in names))
