"""Where a decode step of fast generation goes, part by part, against its floor: the merged copy of the embedded
SmolLM2-135M (`MergedGenerationModel`, in the dtype `generation_dtype: auto` takes here) sampling `--rows` rows at
temperature 1 over the whole vocabulary, as a local step's generation does.

    OMP_NUM_THREADS=1 python benchmarks/decode_parts.py [--rows 8] [--prompt_tokens 166] [--decode_tokens 32] \
        [--repeats 3] [--profile 12]

Parts (the whole steps the median of `--repeats`, the parts alone the best):
- the whole step: `generate` on the copy (a `DynamicCache`, as fast generation runs it), (`--decode_tokens` + 1 new
  tokens − 1 new token) / `--decode_tokens`;
- the projections alone: every linear projection of the copy (packed where `packs_linears` packs), once, at a
  decode step's rows;
- the sampler: `generate`'s draw (softmax, then `torch.multinomial`, which draws one exponential per vocabulary
  entry) against the same distribution drawn as Gumbel-max from uniforms (argmax of logits − log(−log U));
- the rest: the whole step less the projections and `generate`'s draw (norms, rotary embeddings, attention over the
  cache, its growth, the logits' processing, the loop's own work).
The floor: the model's weight bytes in the copy's dtype / the read bandwidth (`read_gb_s`), measured before and after
the parts; the larger reading sets the floor, and where the two differ by more than a quarter the report says so: on a
machine whose memory bandwidth is shared with others, the memory-bound parts moved with it (benchmarks/RESULTS.md).
`--profile N` then lists the N operators that took longest in a decode step (`operators_per_step`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from harness.timing import best_seconds, read_gb_s, wall_seconds


def copy_of_embedded_model() -> tuple[torch.nn.Module, int]:
    """The merged copy of the embedded model, and the model's parameter count (a tied head counted once)."""
    from transformers import AutoModelForCausalLM

    from trl_federated.local.fast_generation import MergedGenerationModel, resolve_generation_dtype
    from trl_federated.runtime.models import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    copy = MergedGenerationModel(model, resolve_generation_dtype("auto", model.device)).refresh()
    return copy, model.num_parameters()


def decode_step_ms(generate, decode_tokens: int, repeats: int) -> list[float]:
    """ms per decode step of `generate(new_tokens)`, each repeat's: the long call less the 1-token call, over the steps
    between."""
    generate(2)  # warm-up
    steps = []
    for _ in range(repeats):
        one = wall_seconds(lambda: generate(1))
        many = wall_seconds(lambda: generate(decode_tokens + 1))
        steps.append(1000 * (many - one) / decode_tokens)
    return steps


def operators_per_step(generate, decode_tokens: int) -> list[tuple[str, float, float]]:
    """(operator, self CPU ms, calls) per decode step, most time first: torch.profiler over `generate(decode_tokens
    + 1)` less `generate(1)` (the prefill and the first token), over the steps between."""
    from torch.profiler import ProfilerActivity, profile

    totals = []
    for new_tokens in (1, decode_tokens + 1):
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            generate(new_tokens)
        totals.append({row.key: (row.self_cpu_time_total / 1000, row.count) for row in profiler.key_averages()})
    one, many = totals
    steps = []
    for name, (ms, calls) in many.items():
        ms_one, calls_one = one.get(name, (0.0, 0))
        steps.append((name, (ms - ms_one) / decode_tokens, (calls - calls_one) / decode_tokens))
    return sorted(steps, key=lambda row: -row[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="rows decoded together (a local step's 2 prompts x 4)")
    parser.add_argument("--prompt_tokens", type=int, default=166)
    parser.add_argument("--decode_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N operators that took longest in a decode step (torch.profiler)")
    args = parser.parse_args(argv)
    from trl_federated.local.fast_generation import PackedLinear, packs_linears

    copy, parameters = copy_of_embedded_model()
    dtype = copy.dtype
    weight_bytes = parameters * dtype.itemsize
    bandwidth_before = read_gb_s()
    input_ids = torch.randint(1000, 20000, (args.rows, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    sample = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": 0}

    def generate(new_tokens: int):
        return copy.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sample)  # fmt: skip

    start = time.perf_counter()
    steps = decode_step_ms(generate, args.decode_tokens, args.repeats)
    step = statistics.median(steps)
    projections = [m for m in copy.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
    inputs = [torch.randn(args.rows, 1, m.in_features, dtype=dtype) for m in projections]
    products = 1000 * best_seconds(lambda: [m(x) for m, x in zip(projections, inputs, strict=True)], args.repeats)
    logits = torch.randn(args.rows, copy.config.vocab_size)
    multinomial = 1000 * best_seconds(lambda: torch.multinomial(torch.softmax(logits, -1), 1), args.repeats)
    gumbel_max = lambda: (logits - torch.rand_like(logits).log_().neg_().log_()).argmax(-1)  # noqa: E731
    gumbel = 1000 * best_seconds(gumbel_max, args.repeats)
    rest = step - products - multinomial
    bandwidth_after = read_gb_s()
    bandwidth = max(bandwidth_before, bandwidth_after)
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1000
    name = str(dtype).removeprefix("torch.")
    print(f"{torch.get_num_threads()} thread(s), ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"copy in {name} ({weight_bytes / 1e6:.0f} MB, projections packed: {packs_linears(copy.device, dtype)}), "
          f"read {bandwidth_before:.1f} GB/s before the parts, {bandwidth_after:.1f} after, {args.rows} rows of "
          f"{args.prompt_tokens} prompt tokens")  # fmt: skip
    if bandwidth > 1.25 * min(bandwidth_before, bandwidth_after):
        print("The read bandwidth moved during the run, and the memory-bound parts with it: rerun before reading them.")
    print("\n| part of a decode step | ms | x the floor |\n|---|---:|---:|")
    print(f"| floor: the weights read once | {floor_ms:.1f} | 1.0 |")
    parts = {f"whole step (eager, DynamicCache; {min(steps):.1f}-{max(steps):.1f})": step,
             f"projections alone ({len(projections)})": products,
             "sampler: softmax + torch.multinomial": multinomial, "sampler as Gumbel-max from uniforms": gumbel,
             "rest (norms, rotary, attention, cache, loop)": rest}  # fmt: skip
    for part, ms in parts.items():
        print(f"| {part} | {ms:.1f} | {ms / floor_ms:.2f} |")
    print(f"\nsummary: decode step {step / floor_ms:.1f}x its floor, the projections alone {products / floor_ms:.1f}x, "
          f"sampler {multinomial:.1f} ms (Gumbel-max {gumbel:.1f} ms), rest {rest:.1f} ms "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    if args.profile:
        rows = operators_per_step(generate, args.decode_tokens)
        total = sum(ms for _, ms, _ in rows)
        print(f"\nprofiled: {total:.1f} ms of self CPU a decode step (the profiler's own cost included)\n"
              "\n| operator | ms a step | share | calls a step |\n|---|---:|---:|---:|")
        for name, ms, calls in rows[: args.profile]:
            print(f"| {name} | {ms:.2f} | {100 * ms / total:.1f}% | {calls:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
