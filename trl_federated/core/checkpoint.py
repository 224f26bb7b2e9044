"""Per-round checkpoints of a federated run, written atomically and verified when read, and the output folder a run
starts in (`prepare_output_dir`: resume, refuse or clear an earlier run's files).

A checkpoint holds everything that carries over from one round to the next: the global adapter, the
aggregator's state (RPG baselines and volatilities, server Adam moments and step count, SCAFFOLD's server
control and every client's control variate), the round history and the evaluations. Local training needs nothing
more: every client-round trainer is built afresh and seeded from (`seed`, round, client), so a run resumed
from checkpoint t repeats rounds t+1, t+2, ... bit for bit, with no RNG state saved (tests/test_reliability.py
kills a run with SIGKILL mid-round and checks this).

`output_dir/checkpoint-<t>/` (t = the last finished round, 0-based) holds tensors in safetensors and the rest
in JSON, so loading one never unpickles anything:

    adapter_model.safetensors, adapter_config.json   the global adapter after round t (PEFT layout)
    federation.safetensors                          the aggregator's tensors
    federation.json                                 round, history, evaluations, the other aggregator state,
                                                    and the identity of the run (`run_identity`: base model,
                                                    LoRA, clients, aggregation, server optimizer, settings)
    manifest.json                                   the size and SHA-256 of each file above

It is written into a hidden staging folder that `os.replace` renames into place, so a crash leaves either the
whole checkpoint or none of it, and the previous checkpoints untouched; the round's standalone adapter
(`round-<t>/`, hard links to the same files) is published from the staging folder before that rename, so a
checkpoint never exists without its round adapter. Stale staging folders of a crashed write are removed when a
run starts (`prepare_output_dir`).

Nothing read back is trusted: `read_checkpoint` verifies every file against the manifest, then the structure and
values (finite tensors and numbers, a round index that matches the folder and the history), and raises
`CorruptCheckpointError` naming the folder and the fault. Resuming from "the latest" checkpoint falls back, with a
warning, to the newest intact one, and refuses when none is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import reprlib
import shutil
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftConfig
from safetensors.torch import load_file, save_file

from ..adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE, AdapterState, check_state, non_finite_entries, write_adapter
from .round_record import RoundRecord

if TYPE_CHECKING:
    from ..config import FedGRPOConfig

logger = logging.getLogger(__name__)

# The layout of `federation.json`, recorded in it as "format": 2 since round records carry the aggregator's
# `round_metrics`. A checkpoint without it, or of another format, is refused (`OutdatedCheckpointError`).
CHECKPOINT_FORMAT = 2
TENSORS_FILE = "federation.safetensors"
STATE_FILE = "federation.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FILES = (ADAPTER_FILE, ADAPTER_CONFIG_FILE, TENSORS_FILE, STATE_FILE)
# Staging folders of a write that a crash interrupted: `.checkpoint-<t>.tmp`, `.checkpoint-<t>.old`, `.round-<t>.tmp`.
_STAGING_RE = re.compile(r"\.(checkpoint|round)-\d+\.(tmp|old)")
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")
# The append-only ledger of every DP release (`aggregation.privacy.ClientLevelPrivacy.release_log`): outside the
# checkpoints, so that a resume from an earlier checkpoint still counts what was released after it. Each checkpoint
# carries the ledger up to itself, which the file must start with (a resume into another folder starts it from them).
DP_RELEASE_LOG = "dp-releases.jsonl"
# What a run leaves in output_dir besides the files every run rewrites (final adapter, summary, plots).
_RUN_FILES = ("metrics.jsonl", "result.json", DP_RELEASE_LOG)
_RUN_FOLDER_RE = re.compile(r"(checkpoint|round)-\d+")
# The lock file of the run writing to an output folder (`lock_output_dir`); it holds the writer's PID and host.
LOCK_FILE = ".trl-federated.lock"


class CorruptCheckpointError(ValueError):
    """A checkpoint folder whose files do not match its manifest, or whose contents are malformed or non-finite."""

    def __init__(self, path: str | Path, fault: str, message: str | None = None):
        super().__init__(message or f"Checkpoint {path} is damaged: {fault}.")
        self.path, self.fault = Path(path), fault


class OutdatedCheckpointError(CorruptCheckpointError):
    """A checkpoint in a layout this version no longer reads (`CHECKPOINT_FORMAT`): written by an earlier version of
    this unreleased package. It is refused by name; nothing converts it."""

    def __init__(self, path: str | Path, found):
        fault = f"checkpoint format {found!r}, this version reads format {CHECKPOINT_FORMAT}"
        super().__init__(path, fault, (
            f"Checkpoint {path} was written by an earlier version of trl-federated ({fault}: the round records carry "
            "the aggregator's own metrics since). Resume it with the version that wrote it, or start the run afresh."
        ))


@dataclass
class Checkpoint:
    """The state of a federated run after round `round_idx`."""

    round_idx: int
    global_state: AdapterState
    aggregator: dict[str, Any]  # `Aggregator.state_dict()`, its per-client state included
    history: list[RoundRecord]
    evaluations: dict[int, dict[str, Any]]
    identity: dict[str, Any]  # `run_identity.run_identity()` of the run that wrote it


# Writing and reading -------------------------------------------------------------------------------------


def write_checkpoint(
    checkpoint: Checkpoint,
    output_dir: str | Path,
    adapter_config: PeftConfig,
    save_total_limit: int | None = None,
    round_adapter: bool = False,
) -> Path:
    """Write `output_dir/checkpoint-<round_idx>` atomically, with `round-<round_idx>/` first when `round_adapter`;
    then keep only the `save_total_limit` latest checkpoints (round adapters stay)."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{checkpoint.round_idx}"
    staging = output_dir / f".{final.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # left behind by a crash during an earlier write
    staging.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "format": CHECKPOINT_FORMAT,
        "round_idx": checkpoint.round_idx,
        "identity": checkpoint.identity,
        "aggregator": _split_tensors(checkpoint.aggregator, "aggregator", tensors),
        "history": [record.to_dict() for record in checkpoint.history],
        "evaluations": {str(round_idx): results for round_idx, results in checkpoint.evaluations.items()},
    }
    write_adapter(checkpoint.global_state, adapter_config, staging)
    save_file(tensors, staging / TENSORS_FILE, metadata={"format": "pt"})
    (staging / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
    manifest = {
        "round_idx": checkpoint.round_idx, "files": {name: _file_digest(staging / name) for name in CHECKPOINT_FILES}
    }
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    for path in staging.iterdir():
        _fsync(path)
    if round_adapter:  # before the checkpoint exists: a crash between the two renames only repeats the round
        export_adapter(staging, output_dir / f"round-{checkpoint.round_idx}")
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
    """Load a checkpoint written by `write_checkpoint` (safetensors and JSON only), after verifying every file
    against its manifest; then check its structure and values. `CorruptCheckpointError`, naming `path` and the
    fault, for anything else."""
    path = Path(path)
    verify_files(path)
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise TypeError(f"{STATE_FILE} holds no JSON object")
        found = state.get("format")  # None: a checkpoint from before formats were named
    except Exception as error:  # JSONDecodeError, TypeError (no JSON object): all the same to a resume
        raise CorruptCheckpointError(path, f"unreadable ({type(error).__name__}: {error})") from error
    if found != CHECKPOINT_FORMAT:
        raise OutdatedCheckpointError(path, found)
    try:
        tensors = load_file(path / TENSORS_FILE)
        aggregator = _join_tensors(state["aggregator"], tensors)
        checkpoint = Checkpoint(
            round_idx=state["round_idx"],
            global_state=load_file(path / ADAPTER_FILE),
            aggregator=aggregator,
            history=[RoundRecord.from_dict(record) for record in state["history"]],
            evaluations={int(round_idx): results for round_idx, results in state["evaluations"].items()},
            identity=state["identity"],
        )
    except Exception as error:  # JSONDecodeError, SafetensorError, KeyError, TypeError: all the same to a resume
        raise CorruptCheckpointError(path, f"unreadable ({type(error).__name__}: {error})") from error
    if fault := _checkpoint_fault(checkpoint, path):
        raise CorruptCheckpointError(path, fault)
    return checkpoint


def verify_files(path: str | Path) -> None:
    """`CorruptCheckpointError` unless every file of the checkpoint at `path` has the size and SHA-256 its manifest
    records."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        files = manifest["files"]
        missing = [name for name in CHECKPOINT_FILES if name not in files]
    except Exception as error:
        raise CorruptCheckpointError(path, f"no readable {MANIFEST_FILE} ({type(error).__name__}: {error})") from error
    if missing:
        raise CorruptCheckpointError(path, f"its manifest lists no {', '.join(missing)}")
    for name in CHECKPOINT_FILES:
        if not (path / name).is_file():
            raise CorruptCheckpointError(path, f"{name} is missing")
        if _file_digest(path / name) != files[name]:
            raise CorruptCheckpointError(path, f"{name} does not match its manifest (truncated or modified)")


def _checkpoint_fault(checkpoint: Checkpoint, path: Path) -> str | None:
    """What makes a parsed checkpoint unusable: a round index that is no index, or disagrees with the folder's name or
    with the history; a global adapter that is no dict of tensors; non-finite tensors or numbers in the adapter or
    the aggregator state."""
    round_idx = checkpoint.round_idx
    if isinstance(round_idx, bool) or not isinstance(round_idx, int) or round_idx < 0:
        return f"its round index {round_idx!r} is not a round"
    if (match := _CHECKPOINT_RE.fullmatch(path.name)) and int(match.group(1)) != round_idx:
        return f"it holds round {round_idx}, but its folder names round {match.group(1)}"
    if checkpoint.history and checkpoint.history[-1].round_idx != round_idx:
        return f"its history ends with round {checkpoint.history[-1].round_idx}, not {round_idx}"
    if not checkpoint.global_state or not all(
        isinstance(value, torch.Tensor) for value in checkpoint.global_state.values()
    ):
        return "its global adapter holds no tensors"
    if not isinstance(checkpoint.aggregator, dict) or not isinstance(checkpoint.identity, dict):
        return "its aggregator state or run identity is not a mapping"
    non_finite = non_finite_entries(checkpoint.global_state, "global adapter") + non_finite_entries(
        checkpoint.aggregator, "aggregator"
    )
    if non_finite:
        return f"non-finite values in {', '.join(non_finite[:3])}"
    return _adapter_shaped_fault(checkpoint.aggregator, checkpoint.global_state, "aggregator")


def _adapter_shaped_fault(tree: Any, global_state: AdapterState, name: str) -> str | None:
    """The first tensor map in the aggregator state `tree` keyed like the global adapter (server Adam's m and v,
    SCAFFOLD's c and each c_i) that does not have exactly its keys and shapes (`check_state`), or None: such a state
    would be read back, then fail at the next aggregation instead of here."""
    if not isinstance(tree, dict):
        return None
    if any(isinstance(value, torch.Tensor) and key in global_state for key, value in tree.items()):
        try:
            check_state(tree, global_state, name, check_finite=False)
        except ValueError as error:
            return str(error).rstrip(".")
        return None
    for key, value in tree.items():
        if fault := _adapter_shaped_fault(value, global_state, f"{name}[{key!r}]"):
            return fault
    return None


def _file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(2**20), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The checkpoint folders in `output_dir`, oldest round first: complete when written (the write is atomic);
    `read_checkpoint` finds out whether one was damaged since."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [path for path in output_dir.iterdir() if _CHECKPOINT_RE.fullmatch(path.name) and path.is_dir()]
    return sorted(found, key=_round_of)


def checkpoint_format(path: str | Path) -> Any:
    """The format a checkpoint folder records (`CHECKPOINT_FORMAT` for one this version reads), None when it names
    none or cannot be read: what decides, before a resume, whether it can be resumed at all."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state.get("format") if isinstance(state, dict) else None


def latest_intact_checkpoint(output_dir: str | Path) -> Path:
    """The newest checkpoint in `output_dir` that `read_checkpoint` accepts; each newer, damaged one is reported with
    a warning naming it and the fault. `CorruptCheckpointError` when none is intact, `FileNotFoundError` when there is
    none at all."""
    found = list_checkpoints(output_dir)
    if not found:
        raise FileNotFoundError(
            f"`resume_from_checkpoint` asks for the latest checkpoint, but {output_dir} holds no checkpoint-<round> "
            "folder."
        )
    faults = []
    for path in reversed(found):
        try:
            read_checkpoint(path)
        except CorruptCheckpointError as error:
            faults.append(str(error))
            logger.warning("%s Falling back to the previous checkpoint.", error)
            continue
        if faults:
            logger.warning("Resuming from %s, the newest intact checkpoint.", path)
        return path
    raise CorruptCheckpointError(output_dir, f"no checkpoint in it is intact: {' '.join(faults)}")


def clean_staging(output_dir: str | Path) -> list[str]:
    """Remove the staging folders a crashed checkpoint write left in `output_dir`; their names."""
    output_dir = Path(output_dir)
    stale = (
        sorted(path.name for path in output_dir.iterdir() if _STAGING_RE.fullmatch(path.name))
        if output_dir.is_dir() else []
    )
    for name in stale:
        shutil.rmtree(output_dir / name, ignore_errors=True)
    if stale:
        logger.warning("Removed the staging folders of an interrupted checkpoint write: %s", ", ".join(stale))
    return stale


def _round_of(path: Path) -> int:
    return int(_CHECKPOINT_RE.fullmatch(path.name).group(1))


# A tensor in the aggregator state is written as {TENSOR_MARKER: its name in federation.safetensors}. A mapping key of
# the state itself (a client id, an adapter key) that could read as the marker, or as an escaped key, is written with
# ESCAPE in front: client ids and metric names never hold a backslash, so a checkpoint written before the escape
# reads the same, and no key a client chooses (its id, `__tensor__` included) can turn its state into a tensor
# reference.
TENSOR_MARKER, ESCAPE = "__tensor__", "\\"


def _split_tensors(tree: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`tree` with every tensor moved into `tensors` under its path and replaced by {TENSOR_MARKER: path}, and every
    mapping key that is the marker or begins with `ESCAPE` escaped (`_escaped_key`)."""
    if isinstance(tree, torch.Tensor):
        if name in tensors:
            raise ValueError(f"Two checkpoint tensors share the name {name!r}; rename the clients or the state keys.")
        tensors[name] = tree.detach().to("cpu").contiguous()
        return {TENSOR_MARKER: name}
    if isinstance(tree, Mapping):
        return {_escaped_key(str(key)): _split_tensors(value, f"{name}/{key}", tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_split_tensors(value, f"{name}/{index}", tensors) for index, value in enumerate(tree)]
    return tree


def _escaped_key(key: str) -> str:
    return ESCAPE + key if key == TENSOR_MARKER or key.startswith(ESCAPE) else key


def _join_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_MARKER}:
            name = tree[TENSOR_MARKER]
            if not isinstance(name, str) or name not in tensors:
                raise KeyError(f"a tensor reference {reprlib.repr(name)} names no tensor of {TENSORS_FILE}")
            return tensors[name]
        return {key.removeprefix(ESCAPE): _join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_join_tensors(value, tensors) for value in tree]
    return tree


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


class OutputDirLockedError(FileExistsError):
    """Another process is writing a run to the output folder (`lock_output_dir`)."""


# The output folders this process writes to, by resolved path: their open, flock-ed lock files.
_HELD_LOCKS: dict[Path, Any] = {}


def lock_output_dir(output_dir: str | Path) -> bool:
    """Make this process the one writer of `output_dir`: an exclusive `fcntl.flock` on `output_dir/.trl-federated.lock`,
    which records this process's PID and host. Another process holding it is an `OutputDirLockedError` naming the
    folder and the holder; this process taking it again is a no-op (False: it was held already). The operating system
    releases the lock when the process exits, however it ends (a crash, SIGKILL), so a dead run's lock never needs
    clearing by hand; a live one is released by `unlock_output_dir`."""
    output_dir = Path(output_dir)
    key = output_dir.resolve()
    if key in _HELD_LOCKS:
        return False
    output_dir.mkdir(parents=True, exist_ok=True)
    stream = (output_dir / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        stream.seek(0)
        holder = stream.read(200).strip()
        stream.close()
        raise OutputDirLockedError(
            f"output_dir {output_dir} is being written by another run ({holder or 'holder not recorded'}): two runs "
            "writing one folder would mix their logs and replace each other's checkpoints. Wait for it to end, stop "
            "it, or choose another output_dir."
        ) from None
    stream.seek(0)
    stream.truncate()
    stream.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    stream.flush()
    _HELD_LOCKS[key] = stream
    return True


def unlock_output_dir(output_dir: str | Path) -> None:
    """Release this process's lock on `output_dir` (`lock_output_dir`), if it holds it."""
    stream = _HELD_LOCKS.pop(Path(output_dir).resolve(), None)
    if stream is not None:
        fcntl.flock(stream, fcntl.LOCK_UN)
        stream.close()


def _field_setting(name: str, value: str) -> str:
    return f"`{name}={value}`"


def prepare_output_dir(
    args: FedGRPOConfig, is_main_process: bool = True, setting: Callable[[str, str], str] | None = None
) -> Path | None:
    """The checkpoint to resume from (`args.resume_from_checkpoint`), or None once `output_dir` holds no other run.

    `resume_from_checkpoint` is a checkpoint folder, refused if damaged, or "true" (or `True`) for the latest intact
    one in `output_dir` (`latest_intact_checkpoint`). The main process first removes the staging folders of an
    interrupted checkpoint write.
    Without it, an `output_dir` that holds another run's metrics.jsonl, result.json, checkpoint-<t> or round-<t>
    is an error, since the new run would append to that run's log and mix with its checkpoints, unless
    `overwrite_output_dir` is set: then the main process deletes those first. `setting(field, value)` spells how to
    set a field in that error's advice (default: `field=value`, as YAML and `trl-federated run` take it).

    The main process first makes itself the folder's one writer (`lock_output_dir`), before it removes or reads
    anything there; a run another process is writing is an `OutputDirLockedError`, even with `overwrite_output_dir`
    or `resume_from_checkpoint`. The lock is held until `unlock_output_dir` (the run's end) or the process's exit.
    """
    if not is_main_process:
        return _prepare_output_dir(args, False, setting)
    locked = lock_output_dir(args.output_dir)
    try:
        return _prepare_output_dir(args, True, setting)
    except BaseException:
        if locked:  # a run refused here leaves the folder as it found it
            unlock_output_dir(args.output_dir)
        raise


def _prepare_output_dir(args: FedGRPOConfig, is_main_process: bool, setting: Callable[[str, str], str] | None):
    setting = setting or _field_setting
    output_dir = Path(args.output_dir)
    if is_main_process:
        clean_staging(output_dir)
    value = args.resume_from_checkpoint
    if isinstance(value, str) and value.strip().lower() in ("true", "false", ""):
        value = value.strip().lower() == "true"
    if value is True:
        return latest_intact_checkpoint(output_dir)
    if value:
        path = Path(value)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint of a federated run: it has no {STATE_FILE}.")
        read_checkpoint(path)  # a damaged checkpoint named explicitly is refused, never replaced by another
        return path

    previous = sorted(
        path.name
        for path in (output_dir.iterdir() if output_dir.is_dir() else [])
        if path.name in _RUN_FILES or (path.is_dir() and _RUN_FOLDER_RE.fullmatch(path.name))
    )
    if not previous:
        return None
    if not args.overwrite_output_dir:
        resume = f"resume it with {setting('resume_from_checkpoint', 'true')}, " if list_checkpoints(output_dir) else ""
        raise FileExistsError(
            f"output_dir {output_dir} already holds another run ({', '.join(previous[:6])}"
            f"{', ...' if len(previous) > 6 else ''}): {resume}set {setting('overwrite_output_dir', 'true')} to "
            f"delete that run's files and start afresh, or choose another folder with {setting('output_dir', '...')}."
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
