"""Record-level DP-SGD in the clients' local steps (`local.record_privacy`): the step's gradient against its equation,
the accountant against dp-accounting, the sampler, what a client sends, and the settings it refuses."""

import json
import math

import pytest
import torch
from datasets import Dataset
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOTrainer, RLOOConfig, RLOOTrainer

from conftest import FAST_GRPO
from trl_federated import FederatedRunner
from trl_federated.aggregation.privacy import append_ledger_line
from trl_federated.config import federated_config
from trl_federated.core.callbacks import read_metrics
from trl_federated.local.local_trainer import local_trainer
from trl_federated.local.record_privacy import (
    RECORD_LEDGER,
    RecordSampler,
    calibrated_noise_multiplier,
    ledger_epsilon,
    read_ledger,
    round_releases,
)


def bounded_length_reward(completions, **kwargs):
    return [min(len(completion) / 64, 1.0) for completion in completions]


bounded_length_reward.reward_range = (0.0, 1.0)


def prompts(count, client=0):
    questions = [f"Client {client} asks: what is {i} times {client + 2}?" for i in range(count)]
    return Dataset.from_dict({"prompt": questions})


class StepGradient(TrainerCallback):
    """Keeps the gradient the optimizer is about to step on, and, from the micro-batches the step trained on, what
    the equation g̃ = Σ_r clip(g_r) / b gives without noise, with the trainer's own record loss."""

    def __init__(self, trainer):
        self.trainer, self.micro_batches = trainer, []
        self.applied = self.expected = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer
        params = trainer.private_parameters
        self.applied = torch.cat([param.grad.flatten().clone() for param in params])
        rows = {}
        for batch in self.micro_batches:
            for record in batch["record_index"].unique().tolist():
                rows.setdefault(record, []).append((batch, batch["record_index"] == record))
        total = torch.zeros_like(self.applied)
        for parts in rows.values():
            gradient = torch.zeros_like(self.applied)
            for batch, mask in parts:
                record_inputs = {key: value[mask] if isinstance(value, torch.Tensor) and value.ndim else value
                                 for key, value in batch.items() if key != "record_index"}
                loss = trainer.data_loss(model, record_inputs) * args.gradient_accumulation_steps
                gradient += torch.cat([grad.flatten() for grad in torch.autograd.grad(loss, params)])
            total += gradient * min(1.0, trainer.record_clip_norm / float(gradient.norm()))
        self.expected = total / trainer.records_per_batch


def one_private_step(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, trainer_class=GRPOTrainer, **overrides):
    settings = dict(num_clients=1, local_steps=1, reward_window=1, max_steps=1, gradient_accumulation_steps=2,
                    max_grad_norm=1e9, dp_noise_seed=3, output_dir=str(tmp_path / "client"), **overrides)
    if trainer_class is RLOOTrainer:
        args = federated_config(RLOOConfig)(**{**FAST_GRPO, "seed": 0, **settings})
    else:
        args = fast_args(**settings)
    trainer_class = local_trainer(trainer_class, args)

    class Recording(trainer_class):
        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            probe.micro_batches.append(inputs)
            return inputs

    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = Recording(model=model, reward_funcs=bounded_length_reward, args=args, train_dataset=prompts(6),
                        processing_class=tiny_tokenizer,
                        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    probe = StepGradient(trainer)
    trainer.add_callback(probe)
    trainer.train()
    return trainer, probe


@pytest.mark.parametrize(("trainer_class", "options"), [
    (GRPOTrainer, {}), (RLOOTrainer, {}), (GRPOTrainer, {"gradient_checkpointing": True}),
    (GRPOTrainer, {"loss_type": "bnpo", "beta": 0.05}),
])
def test_the_step_follows_the_dp_sgd_equation_with_each_record_clipped_over_its_micro_batches(
        tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, trainer_class, options):
    # 2 prompts x 4 completions a step, in 2 micro-batches that TRL shuffled: a record's rows span both. A clip norm
    # far below every record's gradient norm clips them all; σ ≈ 0 leaves the equation's value. RLOO's own loss,
    # TRL's gradient checkpointing (its default), a token-normalised loss with a KL term too.
    trainer, probe = one_private_step(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, trainer_class,
                                      dp_record_noise_multiplier=1e-12, dp_record_clip_norm=1e-4, **options)
    assert trainer.records_per_batch == 2 and len(probe.micro_batches) == 2
    assert len(trainer.record_norms) == 1 and min(trainer.record_norms[0]) > 1e-4  # every record clipped
    assert torch.allclose(probe.applied, probe.expected, rtol=1e-4, atol=1e-10)
    assert probe.applied.norm() <= 1e-4 * (1 + 1e-5)


def test_the_noise_has_std_two_sigma_c_over_b(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    trainer, probe = one_private_step(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args,
                                      dp_record_noise_multiplier=0.5, dp_record_clip_norm=1e-3)
    noise = probe.applied - probe.expected
    assert noise.numel() > 4_000  # the std to about 1%
    assert noise.std().item() == pytest.approx(2 * 0.5 * 1e-3 / 2, rel=0.05)
    assert abs(noise.mean().item()) < 4 * noise.std().item() / math.sqrt(noise.numel())


def expected_epsilon(entries, delta=1e-5):
    """ε of `entries` composed as the module's docstring says, round by round, with dp-accounting directly."""
    accountant = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    for entry in entries:
        step = [dp_event.GaussianDpEvent(entry["noise_multiplier"])]
        if entry["step_reward_noise_multiplier"] is not None:  # each step's reward, released with its gradient
            step.append(dp_event.GaussianDpEvent(entry["step_reward_noise_multiplier"]))
        steps = dp_event.SelfComposedDpEvent(dp_event.ComposedDpEvent(step), entry["steps_per_batch"])
        batch = dp_event.SampledWithoutReplacementDpEvent(entry["dataset_size"], entry["sample_size"], steps)
        accountant.compose(batch, entry["generation_batches"])
    return accountant.get_epsilon(delta)


def test_the_accountant_composes_what_the_docstring_says_with_dp_accounting():
    entries = [round_releases(3, 40, 2, 1, 1.1, 1.1), round_releases(2, 40, 2, 2, 0.9, None)]
    assert ledger_epsilon(entries, 1e-5) == pytest.approx(expected_epsilon(entries), rel=1e-9)
    assert ledger_epsilon([], 1e-5) == 0.0
    # equal rounds in a row are composed once with their count (a long run's ledger costs no more): the same ε
    repeated = [entries[0]] * 3 + [entries[1]]
    assert ledger_epsilon(repeated, 1e-5) == pytest.approx(expected_epsilon(repeated), rel=1e-9)
    # more rounds, more ε; a larger sample of the same data, more ε; R̄'s release costs something
    assert ledger_epsilon(entries[:1], 1e-5) < ledger_epsilon(entries, 1e-5)
    assert ledger_epsilon([round_releases(3, 40, 4, 1, 1.1, 1.1)], 1e-5) > ledger_epsilon(entries[:1], 1e-5)
    assert ledger_epsilon([round_releases(3, 40, 2, 1, 1.1, None)], 1e-5) < ledger_epsilon(entries[:1], 1e-5)


def test_releasing_the_step_rewards_within_the_sampled_steps_is_amplified():
    # R̄ released once a round outside the sampling (a plain Gaussian of σ_R), against every step's reward released
    # with its sampled step: at b/N = 2/1000 over 30 rounds, the former alone costs more than everything else
    dataset, rounds = 1000, 30
    within = [round_releases(10, dataset, 2, 1, 1.0, 1.0)] * rounds
    accountant = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_event.GaussianDpEvent(1.0), rounds)
    assert accountant.get_epsilon(1e-5) > 2 * ledger_epsilon(within, 1e-5)


def test_the_calibrated_noise_is_the_least_within_the_budget():
    sigma = calibrated_noise_multiplier(2.0, 1e-5, 3, 2, 100, 2, 1, None)

    def epsilon(noise):
        return ledger_epsilon([round_releases(2, 100, 2, 1, noise, noise)] * 3, 1e-5)

    assert epsilon(sigma) <= 2.0 + 1e-6 and epsilon(sigma * 0.98) > 2.0


def test_every_batch_is_a_fresh_uniform_sample_without_replacement():
    sampler = RecordSampler(10, 3, mini_repeat_count=2, repeat_count=2, generator=torch.Generator().manual_seed(0))
    indices = list(sampler)
    assert len(indices) == len(sampler) == 3 * 3 * 2 * 2
    batches = [indices[start:start + 12] for start in range(0, len(indices), 12)]
    for batch in batches:  # each prompt twice in a row, the batch twice: TRL's layout
        prompts_of_batch = batch[:6:2]
        assert batch[:6] == [index for index in prompts_of_batch for _ in range(2)] and batch[6:] == batch[:6]
        assert len(set(prompts_of_batch)) == 3
    counts = torch.zeros(10)
    generator = torch.Generator().manual_seed(1)
    for _ in range(400):
        for index in list(RecordSampler(10, 3, 1, 1, generator))[:3]:
            counts[index] += 1
    assert counts.min() > 0.7 * 120 and counts.max() < 1.3 * 120  # 400 batches x 3 / 10 each, about
    with pytest.raises(ValueError, match="at least as many prompts as a batch holds"):
        RecordSampler(2, 3, 1, 1, torch.Generator())


@pytest.mark.parametrize("client_trainer", [GRPOTrainer, "FedGRPOTrainer"])
def test_a_client_sends_its_noised_reward_and_its_epsilon_alone_and_keeps_a_ledger(
        tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, client_trainer):
    # FedGRPOTrainer, the CLI's client trainer, accounts a single trainer's run itself: not a client's round twice
    from trl_federated import FedGRPOTrainer

    args = fast_args(num_clients=2, dp_record_noise_multiplier=1.0, dp_noise_seed=5, eval_initial=False,
                     output_dir=str(tmp_path / "run"))
    runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), bounded_length_reward, args,
                             [prompts(5, client) for client in range(2)], processing_class=tiny_tokenizer,
                             report_header="",
                             trainer_class=FedGRPOTrainer if client_trainer == "FedGRPOTrainer" else client_trainer)
    records = runner.run()
    lines = [line for line in read_metrics(tmp_path / "run" / "metrics.jsonl") if line.get("event") == "round"]
    worst = [record.dp_record_epsilon_worst for record in records]
    assert 0 < worst[0] < worst[1] and [line["dp_record_epsilon_worst"] for line in lines] == worst
    for client_id, metrics in records[-1].client_metrics.items():
        assert set(metrics) == {"train_seconds", "wall_clock", "record_epsilon"}
        ledger = read_ledger(tmp_path / "run" / "clients" / client_id / RECORD_LEDGER)
        assert len(ledger) == 2 and ledger[0] == round_releases(2, 5, 1, 1, 1.0, 1.0)
        assert metrics["record_epsilon"] == pytest.approx(ledger_epsilon(ledger, args.dp_target_delta))
    assert max(records[-1].client_metrics[client]["record_epsilon"] for client in records[-1].client_metrics) \
        == worst[-1]
    card = (tmp_path / "run" / "README.md").read_text()
    assert "Differential privacy | record-level (DP-SGD in each client's local steps" in card
    assert f"worst ε reported by a client = {worst[-1]:.3f} at δ = 1e-05" in card
    # R̄ leaves the client noised (std σ B / b = 1 here), then clamped to [0, 1]: at an end, or not a mean of rewards
    # that are multiples of 1/64 over 4 completions (the reward's own grid)
    sent = [reward for record in records for reward in record.rewards.values()]
    assert all(0 <= reward <= 1 for reward in sent)
    assert all(reward in (0.0, 1.0) or abs(reward * 256 - round(reward * 256)) > 1e-6 for reward in sent)


def test_record_level_dp_composes_with_client_level_dp(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(num_clients=2, num_rounds=1, dp_record_noise_multiplier=1.0, dp_noise_multiplier=1.0,
                     dp_noise_seed=5, eval_initial=False, aggregation="rpg")
    runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), bounded_length_reward, args,
                             [prompts(5, client) for client in range(2)], processing_class=tiny_tokenizer,
                             report_header="")
    (record,) = runner.run()
    assert record.dp_epsilon > 0 and record.dp_record_epsilon_worst > 0
    assert set(record.dp_rewards) == {"client_0", "client_1"}  # R̃ released twice: by each client, then the server


def test_a_redone_round_draws_fresh_noise_and_counts_in_the_ledger(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                   fast_args):
    from trl_federated.local.record_privacy import secret_generator

    args = fast_args(dp_record_noise_multiplier=1.0, dp_noise_seed=5)
    first, again = (torch.randn(4, generator=secret_generator(args, "noise", ordinal)) for ordinal in (0, 1))
    assert not torch.equal(first, again)
    unseeded = fast_args(dp_record_noise_multiplier=1.0)
    assert not torch.equal(*(torch.randn(4, generator=secret_generator(unseeded, "noise", 0)) for _ in range(2)))
    ledger = tmp_path / RECORD_LEDGER
    ledger.write_text(json.dumps(round_releases(2, 5, 1, 1, 1.0, 1.0)) + "\n" + '{"generation_b')
    assert len(read_ledger(ledger)) == 1  # a torn last line: that update never left the client
    append_ledger_line(ledger, round_releases(2, 5, 1, 1, 1.0, 1.0))  # cut off, not joined: the new round counts
    assert len(read_ledger(ledger)) == 2


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(dp_record_noise_multiplier=1.0, dp_record_epsilon=8.0), "not both"),
        (dict(dp_record_noise_multiplier=-1.0), "`dp_record_noise_multiplier` must be > 0"),
        (dict(dp_record_epsilon=8.0, dp_record_clip_norm=0.0), "`dp_record_clip_norm` must be > 0"),
        (dict(dp_record_epsilon=8.0, scale_rewards="batch"), "`scale_rewards`"),
        (dict(dp_record_epsilon=8.0, gradient_accumulation_steps=2, steps_per_generation=4),
         "`steps_per_generation`"),
        (dict(dp_record_epsilon=8.0, top_entropy_quantile=0.5), "`top_entropy_quantile`"),
        (dict(dp_record_epsilon=8.0, aggregation="rpg", rpg_gain="noise-aware"), "noise-aware"),
    ],
)
def test_bad_record_privacy_settings_are_refused_by_name(fast_args, settings, named):
    with pytest.raises(ValueError, match=named):
        fast_args(**settings)


def test_a_single_trainer_trains_privately_too_and_says_its_epsilon(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                    fast_args):
    # The drop-in FedGRPOTrainer with one client: DP-SGD on its own, with its ledger; before, the fields were ignored
    from peft import LoraConfig

    from trl_federated import FedGRPOTrainer
    from trl_federated.local.record_privacy import RecordPrivacyMixin

    args = fast_args(num_clients=1, max_steps=2, dp_record_noise_multiplier=1.0, output_dir=str(tmp_path / "one"))
    trainer = FedGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                             reward_funcs=bounded_length_reward, args=args, train_dataset=prompts(6),
                             processing_class=tiny_tokenizer, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert isinstance(trainer, RecordPrivacyMixin)
    output = trainer.train()
    ledger = read_ledger(tmp_path / "one" / RECORD_LEDGER)
    assert ledger == [round_releases(2, 6, 1, 1, 1.0, None)]
    assert output.metrics["record_epsilon"] == pytest.approx(ledger_epsilon(ledger, args.dp_target_delta))
    assert output.metrics["record_epsilon"] > 0


def test_dp_without_its_extra_is_refused_in_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    # Without the `dp` extra every client used to fail at its first round (ModuleNotFoundError, no hint); now the
    # config refuses in one line with the `pip install` that fixes it, before the output folder or the model is touched
    import trl_federated.config.checks as checks
    from trl_federated.cli import main

    installed = checks.find_spec
    monkeypatch.setattr(checks, "find_spec", lambda name: None if name == "dp_accounting" else installed(name))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--output_dir", str(tmp_path / "out"), "--bf16", "false", "--use_cpu", "true",
              "--dp_record_epsilon", "8"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "trl-federated run: error: `dp_record_epsilon` accounts privacy with Google's `dp-accounting`, which is not "
        "installed: pip install -e '.[dp]' in this package's clone (the `dp` extra: dp-accounting).\n"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"`dp_noise_multiplier` accounts .* pip install -e '\.\[dp\]'"):
        federated_config(RLOOConfig)(output_dir=str(tmp_path), use_cpu=True, bf16=False, dp_noise_multiplier=1.0,
                                     num_clients=3)
