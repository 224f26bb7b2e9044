"""Per-round checkpoints of a federated run, written atomically and checked against the run that loads them.

A checkpoint holds everything that carries over from one round to the next: the global adapter, the
aggregator's state (RPG baselines and volatilities, server Adam moments and step count, SCAFFOLD's server
control), the clients' SCAFFOLD controls, the round history and the evaluations. Local training needs nothing
more: every client-round trainer is built afresh and seeded from (`seed`, round, client), so a run resumed
from checkpoint t repeats rounds t+1, t+2, ... bit for bit, with no RNG state saved (tests/test_reliability.py
kills a run with SIGKILL mid-round and checks this).

`output_dir/checkpoint-<t>/` (t = the last finished round, 0-based) holds tensors in safetensors and the rest
in JSON, so loading one never unpickles anything:

    adapter_model.safetensors, adapter_config.json   the global adapter after round t (PEFT layout)
    federation.safetensors                          aggregator and client-control tensors
    federation.json                                 round, history, evaluations, the other aggregator state,
                                                    and the identity of the run (base model, LoRA, clients)

It is written into a hidden staging folder that `os.replace` renames into place, so a crash leaves either the
whole checkpoint or none of it, and the previous checkpoints untouched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from datasets import Dataset
from peft import PeftConfig, PeftModel
from safetensors.torch import load_file, save_file

from .adapters import AdapterState
from .callbacks import RoundRecord

if TYPE_CHECKING:
    from .aggregation import Aggregator
    from .config import FedGRPOConfig

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # what `PeftConfig.save_pretrained` writes
TENSORS_FILE = "federation.safetensors"
STATE_FILE = "federation.json"
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
# What a run leaves in output_dir besides the files every run rewrites (final adapter, summary, plots).
_RUN_FILES = ("metrics.jsonl", "result.json")
_RUN_FOLDER_RE = re.compile(r"(checkpoint|round)-\d+")
# Config entries that name or store the model rather than define it.
_IGNORED_MODEL_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache")
_IGNORED_LORA_KEYS = ("base_model_name_or_path", "revision", "inference_mode", "peft_version")


class CheckpointMismatchError(ValueError):
    """The checkpoint was made by a run with another base model, LoRA configuration, client set or aggregator."""


@dataclass
class Checkpoint:
    """The state of a federated run after round `round_idx`."""

    round_idx: int
    global_state: AdapterState
    aggregator: dict[str, Any]  # `Aggregator.state_dict()`
    client_controls: dict[str, AdapterState]  # SCAFFOLD's c_i, by client id
    history: list[RoundRecord]
    evaluations: dict[int, dict[str, Any]]
    identity: dict[str, Any]  # `run_identity()` of the run that wrote it


# Writing and reading -------------------------------------------------------------------------------------


def write_checkpoint(
    checkpoint: Checkpoint, output_dir: str | Path, adapter_config: PeftConfig, save_total_limit: int | None = None
) -> Path:
    """Write `output_dir/checkpoint-<round_idx>` atomically; then keep only the `save_total_limit` latest."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{checkpoint.round_idx}"
    staging = output_dir / f".{final.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # left behind by a crash during an earlier write
    staging.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "round_idx": checkpoint.round_idx,
        "identity": checkpoint.identity,
        "aggregator": _split_tensors(checkpoint.aggregator, "aggregator", tensors),
        "client_controls": _split_tensors(checkpoint.client_controls, "client_controls", tensors),
        "history": [record.to_dict() for record in checkpoint.history],
        "evaluations": {str(round_idx): results for round_idx, results in checkpoint.evaluations.items()},
    }
    save_file(_contiguous(checkpoint.global_state), staging / ADAPTER_FILE, metadata={"format": "pt"})
    adapter_config.save_pretrained(str(staging))
    save_file(tensors, staging / TENSORS_FILE, metadata={"format": "pt"})
    (staging / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
    for path in staging.iterdir():
        _fsync(path)
    if final.exists():  # a round done again after resuming from an older checkpoint
        stale = output_dir / f".{final.name}.old"
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        shutil.rmtree(stale)
    os.replace(staging, final)
    _fsync(output_dir)
    if save_total_limit is not None and save_total_limit > 0:
        older = [path for path in list_checkpoints(output_dir) if _round_of(path) < checkpoint.round_idx]
        for path in older[: max(0, len(older) - (save_total_limit - 1))]:
            shutil.rmtree(path)
    return final


class CheckpointedServer:
    """`save_checkpoint` and `restore_checkpoint` for a server that keeps its state in the attributes named below (`FederatedRunner`, the
    Flower `FederatedStrategy`), so both write the same checkpoint format."""

    args: FedGRPOConfig
    model: PeftModel
    global_state: AdapterState
    aggregator: Aggregator
    client_controls: dict[str, AdapterState]
    history: list
    evaluations: dict[int, dict[str, Any]]
    identity: dict[str, Any]

    def save_checkpoint(self, round_idx: int) -> Path:
        """Write `output_dir/checkpoint-<round_idx>`: the state after round `round_idx`, atomically."""
        checkpoint = Checkpoint(
            round_idx=round_idx,
            global_state=self.global_state,
            aggregator=self.aggregator.state_dict(),
            client_controls=self.client_controls,
            history=self.history,
            evaluations=self.evaluations,
            identity=self.identity,
        )
        adapter_config = self.model.peft_config[self.model.active_adapter]
        return write_checkpoint(checkpoint, self.args.output_dir, adapter_config, self.args.save_total_limit)

    def restore_checkpoint(self, path: str | Path) -> Checkpoint:
        """Load the server state of the checkpoint at `path`, after checking that this run made it (same base model,
        LoRA configuration, clients, aggregator and wire format, else `CheckpointMismatchError`)."""
        checkpoint = read_checkpoint(path)
        check_identity(checkpoint.identity, self.identity, path)
        self.global_state = checkpoint.global_state
        self.aggregator.load_state_dict(checkpoint.aggregator)
        self.client_controls = checkpoint.client_controls
        self.history = checkpoint.history
        self.evaluations = checkpoint.evaluations
        return checkpoint


def export_adapter(checkpoint_dir: str | Path, destination: str | Path) -> Path:
    """Publish a checkpoint's global adapter as a standalone PEFT adapter folder (`round-<t>`), atomically.

    The files are hard links to the checkpoint's, so the round costs no second write of the adapter, and they
    outlive the checkpoint when `save_total_limit` rotates it out (a copy where links are not supported).
    """
    checkpoint_dir, destination = Path(checkpoint_dir), Path(destination)
    staging = destination.with_name(f".{destination.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in (ADAPTER_FILE, ADAPTER_CONFIG_FILE):
        try:
            os.link(checkpoint_dir / name, staging / name)
        except OSError:
            shutil.copy2(checkpoint_dir / name, staging / name)
    shutil.rmtree(destination, ignore_errors=True)
    os.replace(staging, destination)
    return destination


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Load a checkpoint written by `write_checkpoint` (safetensors and JSON only)."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    tensors = load_file(path / TENSORS_FILE)
    return Checkpoint(
        round_idx=state["round_idx"],
        global_state=load_file(path / ADAPTER_FILE),
        aggregator=_join_tensors(state["aggregator"], tensors),
        client_controls=_join_tensors(state["client_controls"], tensors),
        history=[RoundRecord(**record) for record in state["history"]],
        evaluations={int(round_idx): results for round_idx, results in state["evaluations"].items()},
        identity=state["identity"],
    )


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints in `output_dir`, oldest round first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [
        path
        for path in output_dir.iterdir()
        if _CHECKPOINT_RE.fullmatch(path.name) and (path / STATE_FILE).is_file()
    ]
    return sorted(found, key=_round_of)


def _round_of(path: Path) -> int:
    return int(_CHECKPOINT_RE.fullmatch(path.name).group(1))


def _split_tensors(tree: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`tree` with every tensor moved into `tensors` under its path and replaced by {"__tensor__": path}."""
    if isinstance(tree, torch.Tensor):
        if name in tensors:
            raise ValueError(f"Two checkpoint tensors share the name {name!r}; rename the clients or the state keys.")
        tensors[name] = tree.detach().to("cpu").contiguous()
        return {"__tensor__": name}
    if isinstance(tree, Mapping):
        return {str(key): _split_tensors(value, f"{name}/{key}", tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_split_tensors(value, f"{name}/{index}", tensors) for index, value in enumerate(tree)]
    return tree


def _join_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        return {key: _join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_join_tensors(value, tensors) for value in tree]
    return tree


def _contiguous(state: AdapterState) -> AdapterState:
    return {key: value.detach().to("cpu").contiguous() for key, value in state.items()}


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk: the rename is atomic, this makes it durable."""
    if path.is_dir() and os.name != "posix":  # only POSIX can open a folder to sync it
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# Where a run starts --------------------------------------------------------------------------------------


def prepare_output_dir(args: FedGRPOConfig, is_main_process: bool = True) -> Path | None:
    """The checkpoint to resume from (`args.resume_from_checkpoint`), or None once `output_dir` holds no other run.

    `resume_from_checkpoint` is a checkpoint folder, or "true" (or `True`) for the latest one in `output_dir`.
    Without it, an `output_dir` that holds another run's metrics.jsonl, result.json, checkpoint-<t> or round-<t>
    is an error, since the new run would append to that run's log and mix with its checkpoints, unless
    `overwrite_output_dir` is set: then the main process deletes those first.
    """
    output_dir = Path(args.output_dir)
    value = args.resume_from_checkpoint
    if isinstance(value, str) and value.strip().lower() in ("true", "false", ""):
        value = value.strip().lower() == "true"
    if value is True:
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(
                f"`resume_from_checkpoint` asks for the latest checkpoint, but {output_dir} holds no complete "
                "checkpoint-<round> folder."
            )
        return found[-1]
    if value:
        path = Path(value)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint of a federated run: it has no {STATE_FILE}.")
        return path

    previous = sorted(
        path.name
        for path in (output_dir.iterdir() if output_dir.is_dir() else [])
        if path.name in _RUN_FILES or (path.is_dir() and _RUN_FOLDER_RE.fullmatch(path.name))
    )
    if not previous:
        return None
    if not args.overwrite_output_dir:
        resume = "resume it with `resume_from_checkpoint=true`, " if list_checkpoints(output_dir) else ""
        raise FileExistsError(
            f"output_dir {output_dir} already holds another run ({', '.join(previous[:6])}"
            f"{', ...' if len(previous) > 6 else ''}): {resume}set `overwrite_output_dir=true` to delete that run's "
            "files and start afresh, or choose another output_dir."
        )
    if is_main_process:
        logger.warning("overwrite_output_dir: deleting the earlier run's %s in %s", ", ".join(previous), output_dir)
        for name in previous:
            path = output_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    return None


# Identity of a run ---------------------------------------------------------------------------------------


def run_identity(model: PeftModel, client_datasets: Mapping[str, Dataset], aggregator: Aggregator) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it: the base model (its configuration and a
    fingerprint of its weights), the LoRA configuration, the clients (ids in order, rows, data fingerprint) and
    the aggregator class."""
    base = model.get_base_model()
    model_config = _jsonable(base.config.to_dict())
    lora_config = _jsonable(model.peft_config[model.active_adapter].to_dict())
    return {
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
    }


def check_identity(saved: dict[str, Any], current: dict[str, Any], path: str | Path) -> None:
    """Raise `CheckpointMismatchError`, naming every difference, unless `saved` and `current` are the same run."""
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
    # A checkpoint from before the wire options carries none: it used the defaults.
    default_wire = {"lora_aggregation": "separate", "transfer_dtype": "float32"}
    if differences := _differences(saved.get("wire", default_wire), current.get("wire", default_wire)):
        problems.append(f"the wire format differs in {differences}")
    if saved["aggregator"] != current["aggregator"]:
        problems.append(f"the aggregator differs (checkpoint: {saved['aggregator']}, now: {current['aggregator']})")
    if problems:
        raise CheckpointMismatchError(
            f"Cannot resume from {path}: it was made by another run: {'; '.join(problems)}. Resume with the same "
            "base model, LoRA configuration, clients and aggregation, or start afresh in another output_dir."
        )


def _differences(saved: dict[str, Any], current: dict[str, Any], limit: int = 5) -> str:
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
