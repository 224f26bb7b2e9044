"""Shared fixtures: a tiny real model and tokenizer built offline, a tiny vision-language model, the paper's
datasets as small offline fixtures, and a fast CPU GRPO configuration."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_federated import FastGRPOMixin, FedGRPOConfig, FedGRPOTrainer
from trl_federated.testing import save_tiny_model, save_tiny_vlm

FIXTURES = Path(__file__).parent / "fixtures"
OPEN_R1_FIXTURE = FIXTURES / "open_r1"  # Multimodal-Open-R1-8k-Verified's schema, 27 rows (3 without <answer>)
GEOQA_FIXTURE = FIXTURES / "geoqa"  # EasyR1's copy (GEOQA_8K_R1V): its schema and splits, 20 + 4 rows
GEOQA_R1V_FIXTURE = FIXTURES / "geoqa_r1v"  # R1-V's copy (GEOQA_R1V_Train_8K) of the same 24 problems, one split

# The tiny model gains nothing from intra-op threads, and two busy processes each spinning two threads on a
# 2-core machine run 20x slower: one thread keeps test times stable.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen2 (hidden 32) and a locally trained tokenizer, saved once per session."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny LLaVA-layout vision-language model (CLIP tower, Qwen2 decoder) and its processor, saved once."""
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture
def tiny_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def length_reward(completions, **kwargs):
    """Varies on random text, so GRPO gets a learning signal from an untrained model (its EOS never comes)."""
    return [len(completion) / 64 for completion in completions]


class FastFedGRPOTrainer(FastGRPOMixin, FedGRPOTrainer):
    """`FedGRPOTrainer` with the speed-ups' mixin whatever its config turns on."""


def relative_difference(value, reference):
    """‖value − reference‖ / ‖reference‖, a float."""
    return ((value - reference).norm() / reference.norm()).item()


# GRPO settings that train the tiny model in well under a second per step on CPU.
FAST_GRPO = dict(
    bf16=False,
    use_cpu=True,
    gradient_checkpointing=False,
    report_to="none",
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=12,
    learning_rate=1e-2,
    logging_steps=1,
)


@pytest.fixture
def fast_args(tmp_path):
    """A FedGRPOConfig factory on FAST_GRPO: 2 rounds of 2 local steps unless overridden."""

    def make(**overrides):
        values = dict(FAST_GRPO, output_dir=str(tmp_path / "run"), num_rounds=2, local_steps=2, reward_window=2, seed=0)
        values.update(overrides)
        return FedGRPOConfig(**values)

    return make


@pytest.fixture
def registries_as_recorded(monkeypatch):
    """The registries of choice names (`choices.AGGREGATIONS`, `SERVER_OPTIMIZERS`) without the names that tests
    register in this process (`own_methods`, test_stateful_aggregator.py), as a fresh `trl-federated run` sees them:
    the names `known_parsers.json` records, which tests/test_cli.py checks in a fresh interpreter."""
    from trl_federated import choices
    from trl_federated.arguments import flags

    recorded = json.loads(flags.KNOWN_PARSERS.read_text(encoding="utf-8"))["actions"]
    for record in recorded:
        registry_name, recorded_choices = record[7], record[6]
        if registry_name is not None:
            registry = getattr(choices, registry_name)
            for name in [name for name in registry if name not in recorded_choices]:
                monkeypatch.delitem(registry, name)
