"""Checkpoints (trl_federated/core/checkpoint.py): atomic, manifest-verified, rotated; a damaged one is named and the
run falls back."""

import math
import os
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from test_reliability import (
    assert_states_equal,
    checkpoint_of,
    flip_byte,
    make_runner,
    rewrite_consistently,
    rewrite_state,
)
from trl_federated import FedGRPOConfig
from trl_federated.core.checkpoint import (
    CorruptCheckpointError,
    list_checkpoints,
    prepare_output_dir,
    read_checkpoint,
    write_checkpoint,
)


def test_checkpoint_write_is_atomic_and_rotates(tmp_path, monkeypatch):
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    write_checkpoint(checkpoint_of(0, 0.5), tmp_path, lora)
    loaded = read_checkpoint(tmp_path / "checkpoint-0")
    assert loaded.aggregator["step"] == 0 and loaded.identity == {"note": "unit test"}
    assert loaded.aggregator["m"]["w"].tolist() == [0.5, 1.0]

    # a crash while writing checkpoint-1 leaves no checkpoint-1 and checkpoint-0 as it was
    import trl_federated.core.checkpoint as checkpoint_module

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(checkpoint_of(1, 1.5), tmp_path, lora)
    monkeypatch.undo()
    assert [path.name for path in list_checkpoints(tmp_path)] == ["checkpoint-0"]
    assert torch.equal(read_checkpoint(tmp_path / "checkpoint-0").global_state["w"], torch.full((2,), 0.5))

    # the next write clears the staging folder the crash left; save_total_limit keeps the latest ones
    for round_idx in (1, 2, 3):
        write_checkpoint(checkpoint_of(round_idx, float(round_idx)), tmp_path, lora, save_total_limit=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    # rewriting a round (after resuming from an older checkpoint) replaces it whole
    write_checkpoint(checkpoint_of(3, 7.0), tmp_path, lora, save_total_limit=2)
    assert torch.equal(read_checkpoint(tmp_path / "checkpoint-3").global_state["w"], torch.full((2,), 7.0))


def test_resume_arguments(tmp_path):
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, resume_from_checkpoint="true")
    with pytest.raises(FileNotFoundError, match="holds no checkpoint-<round> folder"):
        prepare_output_dir(args)
    args.resume_from_checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        prepare_output_dir(args)
    write_checkpoint(checkpoint_of(0, 0.0), tmp_path, LoraConfig(r=2, target_modules=["q_proj"]))
    write_checkpoint(checkpoint_of(4, 0.0), tmp_path, LoraConfig(r=2, target_modules=["q_proj"]))
    for value in ("true", "True", True):
        args.resume_from_checkpoint = value
        assert prepare_output_dir(args) == tmp_path / "checkpoint-4"
    args.resume_from_checkpoint = str(tmp_path / "checkpoint-0")
    assert prepare_output_dir(args) == tmp_path / "checkpoint-0"


@pytest.mark.parametrize("damage, fault", [
    ("truncated adapter", r"adapter_model.safetensors does not match its manifest \(truncated or modified\)"),
    ("flipped byte", r"adapter_model.safetensors does not match its manifest"),
    ("edited json", r"federation.json does not match its manifest"),
    ("no manifest", r"no readable manifest.json"),
    ("missing file", r"federation.safetensors is missing"),
    ("json garbage", r"unreadable \(JSONDecodeError"),
    ("nan baseline", r"non-finite values in aggregator\['baselines'\]\['site-0'\]"),
    ("round index", r"it holds round 0, but its folder names round 1"),
    ("history", r"its history ends with round 0, not 1"),
])
def test_a_damaged_newest_checkpoint_is_named_and_the_run_falls_back(tmp_path, tiny_model_dir, caplog, damage, fault):
    reference = make_runner(tiny_model_dir, tmp_path / "run", num_rounds=2)
    reference.run()
    newest = tmp_path / "run" / "checkpoint-1"
    if damage == "truncated adapter":
        (newest / "adapter_model.safetensors").write_bytes((newest / "adapter_model.safetensors").read_bytes()[:100])
    elif damage == "flipped byte":
        flip_byte(newest / "adapter_model.safetensors")
    elif damage == "edited json":
        (newest / "federation.json").write_text(
            (newest / "federation.json").read_text().replace('"round_idx": 1', '"round_idx": 0', 1)
        )
    elif damage == "no manifest":
        (newest / "manifest.json").unlink()
    elif damage == "missing file":
        (newest / "federation.safetensors").unlink()
    elif damage == "json garbage":
        rewrite_consistently(newest, "federation.json", "{not json")
    elif damage == "nan baseline":
        rewrite_state(newest, lambda state: state["aggregator"]["baselines"].update({"site-0": math.nan}))
    elif damage == "round index":
        rewrite_state(newest, lambda state: state.update(round_idx=0))
    elif damage == "history":
        rewrite_state(newest, lambda state: state["history"].pop())

    # named with its path when asked for explicitly
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(newest)) + " is damaged: " + fault):
        read_checkpoint(newest)
    with pytest.raises(CorruptCheckpointError, match=fault):
        make_runner(tiny_model_dir, tmp_path / "run", num_rounds=2, resume_from_checkpoint=str(newest)).run()
    # "the latest": a warning naming it, and the previous intact checkpoint resumes, ending where the run ended
    resumed = make_runner(tiny_model_dir, tmp_path / "run", num_rounds=2, resume_from_checkpoint="true")
    history = resumed.run()
    assert f"Checkpoint {newest} is damaged" in caplog.text and "newest intact checkpoint" in caplog.text
    assert [record.round_idx for record in history] == [0, 1]
    assert_states_equal(resumed.global_state, reference.global_state)
    read_checkpoint(newest)  # rewritten by the resumed round


def test_resume_refuses_when_no_checkpoint_is_intact(tmp_path):
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    for round_idx in (0, 1):
        write_checkpoint(checkpoint_of(round_idx, 0.5), tmp_path, lora)
        flip_byte(tmp_path / f"checkpoint-{round_idx}" / "federation.safetensors")
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, resume_from_checkpoint="true")
    with pytest.raises(CorruptCheckpointError, match=r"no checkpoint in it is intact: .*checkpoint-1 is damaged.*"
                       r"checkpoint-0 is damaged"):
        prepare_output_dir(args)
    # a checkpoint holding NaN is refused as damaged, whatever its checksums say
    write_checkpoint(checkpoint_of(2, 0.5, m=math.nan), tmp_path, lora)
    with pytest.raises(CorruptCheckpointError, match=r"non-finite values in aggregator\['m'\]\['w'\]"):
        read_checkpoint(tmp_path / "checkpoint-2")


def test_round_adapter_is_published_inside_the_atomic_checkpoint_step(tmp_path, monkeypatch):
    import trl_federated.core.checkpoint as checkpoint_module

    lora = LoraConfig(r=2, target_modules=["q_proj"])
    real_replace = os.replace

    def crash_on_checkpoint_rename(source, destination):
        if Path(destination).name == "checkpoint-0":
            raise OSError("power cut")
        real_replace(source, destination)

    monkeypatch.setattr(checkpoint_module.os, "replace", crash_on_checkpoint_rename)
    with pytest.raises(OSError, match="power cut"):
        write_checkpoint(checkpoint_of(0, 0.5), tmp_path, lora, round_adapter=True)
    monkeypatch.undo()
    # the crash left the round adapter (a resume redoes the round and rewrites it) and a staging folder, no checkpoint
    assert sorted(path.name for path in tmp_path.iterdir()) == [".checkpoint-0.tmp", "round-0"]
    assert list_checkpoints(tmp_path) == []
    (tmp_path / ".round-3.tmp").mkdir()  # another crash's leftovers
    prepare_output_dir(FedGRPOConfig(output_dir=str(tmp_path), bf16=False, overwrite_output_dir=True))
    checkpoint_module.unlock_output_dir(tmp_path)
    # staging folders cleaned on start (and the old run's round-0 overwritten); the writers' lock file stays
    assert [path.name for path in tmp_path.iterdir()] == [checkpoint_module.LOCK_FILE]

    write_checkpoint(checkpoint_of(0, 0.5), tmp_path, lora, round_adapter=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == [checkpoint_module.LOCK_FILE, "checkpoint-0", "round-0"]
    assert torch.equal(load_file(tmp_path / "round-0" / "adapter_model.safetensors")["w"], torch.full((2,), 0.5))
    assert (tmp_path / "round-0" / "adapter_config.json").is_file()
