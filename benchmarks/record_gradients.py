"""Per-record gradients for record-level DP-SGD: what each way of getting them costs next to the non-private
batched forward + backward, and whether they agree.

    taskset -c 0 env OMP_NUM_THREADS=1 PYTHONPATH=/tmp/opacus-site python benchmarks/record_gradients.py \
        [--model default|tiny] [--records 1 2 4] [--repeats 2] [--output_dir benchmarks/results/record-gradients]

(`pip install --target /tmp/opacus-site opacus opt-einsum --no-deps` brings Opacus without touching the
environment; without it the Opacus side is reported as not installed.)

A record is one prompt and its group of G = 4 completions; record-level DP-SGD clips each record's gradient of its
own GRPO loss (on the LoRA parameters) to a norm C before the sum is noised. A micro-batch of R records (R from
`--records`) holds R real reasoning-gym prompts (the quickstart's benchmark, size 400, seed 0: 96-136 tokens under
the chat template), left-padded to the longest, each followed by G completions of random tokens, 16-64 long
(right-padded to 64). The model is SmolLM2-135M-Instruct (embedded) with the quickstart's LoRA (r = 16, α = 32, every
linear projection; B drawn N(0, 0.01) so that A's gradients are not zero), float32 on the CPU. The loss of a record is
GRPO's (`loss_type: grpo`, on-policy): the per-token -A·log p of the completion tokens averaged over each
completion's tokens, then over the record's completions; the batched loss is the sum of the records' losses, so the
per-record gradients sum to its gradient.

Sides, each timed over one micro-batch:
- batched: the non-private forward + backward of the whole micro-batch (`loss.backward()`), the baseline;
- loop: for each record, forward + backward of its G rows alone (its prompt without the batch's left padding),
  the flattened `p.grad` of the LoRA parameters copied out after each;
- vmap: `torch.func.vmap(grad(loss))` over records of `functional_call` on the PEFT model. Under vmap the model's
  2-D attention mask fails (transformers' mask builder branches on the mask's values; the script tries it first and
  records the error), so the records' causal + padding masks are built outside vmap as 4-D boolean masks, which
  transformers passes through as they are (a padding query attends to itself, so no row of the mask is empty);
- opacus: `opacus.GradSampleModule` (hooks on the LoRA `nn.Linear`s, `loss_reduction="sum"`) on a copy of the
  model: one forward + backward of the micro-batch gives per-row gradients (`grad_sample`), summed over each
  record's rows.

The sides alternate (`harness.timing.alternated`) after one untimed warm-up each at the smallest micro-batch;
figures are medians over `--repeats` of CPU seconds (`time.process_time`) with wall seconds beside, and the peak
resident-set rise over the call. Each side's per-record gradients (from its last run) are compared with the loop's
(the largest relative L2 error over records), and their sum with the batched gradient. Results, with the machine
record, go to `<output_dir>/results.json` and `<output_dir>/table.md`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.grid import machine_record
from harness.timing import alternated, read_peak_rss_mib, reset_peak_rss, resident_mib

GROUP_SIZE = 4  # completions per prompt (the quickstart's num_generations)
COMPLETION_LENGTH = 64  # the quickstart's max_completion_length
MIN_COMPLETION = 16
SIDES = ("batched", "loop", "vmap", "opacus")


def load_model(model: str, tmp: str):
    from trl_federated.adapters import default_lora_config, with_federated_adapter
    from trl_federated.runtime.models import load_model_and_tokenizer

    path = None  # the embedded SmolLM2-135M-Instruct
    if model == "tiny":
        from trl_federated.testing import save_tiny_model

        path = str(save_tiny_model(f"{tmp}/tiny"))
    base, tokenizer = load_model_and_tokenizer(path)
    peft_model = with_federated_adapter(base, 0, default_lora_config())
    with torch.no_grad():  # a trained-looking adapter: with B = 0, A's gradients would all be zero
        generator = torch.Generator().manual_seed(0)
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
    peft_model.train()
    return peft_model, tokenizer


def make_batch(tokenizer, num_records: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`num_records` records of `GROUP_SIZE` rows, records contiguous: the first reasoning-gym train prompts under
    the chat template, left-padded to the longest, and random completions of 16-64 tokens, right-padded to 64."""
    from trl_federated.data import build_reasoning_benchmark

    prompts = build_reasoning_benchmark(size=400, seed=0)["train"]["prompt"][:num_records]
    encoded = [tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
               for prompt in prompts]  # fmt: skip
    width, pad = max(map(len, encoded)), tokenizer.pad_token_id
    prompt_ids = torch.full((num_records, width), pad)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, ids in enumerate(encoded):
        prompt_ids[row, width - len(ids):] = torch.tensor(ids)
        prompt_mask[row, width - len(ids):] = 1
    generator = torch.Generator().manual_seed(seed)
    rows = num_records * GROUP_SIZE
    lengths = torch.randint(MIN_COMPLETION, COMPLETION_LENGTH + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(COMPLETION_LENGTH)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(len(tokenizer), (rows, COMPLETION_LENGTH), generator=generator)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    rewards = torch.rand(num_records, GROUP_SIZE, generator=generator)  # GRPO's group-normalised advantages
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {
        "input_ids": torch.cat([prompt_ids.repeat_interleave(GROUP_SIZE, 0), completion_ids], 1),
        "attention_mask": torch.cat([prompt_mask.repeat_interleave(GROUP_SIZE, 0), completion_mask], 1),
        "completion_mask": completion_mask,
        "advantages": advantages.flatten(),
        "prompt_lengths": torch.tensor(list(map(len, encoded))),
    }


def record_losses(model, input_ids, attention_mask, completion_mask, advantages) -> torch.Tensor:
    """Each record's GRPO loss, for rows grouped by record (`GROUP_SIZE` consecutive rows a record): -A·log p per
    completion token, averaged over each completion's tokens, then over the record's completions."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   logits_to_keep=COMPLETION_LENGTH + 1).logits[:, :-1]  # fmt: skip
    tokens = input_ids[:, -COMPLETION_LENGTH:]
    logps = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = completion_mask.to(logps.dtype)
    per_completion = (-advantages[:, None] * logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_completion.view(-1, GROUP_SIZE).mean(1)


def flat_grads(parameters) -> torch.Tensor:
    return torch.cat([parameter.grad.flatten() for parameter in parameters])


def batched(model, batch) -> torch.Tensor:
    """The non-private step: the micro-batch's summed loss, one backward; its gradient, flattened."""
    model.zero_grad(set_to_none=True)
    record_losses(model, *(batch[key] for key in ("input_ids", "attention_mask", "completion_mask", "advantages"))
                  ).sum().backward()  # fmt: skip
    return flat_grads(p for p in model.parameters() if p.requires_grad)[None]


def loop(model, batch) -> torch.Tensor:
    """(a) Each record alone: its G rows (its prompt without the batch's left padding), forward + backward, p.grad."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    width = batch["input_ids"].size(1) - COMPLETION_LENGTH
    grads = []
    for record, length in enumerate(batch["prompt_lengths"].tolist()):
        rows = slice(record * GROUP_SIZE, (record + 1) * GROUP_SIZE)
        model.zero_grad(set_to_none=True)
        record_losses(model, batch["input_ids"][rows, width - length:], batch["attention_mask"][rows, width - length:],
                      batch["completion_mask"][rows], batch["advantages"][rows]).sum().backward()  # fmt: skip
        grads.append(flat_grads(parameters))
    return torch.stack(grads)


def four_d_masks(attention_mask: torch.Tensor) -> torch.Tensor:
    """Causal + key-padding boolean masks (True: attend), [rows, 1, L, L]; a padding query attends to itself."""
    length = attention_mask.size(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return ((causal & attention_mask.bool()[:, None, :]) | torch.eye(length, dtype=torch.bool))[:, None]


def vmap_gradients(model, batch, mask: str = "4d") -> torch.Tensor:
    """(b) `vmap(grad(loss))` over records of `functional_call` on the PEFT model, with the records' attention masks
    as transformers takes them (`mask="2d"`, which fails under vmap) or prebuilt (`"4d"`)."""
    from torch.func import functional_call, grad, vmap

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def loss(params, input_ids, attention_mask, completion_mask, advantages):
        def call(**kwargs):
            return functional_call(model, params, args=(), kwargs=kwargs, strict=False)

        return record_losses(call, input_ids, attention_mask, completion_mask, advantages).sum()

    records = batch["input_ids"].size(0) // GROUP_SIZE
    masks = four_d_masks(batch["attention_mask"]) if mask == "4d" else batch["attention_mask"]
    inputs = [tensor.view(records, GROUP_SIZE, *tensor.shape[1:])
              for tensor in (batch["input_ids"], masks, batch["completion_mask"], batch["advantages"])]  # fmt: skip
    grads = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))(params, *inputs)
    return torch.cat([grads[name].flatten(1) for name in names], 1)


def opacus_gradients(sample_module, batch) -> torch.Tensor:
    """(c) Opacus's per-row gradients (`grad_sample`) of the summed loss, summed over each record's rows."""
    sample_module.zero_grad(set_to_none=True)
    record_losses(sample_module, *(batch[key] for key in ("input_ids", "attention_mask", "completion_mask",
                                                          "advantages"))).sum().backward()  # fmt: skip
    records = batch["input_ids"].size(0) // GROUP_SIZE
    grads = torch.cat([p.grad_sample.reshape(records, GROUP_SIZE, -1).sum(1)
                       for p in sample_module.parameters() if p.requires_grad], 1)  # fmt: skip
    sample_module.zero_grad(set_to_none=True)  # frees the per-row gradients
    return grads


def timed(function) -> tuple[float, float, float, torch.Tensor]:
    """CPU seconds, wall seconds and the resident-set rise (MiB) of `function()`, and what it returned."""
    from trl_federated.runtime.memory import release_free_memory

    release_free_memory()
    start_mib = resident_mib()
    reset_peak_rss()
    cpu, wall = time.process_time(), time.perf_counter()
    result = function()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu, wall, read_peak_rss_mib() - start_mib, result


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest relative L2 error over rows (records)."""
    return ((value - reference).norm(dim=1) / reference.norm(dim=1)).max().item()


def measure(model_name: str, record_counts: list[int], repeats: int) -> dict:
    failures = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load_model(model_name, tmp)
    sides = {"batched": functools.partial(batched, model), "loop": functools.partial(loop, model),
             "vmap": functools.partial(vmap_gradients, model)}  # fmt: skip
    try:
        from opacus import GradSampleModule

        sample_module = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
        sides["opacus"] = functools.partial(opacus_gradients, sample_module)
    except Exception as error:  # not installed, or refuses the PEFT model
        failures["opacus"] = f"{type(error).__name__}: {error}"
    smallest = make_batch(tokenizer, min(record_counts))
    try:  # the 2-D mask, as TRL passes it, under vmap
        vmap_gradients(model, smallest, mask="2d")
        failures["vmap_2d_mask"] = None
    except Exception as error:
        failures["vmap_2d_mask"] = f"{type(error).__name__}: {error}"
    for side in sides.values():  # warm-up, untimed
        side(smallest)
    rows = []
    for records in record_counts:
        batch = make_batch(tokenizer, records)
        runs = alternated({name: functools.partial(timed, functools.partial(side, batch))
                           for name, side in sides.items()}, repeats)  # fmt: skip
        reference = runs["loop"][-1][3]
        total = runs["batched"][-1][3]
        row = {"records": records, "rows": records * GROUP_SIZE, "length": batch["input_ids"].size(1),
               "prompt_lengths": batch["prompt_lengths"].tolist(), "sides": {}}  # fmt: skip
        for name, results in runs.items():
            grads = results[-1][3]
            row["sides"][name] = {
                "cpu_s": [run[0] for run in results], "wall_s": [run[1] for run in results],
                "peak_rise_mib": max(run[2] for run in results),
                "cpu_s_median": statistics.median(run[0] for run in results),
                "wall_s_median": statistics.median(run[1] for run in results),
                "record_error_vs_loop": None if name == "batched" else relative_error(grads, reference),
                "sum_error_vs_batched": relative_error(grads.sum(0, keepdim=True), total),
            }  # fmt: skip
        rows.append(row)
        print(f"[record_gradients] {records} records done", flush=True)
    return {"failures": failures, "rows": rows, "trainable_parameters": int(reference.size(1))}


def table(result: dict) -> str:
    lines = ["| records (rows) | side | CPU s (median) | ratio to batched | wall s | peak RSS rise (MiB) "
             "| per-record rel. error vs loop | sum rel. error vs batched |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in result["rows"]:
        base = row["sides"]["batched"]["cpu_s_median"]
        for name in SIDES:
            side = row["sides"].get(name)
            if side is None:
                lines.append(f"| {row['records']} ({row['rows']}) | {name} | failed | | | | | |")
                continue
            record_error = side["record_error_vs_loop"]
            lines.append(
                f"| {row['records']} ({row['rows']}) | {name} | {side['cpu_s_median']:.2f} "
                f"| {side['cpu_s_median'] / base:.3f} | {side['wall_s_median']:.2f} | {side['peak_rise_mib']:.0f} "
                f"| {'reference' if name == 'loop' else '' if record_error is None else f'{record_error:.1e}'} "
                f"| {side['sum_error_vs_batched']:.1e} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="default")
    parser.add_argument("--records", nargs="+", type=int, default=[1, 2, 4], help="records per micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output_dir", default="benchmarks/results/record-gradients")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    result = measure(options.model, sorted(options.records), options.repeats)
    result.update(options=vars(options), machine=machine_record())
    heading = (f"model={options.model} repeats={options.repeats} threads={options.threads}; G={GROUP_SIZE}, "
               f"completions {MIN_COMPLETION}-{COMPLETION_LENGTH} tokens; {result['trainable_parameters']:,} LoRA "
               f"parameters; {result['machine']['cpu']} ({', '.join(result['machine']['cpu_flags'])})")  # fmt: skip
    failures = "\n".join(f"- {name}: {error or 'ran'}" for name, error in result["failures"].items())
    report = f"{heading}\n\n{table(result)}\n\nFailures and attempts:\n{failures}\n"
    print(report)
    output = Path(options.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (output / "table.md").write_text(report, encoding="utf-8")


if __name__ == "__main__":
    main()
