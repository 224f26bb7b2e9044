"""A small federated run on the tiny model, for tests that launch it with 1 or several processes.

Usage: python federated_run.py MODEL_DIR OUTPUT_DIR RANKS_DIR PER_DEVICE_BATCH [key=value ...]
(or under `accelerate launch` / `torchrun`). Completions come from `deterministic_rollout`, so the run's result
depends on the data, the seeds and the federation logic only, not on how sampling is split over processes: one
process with a batch of 2B must end where two processes with B each end.
"""

import json
import sys
import zlib

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)

from trl_federated import FederatedRunner, FedGRPOConfig  # noqa: E402
from trl_federated.runtime.distributed import shut_down  # noqa: E402

NUM_GENERATIONS = 4


def length_reward(completions, **kwargs):
    return [len(completion) / 64 for completion in completions]


length_reward.reward_range = (0.0, 10.0)


def deterministic_rollout(prompts, trainer):
    """Completion j of a prompt's group is a pseudo-random token string seeded by (prompt, j); j is the sample's
    position in the *global* generation batch modulo the group size, which the sampler lays out identically for
    any number of processes."""
    tokenizer = trainer.processing_class
    offset = trainer.accelerator.process_index * len(prompts)
    prompt_ids, completion_ids = [], []
    for local_index, prompt in enumerate(prompts):
        member = (offset + local_index) % NUM_GENERATIONS
        seed = zlib.crc32(prompt.encode()) * NUM_GENERATIONS + member
        generator = torch.Generator().manual_seed(seed)
        length = 2 + (seed % 9)
        prompt_ids.append(tokenizer(prompt)["input_ids"])
        completion_ids.append(torch.randint(10, len(tokenizer), (length,), generator=generator).tolist())
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


EVALUATED_ROWS = [0]  # the rows this process scored, over all evaluations


def evaluation_reward(completions, answer, **kwargs):
    """Varies with the row (its answer) as well as the completion, so that a row's score landing on another row
    would show; counts the rows this process scores."""
    EVALUATED_ROWS[0] += len(completions)
    return [len(completion) / 64 + int(gold) / 100 for completion, gold in zip(completions, answer)]


def broken_evaluation_reward(completions, **kwargs):
    """An evaluation reward that fails on the main process only."""
    if PartialState().is_main_process:
        raise OSError("evaluation storage is gone")
    return [0.0] * len(completions)


def main(model_dir, output_dir, ranks_dir, per_device_batch, *overrides):
    values = dict(
        output_dir=output_dir, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
        per_device_train_batch_size=int(per_device_batch), num_generations=NUM_GENERATIONS, max_completion_length=12,
        learning_rate=1e-2, logging_steps=1, num_rounds=2, local_steps=2, reward_window=2, seed=0,
        aggregation="rpg", server_optimizer="adam", server_learning_rate=1e-2, per_device_eval_batch_size=2,
    )
    eval_reward_funcs = [evaluation_reward]
    for override in overrides:
        key, value = override.split("=", 1)
        if key == "broken_evaluation":  # not a config field: the evaluation raises on the main process
            eval_reward_funcs = [broken_evaluation_reward]
            continue
        if value in ("true", "false"):
            values[key] = value == "true"
        else:
            values[key] = type(values[key])(value) if key in values else value
    args = FedGRPOConfig(**values)
    clients = {
        f"site-{c}": Dataset.from_dict({"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(8)]})
        for c in range(2)
    }
    # 12 rows of different lengths in 6 batches of 2, over three labels: 3 batches for each of 2 processes.
    evaluation = Dataset.from_dict(
        {
            "prompt": [f"What is {i} + {'1 + ' * (i % 5)}{i}?" for i in range(12)],
            "answer": [str(2 * i + i % 5) for i in range(12)],
            "difficulty": [("simple", "medium", "hard")[i % 3] for i in range(12)],
        }
    )
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(model_dir), length_reward, args, clients,
        processing_class=AutoTokenizer.from_pretrained(model_dir), eval_dataset=evaluation,
        eval_reward_funcs=eval_reward_funcs,
        trainer_kwargs={"rollout_func": deterministic_rollout},
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    history = runner.run()
    rank = PartialState().process_index
    with open(f"{ranks_dir}/rank-{rank}.json", "w") as handle:
        json.dump(
            {
                "num_processes": runner.num_processes,
                "moved": max((runner.global_state[key] - value).abs().max().item() for key, value in initial.items()),
                "global_state": {key: value.tolist() for key, value in runner.global_state.items()},
                "rewards": [record.rewards for record in history],
                "weights": [record.weights for record in history],
                "evaluated_rows": EVALUATED_ROWS[0],
                "evaluations": {
                    str(round_idx): {key: value for key, value in results.items() if key != "seconds"}
                    for round_idx, results in runner.evaluations.items()
                },
            },
            handle,
        )
    shut_down()


if __name__ == "__main__":
    main(*sys.argv[1:])
