"""Whether batching the rollouts of a round's clients pays on CPU: sampling throughput by batch size, and one
mixed-adapter batch of N clients against N sequential calls.

    OMP_NUM_THREADS=1 python benchmarks/rollouts.py [--model tiny|default] [--batch_sizes 8 16 24 48] \
        [--clients 3 10] [--repeats 3] [--max_new_tokens 64] [--generation_share 0.4]

The default model is the embedded SmolLM2-135M-Instruct with the quickstart's LoRA (`adapters.default_lora_config`:
r = 16 on every linear projection), in float32, one thread (`torch.set_num_threads(1)`). Prompts are one-shot
reasoning-gym prompts (`build_reasoning_benchmark`) whose chat-templated length lies in 150-190 tokens, so that
left padding changes little between batches; each is repeated `--num_generations` times, as GRPO does. Every
call samples as TRL's GRPO does (temperature 1, no top-k/top-p) with `min_new_tokens = max_new_tokens`, so
every row generates the same number of tokens; the time includes the prefill.

Times are wall seconds and CPU seconds of the process (`time.process_time`): with one thread on a machine
shared with other jobs, CPU time is the steadier measure (a descheduled process accrues none), so the
ratios are printed on both clocks.

(a) Completion tokens/s at each batch size, the sizes run in a rotated order in each repeat; the ratio to the
    first size is the median of the per-repeat ratios.
(b) N client adapters (distinct random LoRA B matrices, loaded with `add_adapter` + `set_peft_model_state_dict`)
    with `--rows_per_client` rows each: one `generate(..., adapter_names=[client of each row])` call of N·rows
    rows against N calls of `rows` rows after `set_adapter`, alternated (mixed first in even repeats). The
    ratio sequential/mixed is the median of the per-repeat ratios; with generation at `--generation_share` of
    a local GRPO step (~0.4 on CPU, see DESIGN.md) it bounds the whole-step gain of lockstep rollouts at
    1 / (1 - share + share / ratio), since training cannot be batched across clients.

Also printed: the size of a call's KV cache at its end (float32 keys and values of every layer and position),
the memory that batching clients multiplies; for sequential calls, the largest one's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from typing import NamedTuple

import torch
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from harness.timing import alternated
from trl_federated.adapters import default_lora_config
from trl_federated.data import build_reasoning_benchmark
from trl_federated.runtime.models import load_model_and_tokenizer


def rollout_prompts(
    tokenizer: PreTrainedTokenizerBase, count: int, min_tokens: int, max_tokens: int
) -> list[list[int]]:
    """Token ids of `count` distinct chat-templated benchmark prompts with `min_tokens` to `max_tokens` tokens."""
    prompts = []
    for conversation in build_reasoning_benchmark()["train"]["prompt"]:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if min_tokens <= len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"Only {len(prompts)} benchmark prompts have {min_tokens}-{max_tokens} tokens; {count} needed.")


class Call(NamedTuple):
    seconds: float
    cpu_seconds: float
    completion_tokens: int
    kv_cache_mib: float


class Rollouts:
    """A PEFT model with a default adapter and the benchmark's prompts, generating as GRPO does."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
                 num_generations: int, max_new_tokens: int):
        self.model = get_peft_model(model, default_lora_config()).eval()
        self.pad_token_id = tokenizer.pad_token_id
        self.prompts = prompts
        self.num_generations = num_generations
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # keys and values of every layer, float32
        self.kv_cache_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
        self.generation_config = GenerationConfig(
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=True, temperature=1.0,
            top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            disable_compile=True,
        )

    def rows(self, first_prompt: int, num_rows: int) -> list[list[int]]:
        """`num_rows` rows: consecutive prompts from `first_prompt`, each repeated `num_generations` times."""
        num_prompts = num_rows // self.num_generations
        chosen = self.prompts[first_prompt:first_prompt + num_prompts]
        if len(chosen) < num_prompts or num_rows % self.num_generations:
            raise ValueError(f"{num_rows} rows need a multiple of {self.num_generations} and enough prompts.")
        return [ids for ids in chosen for _ in range(self.num_generations)]

    def left_padded(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(map(len, rows))
        return {
            "input_ids": torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids for ids in rows]),
            "attention_mask": torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows]),
        }

    def generate(self, rows: list[list[int]], adapter_names: list[str] | None = None) -> Call:
        inputs = self.left_padded(rows)
        width = inputs["input_ids"].shape[1]
        extra = {} if adapter_names is None else {"adapter_names": adapter_names}
        torch.manual_seed(0)
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.no_grad():
            output = self.model.generate(**inputs, generation_config=self.generation_config, **extra)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if output.shape[1] - width != self.generation_config.max_new_tokens:
            raise RuntimeError(f"Generated {output.shape[1] - width} tokens per row, not max_new_tokens.")
        kv_cache_mib = self.kv_cache_bytes_per_token * output.numel() / 2**20
        return Call(seconds, cpu_seconds, output[:, width:].numel(), kv_cache_mib)

    def add_client_adapters(self, num_clients: int) -> list[str]:
        """Load `num_clients` distinct adapters ("client_<i>", LoRA B drawn at random as after local training);
        adapters already loaded are kept."""
        template = get_peft_model_state_dict(self.model, adapter_name="default")
        names = []
        for client in range(num_clients):
            name = f"client_{client}"
            if name not in self.model.peft_config:
                generator = torch.Generator().manual_seed(client)
                state = {
                    key: torch.randn(value.shape, generator=generator) * 1e-2 if "lora_B" in key else value
                    for key, value in template.items()
                }
                self.model.add_adapter(name, default_lora_config())
                set_peft_model_state_dict(self.model, state, adapter_name=name)
            names.append(name)
        self.model.eval()  # add_adapter builds its modules in training mode; rollouts run in eval mode
        return names

    def mixed(self, names: list[str], rows_per_client: int) -> Call:
        """One call: client i's rows (its own prompts, after client i-1's) each with client i's adapter."""
        prompts_per_client = rows_per_client // self.num_generations
        rows = [row for i in range(len(names)) for row in self.rows(i * prompts_per_client, rows_per_client)]
        return self.generate(rows, adapter_names=[name for name in names for _ in range(rows_per_client)])

    def sequential(self, names: list[str], rows_per_client: int) -> Call:
        """The same rows as `mixed`, one call per client after `set_adapter`."""
        prompts_per_client = rows_per_client // self.num_generations
        calls = []
        for i, name in enumerate(names):
            self.model.set_adapter(name)
            calls.append(self.generate(self.rows(i * prompts_per_client, rows_per_client)))
        self.model.set_adapter("default")
        return Call(
            sum(call.seconds for call in calls), sum(call.cpu_seconds for call in calls),
            sum(call.completion_tokens for call in calls),
            max(call.kv_cache_mib for call in calls),
        )


def measure_batch_sizes(rollouts: Rollouts, batch_sizes: list[int], repeats: int) -> dict[int, list[Call]]:
    return alternated({size: lambda size=size: rollouts.generate(rollouts.rows(0, size)) for size in batch_sizes},
                      repeats)


def measure_mixed_vs_sequential(
    rollouts: Rollouts, num_clients: int, rows_per_client: int, repeats: int
) -> dict[str, list[Call]]:
    names = rollouts.add_client_adapters(num_clients)
    sides = {"mixed": rollouts.mixed, "sequential": rollouts.sequential}
    return alternated({side: functools.partial(call, names, rows_per_client) for side, call in sides.items()}, repeats)


def tokens_per_s(calls: list[Call], clock: str = "seconds") -> float:
    return statistics.median(call.completion_tokens / getattr(call, clock) for call in calls)


def median_ratio(numerators: list[Call], denominators: list[Call], clock: str = "seconds") -> float:
    """Median over repeats of numerator time / denominator time per completion token, on `clock`."""
    return statistics.median(
        (getattr(top, clock) / top.completion_tokens) / (getattr(bottom, clock) / bottom.completion_tokens)
        for top, bottom in zip(numerators, denominators)
    )


def whole_step_gain(generation_ratio: float, generation_share: float) -> float:
    return 1 / (1 - generation_share + generation_share / generation_ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="default")
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[8, 16, 24, 48])
    parser.add_argument("--clients", nargs="+", type=int, default=[3, 10])
    parser.add_argument("--rows_per_client", type=int, default=8, help="the quickstart: 2 prompts x 4 completions")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generation_share", type=float, default=0.4)
    parser.add_argument("--prompt_tokens", nargs=2, type=int, metavar=("MIN", "MAX"),
                        help="prompt length band in the model's tokens (default: 150 190; tiny model: any length)")
    options = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        if options.model == "tiny":
            from trl_federated.testing import save_tiny_model

            model, tokenizer = load_model_and_tokenizer(str(save_tiny_model(f"{tmp}/tiny")))
        else:
            model, tokenizer = load_model_and_tokenizer()
    num_prompts = max(
        max(options.batch_sizes), max(options.clients) * options.rows_per_client
    ) // options.num_generations
    # the tiny model's small vocabulary makes every prompt longer than 190 tokens
    prompt_tokens = options.prompt_tokens or ([150, 190] if options.model == "default" else [0, 10**6])
    prompts = rollout_prompts(tokenizer, num_prompts, *prompt_tokens)
    rollouts = Rollouts(model, tokenizer, prompts, options.num_generations, options.max_new_tokens)
    rollouts.generate(rollouts.rows(0, options.num_generations))  # warm-up: lazy initialisation, allocator growth
    print(f"model {options.model}, {torch.get_num_threads()} thread(s), {options.max_new_tokens} new tokens per row, "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, medians of {options.repeats} repeats")

    by_size = measure_batch_sizes(rollouts, options.batch_sizes, options.repeats)
    smallest = options.batch_sizes[0]
    print(f"\n{'batch':>6}{'tok/s':>7}{'tok/CPU-s':>11}{f'vs {smallest}: wall':>13}{'CPU':>6}{'s/call':>8}"
          f"{'KV MiB':>8}")
    for size, calls in by_size.items():
        print(f"{size:>6}{tokens_per_s(calls):>7.1f}{tokens_per_s(calls, 'cpu_seconds'):>11.1f}"
              f"{median_ratio(by_size[smallest], calls):>13.2f}"
              f"{median_ratio(by_size[smallest], calls, 'cpu_seconds'):>6.2f}"
              f"{statistics.median(c.seconds for c in calls):>8.1f}{calls[0].kv_cache_mib:>8.0f}")

    print(f"\n{'N':>4}{'rows':>6}{'tok/s: mixed':>14}{'seq':>8}{'tok/CPU-s: mixed':>18}{'seq':>8}"
          f"{'seq/mixed: wall':>17}{'CPU':>6}{'whole step (CPU)':>18}{'KV MiB mixed/seq':>18}")
    for num_clients in options.clients:
        calls = measure_mixed_vs_sequential(rollouts, num_clients, options.rows_per_client, options.repeats)
        mixed, sequential = calls["mixed"], calls["sequential"]
        cpu_ratio = median_ratio(sequential, mixed, "cpu_seconds")
        print(f"{num_clients:>4}{num_clients * options.rows_per_client:>6}"
              f"{tokens_per_s(mixed):>14.1f}{tokens_per_s(sequential):>8.1f}"
              f"{tokens_per_s(mixed, 'cpu_seconds'):>18.1f}{tokens_per_s(sequential, 'cpu_seconds'):>8.1f}"
              f"{median_ratio(sequential, mixed):>17.2f}{cpu_ratio:>6.2f}"
              f"{whole_step_gain(cpu_ratio, options.generation_share):>18.2f}"
              f"{f'{mixed[0].kv_cache_mib:.0f}/{sequential[0].kv_cache_mib:.0f}':>18}")
    print(f"\nwhole step: 1 / (1 - g + g / ratio) with generation share g = {options.generation_share}")


if __name__ == "__main__":
    main()
