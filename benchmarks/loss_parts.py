"""Where the loss forward + backward of a local step goes, operator by operator, against the floor of the products it
runs: the quickstart's largest client on the fast path (`FastGRPOMixin`: shared prefix, the frozen projections cast
once, the loss under bf16 autocast where the config's `bf16` resolves on), as `local_step_speed.py` trains it.

    OMP_NUM_THREADS=1 python benchmarks/loss_parts.py --config examples/configs/quickstart.yaml [--steps 2] [--tiny] \
        [any `trl-federated run` flag]

After one warm-up step it times `--steps` local steps' loss forward + backward (wall seconds, unprofiled), then
profiles as many more (torch.profiler, shapes and FLOPs recorded) and prints each group of operators' self CPU
seconds a step, its share of the profiled total, and its calls a step:
- products (`aten::mm`, `addmm`, `bmm`, ...): with the FLOPs their shapes give, the rate they ran at, and their
  floor: those FLOPs at the machine's best product throughput in their dtype (`harness.timing.machine_floors`), the
  floor of the loss as it is computed; and the product shapes that took longest, each with its rate;
- attention: the fused scaled-dot-product kernels, forward and backward;
- casts and copies: `copy_`, `_to_copy`, `clone`;
- elementwise and reductions: the rest of ATen's arithmetic (norms, activations, the loss's log-softmax, ...);
- the rest: autograd's bookkeeping, views, allocation, and the profiler's own cost;
then the operators that took longest. The profiler slows small operators down more than large ones: read the
shares, and the unprofiled wall time for the step. The last line sums it up (`summary_line`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections import defaultdict

import torch

from harness.timing import machine_floors
from harness.trainers import Bench

PRODUCTS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"}
CASTS = {"aten::copy_", "aten::_to_copy", "aten::clone"}
ARITHMETIC = {
    "abs", "add", "amax", "clamp", "cumsum", "div", "eq", "exp", "fill", "gather", "gt", "index", "index_put",
    "_index_put_impl", "log", "logsumexp", "lt", "masked_fill", "max", "maximum", "mean", "minimum", "mul", "ne", "neg",
    "pow", "rsqrt", "scatter", "sigmoid", "silu", "silu_backward", "softmax", "_softmax", "_softmax_backward_data",
    "_log_softmax", "_log_softmax_backward_data", "sqrt", "sub", "sum", "where", "zero",
}  # fmt: skip
GROUPS = ("products", "attention", "casts and copies", "elementwise and reductions", "the rest")
DTYPES = {"c10::BFloat16": "bfloat16", "float": "float32"}


def group_of(name: str) -> str:
    """The group an operator's self time counts in."""
    if name in PRODUCTS:
        return "products"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in CASTS:
        return "casts and copies"
    namespace, _, op = name.partition("::")
    if namespace == "aten" and op.rstrip("_") in ARITHMETIC:
        return "elementwise and reductions"
    return "the rest"


def product_flops(event) -> int:
    """An operator's FLOPs: the profiler's count, or for an in-place `addmm_` (which it does not count) 2·M·K·N from
    its shapes (self [M, N], mat1 [M, K], mat2 [K, N])."""
    if event.flops:
        return event.flops
    if event.name == "aten::addmm_":
        (m, n), (_, k) = event.input_shapes[0], event.input_shapes[1]
        return 2 * m * k * n
    return 0


def product_dtype(event) -> str:
    """The dtype a product computes in: that of its first matrix operand (an `addmm`'s bias comes first)."""
    for shape, dtype in zip(event.input_shapes, event.input_dtypes, strict=False):
        if len(shape) >= 2:
            return DTYPES.get(dtype, dtype)
    return "float32"


class LossProfile:
    """Self CPU time per operator and per product shape of the calls it profiles, summed; `active` turns it on."""

    def __init__(self):
        self.active = False
        self.operators = defaultdict(lambda: [0.0, 0])  # operator: [self seconds, calls]
        self.products = defaultdict(lambda: [0.0, 0, 0])  # (name, shapes, dtype): [self seconds, calls, FLOPs]

    def wrap(self, owner, attribute: str) -> None:
        original = getattr(owner, attribute)

        def profiled(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True) as profiler:
                result = original(*args, **kwargs)
            self.add(profiler.events())
            return result

        setattr(owner, attribute, profiled)

    def add(self, events) -> None:
        for event in events:
            seconds = event.self_cpu_time_total / 1e6
            operator = self.operators[event.name]
            operator[0] += seconds
            operator[1] += 1
            if event.name in PRODUCTS:
                shapes = tuple(tuple(shape) for shape in event.input_shapes if shape)
                product = self.products[(event.name, shapes, product_dtype(event))]
                product[0] += seconds
                product[1] += 1
                product[2] += product_flops(event)


def measure(argv: list[str], steps: int, tiny: bool) -> dict:
    results = {"floors": machine_floors(tiny)}
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(argv, tiny, tmp)
        bench.steps(True, 1)  # warm-up: allocator, the merged copy, lazy initialisation
        results["loss_s"] = bench.steps(True, steps)["loss"]
        profile = LossProfile()
        trainer = bench.trainer(True, steps)
        profile.wrap(trainer, "compute_loss")
        profile.wrap(trainer.accelerator, "backward")
        profile.active = True
        trainer.train()
        results["setting"] = {"steps": steps, "threads": torch.get_num_threads(), "bf16_loss": bench.args.bf16}
    operators = [{"op": name, "group": group_of(name), "seconds": seconds / steps, "calls": calls / steps}
                 for name, (seconds, calls) in profile.operators.items()]  # fmt: skip
    results["operators"] = sorted(operators, key=lambda operator: -operator["seconds"])
    results["groups"] = {name: {key: sum(operator[key] for operator in operators if operator["group"] == name)
                                for key in ("seconds", "calls")} for name in GROUPS}  # fmt: skip
    floors = results["floors"]
    products = [
        {"op": name, "shapes": [list(shape) for shape in shapes], "dtype": dtype, "seconds": seconds / steps,
         "calls": calls / steps, "gflop": flops / steps / 1e9,
         "floor_s": flops / steps / (floors.get(f"matmul_{dtype}_gflop_s", floors["matmul_float32_gflop_s"]) * 1e9)}
        for (name, shapes, dtype), (seconds, calls, flops) in profile.products.items()
    ]  # fmt: skip
    results["products"] = sorted(products, key=lambda product: -product["seconds"])
    results["products_floor_s"] = sum(product["floor_s"] for product in products)
    results["products_gflop"] = sum(product["gflop"] for product in products)
    return results


def summary_line(results: dict) -> str:
    """The run in one line: the loss's wall seconds a step against its products' floor, and each group's share."""
    total = sum(group["seconds"] for group in results["groups"].values())
    shares = ", ".join(f"{name} {100 * group['seconds'] / total:.0f}%" for name, group in results["groups"].items())
    return (f"summary: loss forward + backward {results['loss_s']:.2f} s a step, "
            f"{results['loss_s'] / results['products_floor_s']:.1f}x its products' floor; profiled CPU: {shares}")


def report(results: dict, top: int = 12) -> str:
    floors, groups = results["floors"], results["groups"]
    total = sum(group["seconds"] for group in groups.values())
    products_seconds = groups["products"]["seconds"]
    setting = results["setting"]
    lines = [
        f"{setting['threads']} thread(s), loss in {'bf16 autocast' if setting['bf16_loss'] else 'float32'}, "
        f"{setting['steps']} step(s) timed and {setting['steps']} profiled after a warm-up; machine: read "
        f"{floors['read_gb_s']:.1f} GB/s, matmul float32 {floors['matmul_float32_gflop_s']:.0f} / bfloat16 "
        f"{floors['matmul_bfloat16_gflop_s']:.0f} GFLOP/s",
        "",
        f"loss forward + backward, unprofiled: {results['loss_s']:.2f} s a step; its products' floor "
        f"{results['products_floor_s']:.3f} s ({results['products_gflop']:.1f} GFLOP at the machine's best rate per "
        f"dtype): {results['loss_s'] / results['products_floor_s']:.1f}x",
        "",
        "| part (profiled) | self CPU s a step | share | calls a step |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {group['seconds']:.3f} | {100 * group['seconds'] / total:.1f}% | {group['calls']:.0f} |"
          for name, group in groups.items()),
        f"| total | {total:.3f} | 100% | {sum(group['calls'] for group in groups.values()):.0f} |",
        "",
        "The operators that took longest:",
        "",
        "| operator | group | self CPU s a step | share | calls a step |",
        "|---|---|---:|---:|---:|",
        *(f"| {operator['op']} | {operator['group']} | {operator['seconds']:.3f} | "
          f"{100 * operator['seconds'] / total:.1f}% | {operator['calls']:.0f} |"
          for operator in results["operators"][:top]),
        "",
        f"products: {results['products_gflop'] / products_seconds:.0f} GFLOP/s over all "
        f"({groups['products']['calls']:.0f} calls a step), {products_seconds / results['products_floor_s']:.1f}x "
        "their floor; the longest by shape:",
        "",
        "| op | shapes | dtype | calls a step | ms a step | GFLOP/s | x its floor |",
        "|---|---|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for product in results["products"][:top]:
        rate = product["gflop"] / product["seconds"] if product["seconds"] else 0.0
        of_floor = product["seconds"] / product["floor_s"] if product["floor_s"] else float("nan")
        lines.append(f"| {product['op']} | {' x '.join(str(shape) for shape in product['shapes'])} | "
                     f"{product['dtype']} | {product['calls']:.0f} | {1000 * product['seconds']:.1f} | {rate:.0f} | "
                     f"{of_floor:.1f} |")  # fmt: skip
    lines += ["", summary_line(results)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", type=int, default=2, help="local steps timed, and as many profiled")
    own.add_argument("--tiny", action="store_true", help="the tiny model, small shapes: a smoke test")
    options, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    with contextlib.redirect_stdout(sys.stderr):  # the trainers' logs
        results = measure(rest, options.steps, options.tiny)
    print(report(results))
    return results


if __name__ == "__main__":
    main()
