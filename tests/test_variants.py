"""Baselines and GRPO-family variants on the tiny model: FedProx's gradient, DAPO/GSPO federated rounds."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import FAST_GRPO, length_reward
from trl_federated import FederatedRunner, FedGRPOConfig, FedGRPOTrainer
from trl_federated.adapters import default_lora_config
from trl_federated.aggregation import FedAvgAggregator, aggregator_from_config
from trl_federated.config import DEFAULT_FEDPROX_MU, FedDAPOConfig, FedGSPOConfig
from trl_federated.local_trainer import ProximalTerm

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


def test_scaffold_server_step_by_hand():
    """θ and c take the same data-volume weights: c = Σ_i p_i c_i, so with every client reporting Σ_i ω_i (c − c_i) = 0
    after every round (partial participation: `test_client_sampling.py`)."""
    from trl_federated import ClientUpdate, FedGRPOConfig
    from trl_federated.aggregation import aggregator_from_config

    args = FedGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, aggregation="scaffold", num_clients=2)
    aggregator = aggregator_from_config(args)
    global_state = {"w": torch.tensor([0.0, 0.0])}

    def round_of(deltas):
        updates = [
            ClientUpdate("a", {"w": torch.tensor([1.0, 0.0])}, 1, 0.0, extras={"control_delta": {"w": deltas[0]}}),
            ClientUpdate("b", {"w": torch.tensor([0.0, 1.0])}, 3, 0.0, extras={"control_delta": {"w": deltas[1]}}),
        ]
        for update in updates:  # as the server admits them: c_i ← c_i + Δc_i
            aggregator.accept(update)
        return aggregator.aggregate(global_state, updates, 0)

    new = round_of([torch.tensor([0.4, 0.0]), torch.tensor([0.0, -0.8])])
    torch.testing.assert_close(new["w"], torch.tensor([0.25, 0.75]))  # ω = (1/4, 3/4)
    # c = 1/4 c_a + 3/4 c_b
    torch.testing.assert_close(aggregator.control["w"], torch.tensor([0.1, -0.6]))
    round_of([torch.tensor([-0.2, 0.6]), torch.tensor([0.2, 0.4])])
    weights, control = aggregator.last_weights, aggregator.control["w"]
    drift = sum(weights[client] * (control - aggregator.client_controls[client]["w"]) for client in weights)
    torch.testing.assert_close(drift, torch.zeros(2))
    # the checkpointed state carries the sizes; one written before them still loads, and learns them
    restored = aggregator_from_config(args)
    restored.load_state_dict({**aggregator.state_dict(), "client_sizes": {}})
    assert restored.client_sizes == {} and aggregator.state_dict()["client_sizes"] == {"a": 1, "b": 3}
    with pytest.raises(ValueError, match="control_delta"):
        aggregator.aggregate(global_state, [ClientUpdate("a", {"w": torch.zeros(2)}, 1, 0.0)], 1)


@pytest.mark.parametrize("mode", ["decoupled", "gradient"])
def test_scaffold_client_correction_and_control_update_by_hand(tiny_model_dir, tiny_tokenizer, fast_args, mode):
    """Constant learning rate η, K steps: c_i⁺ = c_i − c + (θ^t − θ_i)/(Kη)."""
    from peft import get_peft_model_state_dict

    from trl_federated.aggregation.scaffold import ScaffoldCorrection

    lr, steps = 1e-2, 3
    args = fast_args(max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = FedGRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=PROMPTS, processing_class=tiny_tokenizer,
        peft_config=default_lora_config(),
    )
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    generator = torch.Generator().manual_seed(0)
    c = {k: 1e-3 * torch.randn(v.shape, generator=generator) for k, v in adapter.items()}
    c_i = {k: 1e-3 * torch.randn(v.shape, generator=generator) for k, v in adapter.items()}
    scaffold = ScaffoldCorrection(c, c_i, mode)
    trainer.add_callback(scaffold)
    trainer.train()
    final = {k: v.detach() for k, v in get_peft_model_state_dict(trainer.model).items()}

    # The correction of each step: `test_engines.test_a_loss_term_adds_its_gradient_once_per_optimizer_step`.
    assert scaffold.learning_rate_sum == pytest.approx(steps * lr)
    for key in adapter:
        expected_delta = -c[key] + (adapter[key] - final[key]) / (steps * lr)  # c_i⁺ − c_i
        torch.testing.assert_close(scaffold.control_delta[key], expected_delta)


def test_scaffold_federated_rounds_keep_client_controls(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(aggregation="scaffold", server_optimizer="sgd", num_rounds=2, local_steps=2, reward_window=1)
    clients = [PROMPTS.select(range(0, 8)), PROMPTS.select(range(8, 16))]
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, clients,
        processing_class=tiny_tokenizer,
    )
    runner.run()
    client_controls = runner.aggregator.client_controls
    assert set(client_controls) == {"client_0", "client_1"}
    assert runner.aggregator.client_sizes == {"client_0": 8, "client_1": 8}
    control = runner.aggregator.control
    # c = Σ p_i c_i, p_i ∝ D_i: with equal data, the mean of the clients' c_i
    for key in control:
        mean = (client_controls["client_0"][key] + client_controls["client_1"][key]) / 2
        torch.testing.assert_close(control[key], mean)
    assert any(value.abs().sum() > 0 for value in control.values())
