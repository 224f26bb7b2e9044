"""Baselines and GRPO-family variants on the tiny model: FedProx's gradient, DAPO/GSPO federated rounds."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import FAST_GRPO, length_reward
from trl_federated import FederatedRunner, FedGRPOConfig
from trl_federated.aggregation import FedAvgAggregator, aggregator_from_config
from trl_federated.config import DEFAULT_FEDPROX_MU, FedDAPOConfig, FedGSPOConfig
from trl_federated.local.local_trainer import ProximalTerm

PROMPTS = Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(16)]})


def test_fedprox_term_is_mu_times_the_distance_to_the_round_start():
    """μ (θ − θ^{[t]}) as a loss term: gradient exactly that, value 0 (the logged loss stays the GRPO loss); that it
    reaches every engine's step once is `test_engines`'."""
    model = torch.nn.Linear(3, 2)
    term = ProximalTerm(mu=0.5)
    term.on_train_begin(None, None, None, model=model)
    start = [param.detach().clone() for param in model.parameters()]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    term.on_step_begin(None, None, None)
    loss = term.loss_term()
    loss.backward()
    assert loss.item() == 0.0
    for param, theta0 in zip(model.parameters(), start):
        torch.testing.assert_close(param.grad, 0.5 * (param.detach() - theta0), atol=0, rtol=0)


def test_fedprox_aggregates_like_fedavg(fast_args):
    args = fast_args(aggregation="fedprox")
    assert args.fedprox_mu == DEFAULT_FEDPROX_MU
    assert isinstance(aggregator_from_config(args), FedAvgAggregator)
    assert fast_args().fedprox_mu == 0.0


# FedProx's μ where a text states it: "μ = 0.1", "μ 0.1", "`fedprox_mu`, default 0.1", "None: 0.1 with ..." (not the
# Dirichlet μ, which a text names as such).
FEDPROX_MU_STATED = re.compile(
    r"(?<!Dirichlet )(?<!Dirichlet\()(?:μ\s*=?\s*|fedprox_mu`?,? default |None`?: )(\d[\d.e-]*)"
)


def fedprox_statements(text: str) -> list[str]:
    """The FedProx μ values stated on the lines of `text` about FedProx or its proximal term."""
    return [value for line in text.splitlines() if re.search("fedprox|proximal", line, re.IGNORECASE)
            for value in FEDPROX_MU_STATED.findall(line)]


def test_fedprox_default_is_one_documented_value():
    """The paper gives no μ: the config's default, its help and docstring, the paper recipe and every line of the
    README and the docs pages about FedProx state one value."""
    root = Path(__file__).resolve().parent.parent
    docstring = FedGRPOConfig.__doc__.split("fedprox_mu (`float`")[1].split("scaffold_correction (")[0]
    recipe_text = (root / "examples" / "configs" / "paper" / "fedprox.yaml").read_text()
    readme = (root / "README.md").read_text()
    docs = "\n".join(path.read_text() for path in sorted((root / "docs").glob("*.md")))
    help_text = FedGRPOConfig.__dataclass_fields__["fedprox_mu"].metadata["help"]
    statements = {
        "the field's help": FEDPROX_MU_STATED.findall(help_text),
        "the docstring": FEDPROX_MU_STATED.findall(docstring),
        "the recipe": [str(yaml.safe_load(recipe_text)["fedprox_mu"]), *fedprox_statements(recipe_text)],
        "the README": fedprox_statements(readme),
        "the docs": fedprox_statements(docs),
    }
    for place, values in statements.items():
        assert values, f"{place} states no FedProx μ"
        assert {float(value.rstrip(".")) for value in values} == {DEFAULT_FEDPROX_MU}, (place, values)
    assert FedGRPOConfig(output_dir="unused", bf16=False, aggregation="fedprox").fedprox_mu == DEFAULT_FEDPROX_MU


def test_dapo_and_gspo_recipes():
    dapo = FedDAPOConfig(output_dir="unused", bf16=False)
    assert (dapo.loss_type, dapo.epsilon_high, dapo.mask_truncated_completions, dapo.beta) == ("dapo", 0.28, True, 0.0)
    gspo = FedGSPOConfig(output_dir="unused", bf16=False)
    assert (gspo.importance_sampling_level, gspo.epsilon, gspo.epsilon_high) == ("sequence", 3e-4, 4e-4)
    assert gspo.steps_per_generation > 1  # off-policy steps, or GSPO's ratio is always 1
    assert isinstance(dapo, FedGRPOConfig) and dapo.reward_window == 5


@pytest.mark.parametrize("config_class", [FedDAPOConfig, FedGSPOConfig])
@pytest.mark.parametrize("aggregation", ["rpg", "fedavg"])
def test_variant_trains_one_federated_round(tmp_path, tiny_model_dir, tiny_tokenizer, config_class, aggregation):
    args = config_class(
        **FAST_GRPO, output_dir=str(tmp_path), num_rounds=1, local_steps=2, reward_window=2, aggregation=aggregation,
        server_optimizer="adam",
    )
    clients = [PROMPTS.select(range(0, 8)), PROMPTS.select(range(8, 16))]
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, clients,
        processing_class=tiny_tokenizer,
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    (record,) = runner.run()
    assert set(record.rewards) == {"client_0", "client_1"}
    assert all(len(m["step_rewards"]) == 2 for m in record.client_metrics.values())
    assert any(not torch.equal(initial[k], runner.global_state[k]) for k in initial)


