"""Vision-language models: one federated GRPO round of a tiny random VLM on the GEOQA fixture, offline."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from conftest import GEOQA_FIXTURE
from trl_federated import FederatedRunner, RoundCallback
from trl_federated.aggregation import aggregator_from_config
from trl_federated.data import build_geoqa_benchmark, partition_clients
from trl_federated.runtime.models import load_model_and_tokenizer, load_processing_class
from trl_federated.scoring.rewards import completion_text

REPO = Path(__file__).resolve().parents[1]


def text_length_reward(completions, **kwargs):
    """Varies on the random model's text, so GRPO gets gradients (its completions are never correct)."""
    return [len(completion_text(completion)) / 64 for completion in completions]


@pytest.fixture(scope="module")
def geoqa():
    return build_geoqa_benchmark(str(GEOQA_FIXTURE))


def test_vision_language_checkpoints_load_with_their_processor(tiny_vlm_dir):
    model, processor = load_model_and_tokenizer(str(tiny_vlm_dir))
    assert isinstance(model, LlavaForConditionalGeneration) and isinstance(processor, LlavaProcessor)
    assert processor.tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.pad_token_id == processor.tokenizer.pad_token_id
    assert isinstance(load_processing_class(str(tiny_vlm_dir)), LlavaProcessor)


def test_one_federated_round_trains_a_vlm_on_images(tiny_vlm_dir, geoqa, fast_args):
    args = fast_args(
        num_rounds=1, local_steps=1, reward_window=1, num_clients=2, partition_column="category",
        dirichlet_alpha=float("inf"), per_device_eval_batch_size=4,
    )  # fmt: skip
    updates = []

    class Keep(RoundCallback):
        def on_client_end(self, args, round_idx, update, **kwargs):
            updates.append(update)

    model, processor = load_model_and_tokenizer(str(tiny_vlm_dir))
    runner = FederatedRunner(
        model, text_length_reward, args, partition_clients(geoqa["train"], args), processing_class=processor,
        eval_dataset=geoqa["test"], callbacks=[Keep()],
    )  # fmt: skip
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    history = runner.run()

    # every client trained: its adapter moved, in the vision tower too, so the images went through the model
    vision_b = [key for key in initial if "vision_tower" in key and "lora_B" in key]
    assert vision_b and all(torch.equal(initial[key], torch.zeros_like(initial[key])) for key in vision_b)
    for update in updates:
        assert any(not torch.equal(update.state[key], initial[key]) for key in initial)
        assert any(update.state[key].abs().sum() > 0 for key in vision_b)

    # the global adapter is exactly the configured aggregator (RPG + server Adam) applied to the two updates
    expected = aggregator_from_config(args, 2).aggregate(initial, updates, 0)
    assert set(history[0].weights) == {update.client_id for update in updates} == {"client_0", "client_1"}
    for key, value in runner.global_state.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)
        assert value.dtype == torch.float32

    # evaluation generated from image prompts, per geometric primitive in the paper's column order
    for results in runner.evaluations.values():
        assert list(results["accuracy"]) == ["points", "lines", "circles", "polygons", "Total"]
        assert results["count"]["Total"] == len(geoqa["test"])


def _fgrpo_script():
    spec = importlib.util.spec_from_file_location("fgrpo_script", REPO / "examples" / "scripts" / "fgrpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fgrpo_script_runs_the_paper_recipe_on_a_tiny_vlm(tmp_path, tiny_vlm_dir):
    """The GEOQA recipe as shipped, shrunk to CPU size on the command line: LoRA on the decoder only, per the paper."""
    output_dir = tmp_path / "fgrpo"
    argv = [
        "--config", str(REPO / "examples" / "configs" / "paper" / "fgrpo-geoqa.yaml"),
        "--model_name_or_path", str(tiny_vlm_dir), "--dtype", "float32", "--benchmark_source", str(GEOQA_FIXTURE),
        "--output_dir", str(output_dir), "--num_clients", "2", "--dirichlet_alpha", "inf",
        "--num_rounds", "1", "--local_steps", "1", "--reward_window", "1",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--per_device_eval_batch_size", "4", "--use_cpu", "true", "--bf16", "false",
        "--gradient_checkpointing", "false",
    ]  # fmt: skip
    script = _fgrpo_script()
    training_args, model_args, data_args = script.make_parser(argv).parse_args_and_config(argv)
    script.main(training_args, model_args, data_args)

    adapter = load_file(output_dir / "adapter_model.safetensors")
    assert adapter and all(".language_model." in key for key in adapter)  # the vision tower is left alone
    projections = {key.split(".")[-3] for key in adapter}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    config = json.loads((output_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (32, 128)
    summary = (output_dir / "summary.md").read_text()
    assert "| | points | lines | circles | polygons | Total |" in summary
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in adapter.values())
    assert f"({nbytes:,} bytes, its adapter)" in summary
