"""Parity over GRPOTrainer's options: for each option, `GRPOTrainer` with a `GRPOConfig` and `FedGRPOTrainer` with a
single-client `FedGRPOConfig` of the same field values, on the same seed, log exactly the same steps; and with
`num_clients=2` the option either runs a federated round whose clients log what GRPOTrainer logs, or is refused by
name when the trainer is built."""

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, set_seed
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen2_5_chat_template

from conftest import FAST_GRPO, GEOQA_FIXTURE
from trl_federated import FedGRPOConfig, FedGRPOTrainer
from trl_federated.data import build_geoqa_benchmark
from trl_federated.runtime.models import load_model_and_tokenizer
from trl_federated.scoring.rewards import completion_text


def lora():
    """A fresh LoRA configuration: PEFT writes the modules it resolved back into the one it is given."""
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")

# The fields where FedGRPOConfig's defaults are Algorithm 1's, not TRL's: given explicitly, both configs hold the same.
TRL_DEFAULTS = {name: GRPOConfig.__dataclass_fields__[name].default for name in ("loss_type", "lr_scheduler_type")}
# Logged per step but not a result of training.
UNTIMED = ("step_time",)
SEED = 3


def text_length_reward(completions, **kwargs):
    """Varies on the tiny model's random text, standard or conversational, so every step has a gradient."""
    return [len(completion_text(completion)) / 64 for completion in completions]


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in completion_text(completion)) / 8 for completion in completions]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class CounterEnvironment:
    """A tiny deterministic environment (TRL's `environment_factory`): `reset` appends a fixed line to the prompt,
    `add` is its tool, and `get_reward` scores a rollout by its tool calls."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs):
        self.calls = 0
        return "You may call `add`."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def standard_prompts(n=8):
    return Dataset.from_dict(
        {"prompt": [f"What is {i} + {2 * i}?" for i in range(n)], "difficulty": ["easy", "hard"] * (n // 2)}
    )


def conversational_prompts(n=8):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} times 3?"}] for i in range(n)],
            "difficulty": ["easy", "hard"] * (n // 2),
        }
    )


@dataclass
class Case:
    """One option of GRPOTrainer: config fields, trainer arguments and data; `refused` is the error federated mode
    raises for it (a regular expression), None when it federates."""

    config: dict[str, Any] = field(default_factory=dict)
    data: str = "standard"  # "standard", "conversational" or "images"
    rewards: str = "length"  # "length", "weighted" (two functions with weights) or "model"
    peft: str = "config"  # "config" (peft_config), "model" (a PeftModel) or "none" (full model)
    tools: bool = False
    environment: bool = False  # `environment_factory=CounterEnvironment` (conversational data and tool tokenizer)
    optimizer: bool = False
    refused: str | None = None


CASES = {
    **{f"loss_type={loss}": Case(config={"loss_type": loss})
       for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")},
    "loss_type=luspo": Case(config={"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    "importance_sampling_level=sequence": Case(config={"loss_type": "grpo", "importance_sampling_level": "sequence"}),
    "epsilon_high,mask_truncated_completions": Case(config={"epsilon_high": 0.28, "mask_truncated_completions": False}),
    "num_iterations=2": Case(config={"num_iterations": 2}),
    "steps_per_generation=2": Case(config={"steps_per_generation": 2}),
    "gradient_accumulation_steps=2": Case(config={"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}),
    "beta=0.1": Case(config={"beta": 0.1}),
    "scale_rewards=batch,top_entropy_quantile": Case(config={"scale_rewards": "batch", "top_entropy_quantile": 0.5}),
    "reward_weights": Case(rewards="weighted", config={"reward_weights": [0.3, 2.0]}),
    "multi_objective_aggregation": Case(
        rewards="weighted", config={"reward_weights": [0.3, 2.0], "multi_objective_aggregation": "normalize_then_sum"}
    ),
    "reward_model": Case(rewards="model"),
    "conversational": Case(data="conversational"),
    "tools": Case(data="conversational", tools=True),
    "environment_factory": Case(data="conversational", environment=True),
    "multimodal": Case(data="images", config={"partition_column": "category"}),
    "peft_model": Case(peft="model"),
    "full_model": Case(peft="none", refused="peft_config"),
    "optimizers": Case(peft="model", optimizer=True, refused="`optimizers` cannot be federated"),
    # TRL refuses sync_ref_model with PEFT, so it runs on a full model, which a federation refuses.
    "sync_ref_model": Case(peft="none", config={"beta": 0.1, "sync_ref_model": True}, refused="peft_config"),
}


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_model_dir):
    """The tiny tokenizer with Qwen2.5's chat template, for which TRL knows how to parse tool calls."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir):
    """A tiny sequence-classification reward model (the tiny decoder with a random score head), shared by both
    trainers of a comparison so that they score with the same weights."""
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)


@pytest.fixture(scope="module")
def geoqa():
    return build_geoqa_benchmark(str(GEOQA_FIXTURE))


def trainer_inputs(case, tiny_model_dir, tiny_vlm_dir, tiny_tokenizer, tool_tokenizer, reward_model, geoqa):
    """Fresh model and arguments of one trainer for `case`."""
    if case.data == "images":
        model, processing_class = load_model_and_tokenizer(str(tiny_vlm_dir))
        dataset = geoqa["train"]
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        processing_class = tool_tokenizer if case.tools or case.environment else tiny_tokenizer
        dataset = standard_prompts() if case.data == "standard" else conversational_prompts()
    rewards = {
        "length": text_length_reward,
        "weighted": [text_length_reward, digit_reward],
        "model": [text_length_reward, reward_model],
    }[case.rewards]
    kwargs = dict(
        model=model, reward_funcs=rewards, train_dataset=dataset, processing_class=processing_class,
    )  # fmt: skip
    if case.peft == "config":
        kwargs["peft_config"] = lora()
    elif case.peft == "model":
        # LoRA draws its initialisation from the global generator, as GRPOTrainer seeds it for peft_config
        set_seed(SEED)
        kwargs["model"] = model = get_peft_model(model, lora())
    if case.rewards == "model":
        kwargs["reward_processing_classes"] = [None, tiny_tokenizer]
    if case.tools:
        kwargs["tools"] = [multiply]
    if case.environment:
        kwargs["environment_factory"] = CounterEnvironment
    if case.optimizer:
        optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=1e-2)
        kwargs["optimizers"] = (optimizer, None)
    return kwargs


def step_logs(trainer) -> list[dict[str, float]]:
    return [
        {key: value for key, value in entry.items() if key not in UNTIMED}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]


@pytest.fixture
def build(tiny_model_dir, tiny_vlm_dir, tiny_tokenizer, tool_tokenizer, reward_model, geoqa, tmp_path):
    def make(trainer_class, config_class, case, **overrides):
        values = dict(FAST_GRPO, **TRL_DEFAULTS, output_dir=str(tmp_path / config_class.__name__), seed=SEED)
        values.update(disable_tqdm=True, max_steps=2, **case.config, **overrides)
        if config_class is GRPOConfig:
            values.pop("partition_column", None)
        inputs = trainer_inputs(case, tiny_model_dir, tiny_vlm_dir, tiny_tokenizer, tool_tokenizer, reward_model, geoqa)
        return trainer_class(args=config_class(**values), **inputs)

    return make


_reference_logs: dict[str, list[dict[str, float]]] = {}


@pytest.fixture
def reference_logs(build):
    """The step logs of `GRPOTrainer` for a case, trained once per session."""

    def logs(name):
        if name not in _reference_logs:
            reference = build(GRPOTrainer, GRPOConfig, CASES[name])
            reference.train()
            _reference_logs[name] = step_logs(reference)
        return _reference_logs[name]

    return logs


@pytest.mark.parametrize("name", list(CASES))
def test_fed_trainer_logs_what_grpo_trainer_logs(build, reference_logs, name):
    drop_in = build(FedGRPOTrainer, FedGRPOConfig, CASES[name])
    drop_in.train()
    logs = reference_logs(name)
    assert len(logs) == 2
    assert step_logs(drop_in) == logs
    if CASES[name].environment:  # the environment scored every rollout, as a reward source of its own
        assert "rewards/CounterEnvironment/mean" in logs[0]
    # R̄'s steps are TRL's rewards; a step that reuses a generation batch logs none and is credited with that batch's
    assert drop_in.step_rewards == [entry.get("reward", logs[0]["reward"]) for entry in logs]


@pytest.mark.parametrize("name", list(CASES))
def test_each_option_federates_or_is_refused_by_name(build, reference_logs, name):
    case = CASES[name]
    federation = dict(num_clients=2, dirichlet_alpha=float("inf"), num_rounds=1, local_steps=2, reward_window=2)
    if case.refused is not None:
        with pytest.raises(ValueError, match=case.refused):
            build(FedGRPOTrainer, FedGRPOConfig, case, **federation)
        return
    trainer = build(FedGRPOTrainer, FedGRPOConfig, case, **federation)
    output = trainer.train()
    assert output.global_step == 2 * 2  # clients x local steps
    # Every client logged what GRPOTrainer logs for this option (kl with beta, one reward per function, tool calls...)
    logged = set(reference_logs(name)[0]) - {"loss", "reward", "step", "epoch"}
    (round_entry,) = [entry for entry in trainer.state.log_history if "client_0/reward_window" in entry]
    for client_id in ("client_0", "client_1"):
        assert {f"{client_id}/{name}" for name in logged} <= set(round_entry)


def test_sync_ref_model_of_a_federated_adapter_is_refused_by_trl(build):
    """A federation always trains an adapter, which TRL's reference-model sync does not support: it says so."""
    case = Case(config={"beta": 0.1, "sync_ref_model": True})
    with pytest.raises(NotImplementedError, match="sync_ref_model=True` while using a PEFT model"):
        build(FedGRPOTrainer, FedGRPOConfig, case, num_clients=2)
