"""The identity of a federated run: what a checkpoint must share with the run that resumes it (the base model, the
LoRA configuration, the clients and their data, the aggregator, the server optimizer, the wire format and the settings
that change what the run computes), and the check that refuses a checkpoint of another run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from datasets import Dataset
from peft import PeftModel

from ..aggregation import Aggregator, server_optimizer_from_config
from ..choices import SERVER_OPTIMIZERS
from ..config import SERVER_STEP_FIELDS, FedGRPOConfig, result_fields

logger = logging.getLogger(__name__)

# Config entries that name or store the model rather than define it.
_IGNORED_MODEL_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")
_IGNORED_LORA_KEYS = ("base_model_name_or_path", "revision", "inference_mode", "peft_version")


class CheckpointMismatchError(ValueError):
    """The checkpoint was made by a run with another base model, LoRA configuration, client set, aggregator, server
    optimizer or training settings."""


def run_identity(
    model: PeftModel, client_datasets: Mapping[str, Dataset], aggregator: Aggregator, args: FedGRPOConfig | None = None
) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it: the base model (its configuration and a
    fingerprint of its weights), the LoRA configuration, the clients (ids in order, rows, data fingerprint), the
    aggregator and server optimizer classes and, from `args`, the wire format and every `config.result_fields`
    setting."""
    base = model.get_base_model()
    model_config = _jsonable(base.config.to_dict())
    lora_config = _jsonable(model.peft_config[model.active_adapter].to_dict())
    identity = {
        "base_model": {
            "name_or_path": getattr(base.config, "_name_or_path", None),
            "config": {key: value for key, value in model_config.items() if key not in _IGNORED_MODEL_KEYS},
            "weights": base_weights_fingerprint(model),
        },
        "lora": {key: value for key, value in lora_config.items() if key not in _IGNORED_LORA_KEYS},
        "clients": [
            {"id": client_id, "num_rows": len(dataset), "fingerprint": dataset_fingerprint(dataset)}
            for client_id, dataset in client_datasets.items()
        ],
        "aggregator": type(aggregator).__name__,
        "server_optimizer": type(aggregator.server_optimizer).__name__,
    }
    if args is not None:
        identity["wire"] = {"lora_aggregation": args.lora_aggregation, "transfer_dtype": args.transfer_dtype}
        training = {name: getattr(args, name) for name in result_fields(args)}
        if args.dp_noise_multiplier is None:  # without DP its mechanism's settings compute nothing: a run resumes
            # whatever they were (a checkpoint of `dp_clip_norm`'s former default, 1.0, included)
            training = {name: value for name, value in training.items() if name == "dp_noise_multiplier"
                        or not name.startswith("dp_")}
        identity["training"] = _jsonable(training)
    return identity


def allowed_changes(args: FedGRPOConfig) -> set[str]:
    """The `config.result_fields` that `args.resume_allow_changes` (comma-separated) lets a resumed run change; a name
    that is not one is a `ValueError`: the structure of a run (model, LoRA, clients, aggregation, server optimizer,
    wire format) never changes."""
    names = {name.strip() for name in (getattr(args, "resume_allow_changes", None) or "").split(",") if name.strip()}
    fields = result_fields(args)
    unknown = sorted(names - set(fields))
    if unknown:
        raise ValueError(
            f"`resume_allow_changes` names {unknown}, which a resumed run cannot change; it may name only training "
            f"settings: {', '.join(fields)}."
        )
    return names


def check_identity(
    saved: dict[str, Any], current: dict[str, Any], path: str | Path, allow_changes: set[str] = frozenset()
) -> None:
    """Raise `CheckpointMismatchError`, naming every difference, unless `saved` and `current` are the same run (up
    to the training settings in `allow_changes`, whose changes are logged)."""
    problems = []
    saved_model, current_model = saved["base_model"], current["base_model"]
    names = f"checkpoint: {saved_model['name_or_path']!r}, now: {current_model['name_or_path']!r}"
    if differences := _differences(saved_model["config"], current_model["config"]):
        problems.append(f"the base model's config differs ({names}) in {differences}")
    elif saved_model["weights"] != current_model["weights"]:
        problems.append(f"the base model's weights differ ({names})")
    if differences := _differences(saved["lora"], current["lora"]):
        problems.append(f"the LoRA configuration differs in {differences}")
    saved_ids, current_ids = [c["id"] for c in saved["clients"]], [c["id"] for c in current["clients"]]
    if saved_ids != current_ids:
        problems.append(f"the clients differ (checkpoint: {saved_ids}, now: {current_ids})")
    else:
        for before, now in zip(saved["clients"], current["clients"]):
            if before != now:
                problems.append(
                    f"client {now['id']!r} holds other data ({now['num_rows']} rows now, {before['num_rows']} in "
                    "the checkpoint, or the same number of different rows)"
                )
    if "wire" in current and (differences := _differences(saved["wire"], current["wire"])):
        problems.append(f"the wire format differs in {differences}")
    if saved["aggregator"] != current["aggregator"]:
        problems.append(f"the aggregator differs (checkpoint: {saved['aggregator']}, now: {current['aggregator']})")
    if saved.get("server_optimizer") != current.get("server_optimizer"):
        problems.append(
            f"the server optimizer differs (checkpoint: {saved.get('server_optimizer')}, now: "
            f"{current.get('server_optimizer')})"
        )
    if "training" in current:
        # A field the checkpoint does not record was added after it was made: that run ran with its default.
        saved_training = {**_unrecorded_defaults(current["training"]), **saved.get("training", {})}
        current_training = current["training"]
        changed = [key for key in current_training if saved_training.get(key, "(unrecorded)") != current_training[key]]
        if refused := [key for key in changed if key not in allow_changes]:
            problems.append(
                "training settings differ in "
                f"{_differences(saved_training, current_training, keys=refused, limit=len(refused))}"
                " (`resume_allow_changes` may allow them)"
            )
        if allowed := [key for key in changed if key in allow_changes]:
            logger.warning("Resuming with changed training settings (resume_allow_changes): %s",
                           _differences(saved_training, current_training, keys=allowed, limit=len(allowed)))
    if problems:
        raise CheckpointMismatchError(
            f"Cannot resume from {path}: it was made by another run: {'; '.join(problems)}. Resume with the same "
            "base model, LoRA configuration, clients, aggregation, server optimizer and training settings, or start "
            "afresh in another output_dir."
        )


def _unrecorded_defaults(training: dict[str, Any]) -> dict[str, Any]:
    """`FedGRPOConfig`'s default of each of `training`'s fields that has one, as the checkpoint would record it."""
    defaults = {
        spec.name: spec.default for spec in dataclasses.fields(FedGRPOConfig)
        if spec.name in training and spec.default is not dataclasses.MISSING
    }  # fmt: skip
    return _jsonable(defaults)


def _differences(saved: dict[str, Any], current: dict[str, Any], limit: int = 5, keys: list[str] | None = None) -> str:
    if keys is None:
        keys = [key for key in {**saved, **current} if saved.get(key) != current.get(key)]
    described = [f"{key} (checkpoint: {saved.get(key)!r}, now: {current.get(key)!r})" for key in keys[:limit]]
    return ", ".join(described) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _jsonable(value: Any) -> Any:
    """`value` as it reads back from JSON (sets as sorted lists, enums by value, int keys as strings)."""
    return json.loads(json.dumps(value, default=lambda item: sorted(item) if isinstance(item, set) else str(item)))


def base_weights_fingerprint(model: PeftModel, values_per_tensor: int = 16) -> str:
    """SHA-256 of the shape and a few evenly spaced values of every base-model parameter.

    Hashing every weight of a multi-billion-parameter model would take minutes; a few values per tensor tell two
    checkpoints of one architecture apart just as well. Values are rounded to bfloat16 first, so the same model
    loaded in float32 or bfloat16 gives the same fingerprint. Adapter weights are left out: they are the
    federated state, not the model.
    """
    adapter_markers = tuple(f".{name}." for name in model.peft_config)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if any(marker in name for marker in adapter_markers) or param.numel() == 0 or param.is_meta:
            continue
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // values_per_tensor)][:values_per_tensor]
        digest.update(repr(tuple(param.shape)).encode())
        digest.update(sample.to("cpu", torch.bfloat16).float().numpy().tobytes())
    return digest.hexdigest()


def dataset_fingerprint(dataset: Dataset) -> str:
    """SHA-256 of a dataset's rows, in order, through Arrow IPC (any column type, no pickling)."""
    digest = hashlib.sha256()
    for batch in dataset.with_format("arrow").iter(batch_size=10_000):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_table(batch)
        digest.update(sink.getvalue())
    return digest.hexdigest()


def keep_server_step(
    args: FedGRPOConfig, aggregator: Aggregator, identity: dict[str, Any], saved_identity: dict[str, Any]
) -> None:
    """Server-step fields left unset (`FedGRPOConfig.derived_server_fields`) are resolved once per run: resumed,
    the run takes its checkpoint's server optimizer and learning rate, even where the defaults or the fields they
    derive from have changed since (FGRPO's default step did). An explicit value is checked against the
    checkpoint as any setting (`check_identity`). `identity` (the run's, `run_identity`) and `aggregator`'s server
    optimizer take the checkpoint's values; the server calls it before `check_identity` as it resumes."""
    derived = args.derived_server_fields
    saved_class, current_class = saved_identity["server_optimizer"], identity["server_optimizer"]
    names = {optimizer_class.__name__: name for name, optimizer_class in SERVER_OPTIMIZERS.items()}
    if "server_optimizer" in derived and saved_class != current_class and saved_class in names:
        logger.warning(
            "Resuming with the checkpoint's server_optimizer %r, resolved when the run began (left unset, this "
            "configuration would take %r now); set `server_optimizer` to choose.",
            names[saved_class], args.server_optimizer,
        )
        args.resolve_server_step(names[saved_class])
        aggregator.server_optimizer = server_optimizer_from_config(args)
        identity["server_optimizer"] = saved_class
        identity["training"].update(
            {name: getattr(args, name) for name in SERVER_STEP_FIELDS if name in identity["training"]}
        )
    saved, current = saved_identity["training"]["server_learning_rate"], args.server_learning_rate
    same_optimizer = saved_class == identity["server_optimizer"]
    if not ("server_learning_rate" in derived and same_optimizer) or saved == current:
        return
    logger.warning(
        "Resuming with the checkpoint's server_learning_rate %g, resolved when the run began (left unset, this "
        "configuration would derive %g now).", saved, current,
    )
    args.server_learning_rate = aggregator.server_optimizer.learning_rate = saved
    identity["training"]["server_learning_rate"] = saved
