"""The trainers the step benchmarks measure: a `FedGRPOTrainer` on a synthetic generation batch shaped as the
quickstart's (`build_trainer`, `generation_batch`: the shared-prefix and gated-MLP benchmarks), and the quickstart's
largest client with its model, adapter and rows, each measurement for today's path or fast generation (`Bench`: the
local step's speed and the bf16 loss's parity)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .timing import Phases, wall_seconds

PROMPT_LENGTH = 191  # the quickstart's one-shot prompts: ~143 real tokens, 191 padded
COMPLETION_LENGTH = 64


def build_trainer(model_path: str | None, output_dir: str, micro_batch: int):
    from datasets import Dataset

    from trl_federated import FedGRPOConfig, FedGRPOTrainer
    from trl_federated.adapters import default_lora_config
    from trl_federated.runtime.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_path)
    # `shared_prefix` on, so that the speed-ups' mixin joins the trainer (it joins only a trainer whose config turns
    # one on); each measurement then switches it, and `recompute_gated_mlp`, per step.
    args = FedGRPOConfig(
        output_dir=output_dir, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
        per_device_train_batch_size=micro_batch, num_generations=2, max_completion_length=COMPLETION_LENGTH,
        shared_prefix=True,
    )  # fmt: skip
    trainer = FedGRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * 4}), processing_class=tokenizer,
        peft_config=default_lora_config(),
    )  # fmt: skip
    trainer.model.train()
    return trainer


def generation_batch(trainer, num_prompts: int, group_size: int, micro_batch: int, seed: int) -> list[dict]:
    """A generation batch of `num_prompts` x `group_size` rows, shuffled and split into micro-batches."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size, pad_token_id = len(trainer.processing_class), trainer.processing_class.pad_token_id
    lengths = [PROMPT_LENGTH] + torch.randint(130, PROMPT_LENGTH + 1, (num_prompts - 1,), generator=generator).tolist()
    prompt_ids = torch.full((num_prompts, PROMPT_LENGTH), pad_token_id)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, length in enumerate(lengths):
        prompt_ids[row, -length:] = torch.randint(vocab_size, (length,), generator=generator)
        prompt_mask[row, -length:] = 1
    rows = num_prompts * group_size
    order = torch.randperm(rows, generator=generator)
    batch = {
        "prompt_ids": prompt_ids.repeat_interleave(group_size, dim=0)[order],
        "prompt_mask": prompt_mask.repeat_interleave(group_size, dim=0)[order],
        "completion_ids": torch.randint(vocab_size, (rows, COMPLETION_LENGTH), generator=generator),
        "completion_mask": torch.ones(rows, COMPLETION_LENGTH, dtype=torch.long),
        "advantages": torch.randn(rows, generator=generator),
    }
    micro_batches = [
        {key: value[start : start + micro_batch] for key, value in batch.items()}
        for start in range(0, rows, micro_batch)
    ]
    for inputs in micro_batches:
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    return micro_batches


class Bench:
    """The quickstart's client, model, adapter and rows, and each measurement for either path."""

    def __init__(self, argv: list[str], tiny: bool, output_dir: str):
        from trl import ModelConfig, TrlParser, get_peft_config

        from trl_federated.adapters import default_lora_config, get_adapter_state, with_federated_adapter
        from trl_federated.arguments import BenchmarkArguments, config_class
        from trl_federated.data import partition_clients
        from trl_federated.data.loading import load_benchmark
        from trl_federated.local.client import local_training_args
        from trl_federated.runtime.models import load_model_and_tokenizer
        from trl_federated.scoring.rewards import training_rewards

        parser = TrlParser((config_class(argv), ModelConfig, BenchmarkArguments))
        args, model_args, data_args = parser.parse_args_and_config(argv)
        if tiny:
            from trl_federated.testing import save_tiny_model

            model_args.model_name_or_path = str(save_tiny_model(Path(output_dir) / "tiny"))
        train, self.test = load_benchmark(data_args)
        clients = partition_clients(train, args)
        model, self.tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, dtype=model_args.dtype)
        peft_config = get_peft_config(model_args) if model_args.use_peft else default_lora_config()
        self.model = with_federated_adapter(model, args.seed, peft_config)
        # A trained-looking adapter (B = 0 at initialisation would make the merge a no-op).
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.01, generator=torch.Generator().manual_seed(hash(name) % 2**31))
        self.adapter = get_adapter_state(self.model)
        client_id, self.client_data = max(enumerate(clients), key=lambda item: len(item[1]))
        self.args = local_training_args(args, 0, client_id, len(clients), f"client_{client_id}")
        self.args.output_dir = output_dir
        self.reward_funcs = training_rewards(data_args)
        self.phases = Phases()

    def trainer(self, fast: bool, steps: int, bf16: bool | None = None):
        """A fresh trainer for today's path (float32 loss and TRL's generation) or the new one (fast generation, the
        loss under bf16 autocast where the config's resolved `bf16` says so); `bf16` overrides the loss's precision."""
        from accelerate.state import AcceleratorState

        from trl_federated.adapters import set_adapter_state
        from trl_federated.trainer import FedGRPOTrainer

        set_adapter_state(self.model, self.adapter)
        args = copy.deepcopy(self.args)
        args.fast_generation = fast
        args.bf16 = (self.args.bf16 and fast) if bf16 is None else bf16
        args.mixed_precision = "bf16" if args.bf16 else "no"
        AcceleratorState._reset_state(reset_partial_state=True)  # the mixed precision is the process's, set per trainer
        args.max_steps = args.local_steps = steps
        trainer = FedGRPOTrainer(
            model=self.model, reward_funcs=self.reward_funcs, args=args, train_dataset=self.client_data,
            processing_class=self.tokenizer,
        )  # fmt: skip
        self.phases.wrap(trainer, "_generate_and_score_completions", "generation")
        self.phases.wrap(trainer, "compute_loss", "loss")
        self.phases.wrap(trainer.accelerator, "backward", "loss")
        return trainer

    def first_batch_prompt_ids(self, trainer) -> list[list[int]]:
        rows = self.client_data.select(range(self.args.generation_batch_size // self.args.num_generations))
        prompts = [prompt for prompt in rows["prompt"] for _ in range(self.args.num_generations)]
        return trainer._tokenize_prompts(prompts)[0]

    def generation(self, trainer, prompt_ids, new_tokens: int) -> float:
        """Wall seconds of `_generate_single_turn` with exactly `new_tokens` new tokens per row."""
        config = trainer.generation_config
        saved = config.max_new_tokens, config.min_new_tokens
        config.max_new_tokens = config.min_new_tokens = new_tokens
        try:
            torch.manual_seed(0)
            return wall_seconds(lambda: trainer._generate_single_turn(prompt_ids, None, {}, self.args.num_generations))
        finally:
            config.max_new_tokens, config.min_new_tokens = saved

    def steps(self, fast: bool, steps: int) -> dict[str, float]:
        trainer = self.trainer(fast, steps)
        self.phases.take()
        total = wall_seconds(trainer.train)
        phases = self.phases.take()
        per_step = {name: seconds / steps for name, seconds in phases.items()}
        per_step["step"] = total / steps
        per_step["rest"] = per_step["step"] - per_step["generation"] - per_step["loss"]
        return per_step

    def evaluation(self, fast: bool, rows: int, dtype: str) -> tuple[float, float]:
        from trl_federated.adapters import set_adapter_state
        from trl_federated.core.evaluation import evaluate_accuracy

        set_adapter_state(self.model, self.adapter)
        result = evaluate_accuracy(
            self.model, self.tokenizer, self.test.select(range(min(rows, len(self.test)))),
            label_column=self.args.partition_column, batch_size=self.args.per_device_eval_batch_size,
            max_new_tokens=self.args.max_completion_length, fast_generation=fast, generation_dtype=dtype,
        )  # fmt: skip
        return result["seconds"], result["accuracy"]["Total"]
