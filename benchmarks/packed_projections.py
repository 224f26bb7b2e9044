"""Fast generation's packed projections (`PackedLinear`, oneDNN's reordered weight) against dense `linear`, on this
CPU and in the dtype fast generation takes here: each product of a SmolLM2-135M layer and its LM head at the row
counts generation runs (a decode step's rows up to a prefill's), then the fast path itself with and without packing
(the prefill, a decode step, the greedy evaluation of `--eval_rows` test rows) on the quickstart's largest client.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/packed_projections.py --config examples/configs/quickstart.yaml
    # a CPU without AVX-512, imitated:
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 taskset -c 0 \
        python benchmarks/packed_projections.py --config examples/configs/quickstart.yaml

`fast_generation.packs_linears` decides where the copy packs; this prints the evidence for that rule on the machine it
runs on: ratios are dense / packed time (above 1, packing pays). The sides alternate (`alternated`), after an untimed
warm-up of each; figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch

from harness.timing import alternated, wall_seconds
from harness.trainers import Bench

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152))  # SmolLM2-135M: MLP, attention, k/v, head
ROWS = (1, 8, 16, 32, 512, 2048)


def product_ratios(dtype: torch.dtype, repeats: int) -> list[str]:
    lines = []
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features, dtype=dtype, generator=torch.Generator().manual_seed(0)) / 24
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        for rows in ROWS:
            if rows * out_features > 2048 * 1536 * 4:  # the head's logits at a prefill's every row: never computed
                continue
            hidden = torch.randn(rows, in_features, dtype=dtype)
            sides = {
                "dense": lambda: torch.nn.functional.linear(hidden, weight),
                "packed": lambda: torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], ""),
            }
            for side in sides.values():
                side()
            times = {side: statistics.median(ms) for side, ms in alternated(
                {side: lambda call=call: 1000 * wall_seconds(call) for side, call in sides.items()}, repeats).items()}
            lines.append(f"| {in_features} → {out_features} | {rows} | {times['dense']:.3f} | {times['packed']:.3f} "
                         f"| {times['dense'] / times['packed']:.2f} |")  # fmt: skip
    return lines


def fast_path_ratios(argv: list[str], eval_rows: int, decode_tokens: int, repeats: int) -> list[str]:
    from trl_federated.local import fast_generation

    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(argv, False, tmp)
        dtype_name = bench.args.generation_dtype

        def run(pack: bool) -> dict[str, float]:
            with mock.patch.object(fast_generation, "packs_linears", lambda *args: pack):
                trainer = bench.trainer(True, 1)  # a fresh merged copy, packed or not
                prompt_ids = bench.first_batch_prompt_ids(trainer)
                bench.generation(trainer, prompt_ids, 2)
                one = bench.generation(trainer, prompt_ids, 1)
                many = bench.generation(trainer, prompt_ids, decode_tokens)
                seconds, accuracy = bench.evaluation(True, eval_rows, dtype_name)
            return {"prefill + first token (s)": one, "decode step (ms)": 1000 * (many - one) / (decode_tokens - 1),
                    f"greedy evaluation, {eval_rows} rows (s)": seconds, "accuracy": accuracy}  # fmt: skip

        for pack in (True, False):
            run(pack)  # warm-up
        runs = alternated({pack: lambda pack=pack: run(pack) for pack in (True, False)}, repeats)
    medians = {pack: {name: statistics.median(r[name] for r in results) for name in results[0]}
               for pack, results in runs.items()}  # fmt: skip
    lines = ["| fast generation | dense | packed | dense / packed |", "|---|---:|---:|---:|"]
    for name in medians[True]:
        dense, packed = medians[False][name], medians[True][name]
        ratio = "" if name == "accuracy" else f"{dense / packed:.2f}"
        lines.append(f"| {name} | {dense:.3f} | {packed:.3f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument("--eval_rows", type=int, default=16)
    parser.add_argument("--decode_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="alternated runs of the fast path, each side")
    parser.add_argument("--product_repeats", type=int, default=20)
    parser.add_argument("--products_only", action="store_true", help="skip the fast path's end-to-end runs")
    parser.add_argument("--generation_dtype", default="auto", help="as `trl-federated run`'s, which it is handed on to")
    own, rest = parser.parse_known_args(argv)
    rest += ["--generation_dtype", own.generation_dtype]
    from trl_federated.local.fast_generation import packs_linears, resolve_generation_dtype

    dtype = resolve_generation_dtype(own.generation_dtype, torch.device("cpu"))
    packs = packs_linears(torch.device("cpu"), dtype)
    print(f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 path "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, {torch.get_num_threads()} thread(s), generation dtype "
          f"{str(dtype).removeprefix('torch.')}: fast generation packs here: {packs}")
    start = time.perf_counter()
    print("\n| product | rows | dense (ms) | packed (ms) | dense / packed |\n|---|---:|---:|---:|---:|")
    print("\n".join(product_ratios(dtype, own.product_repeats)))
    if not own.products_only:
        print()
        print("\n".join(fast_path_ratios(rest, own.eval_rows, own.decode_tokens, own.repeats)))
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
