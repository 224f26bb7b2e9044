"""Server step cost: RPG weighting + pseudo-gradient + server Adam over N client adapters, against a plain copy.

    OMP_NUM_THREADS=1 python benchmarks/aggregate.py [--clients 3 10 50] [--layers 6] [--repeats 9] [--threads 1]

The adapters have the paper's LoRA (r=32 on q, k, v, o, gate, up, down) on a Qwen2.5-3B-shaped decoder
(hidden 2048, intermediate 11008, 16 query heads and 2 key/value heads of 128), with PEFT's key names, built
synthetically; `--layers 36` is the whole 3B model (~240 MB per client in float32), the default 6 layers
(~40 MB per client) lets 50 clients fit in ~2.5 GB beside other jobs.

The baseline is the least any aggregation must do: read each of the N client adapters once. It copies them, one
after another, into one preallocated adapter-sized buffer (`torch._foreach_copy_`), which moves the N adapters'
bytes in and as many out: the memory traffic of an accumulation whose arithmetic were free. The aggregation
also reads the global adapter and Adam's two moments and writes both moments and the new adapter, so even a
perfect one costs more than the copy at small N; at large N it should cost about the copy or less (it only
reads each client once, into an accumulator that stays in cache). Both sides run on the same tensors in the
same process, alternated, and the figure is the median of the pairs' ratios. Both scale with the bytes of one
adapter, so the ratio does not depend on `--layers` (check with `--layers 36`).
Targets: ratio <= 3, and time per client flat in N (linear scaling).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from harness.timing import alternated, wall_seconds
from trl_federated.aggregation import ClientUpdate, RPGAggregator, ServerAdam

HIDDEN, INTERMEDIATE, HEAD_DIM, Q_HEADS, KV_HEADS, RANK = 2048, 11008, 128, 16, 2, 32
# (module path inside a decoder layer, in_features, out_features)
PROJECTIONS = (
    ("self_attn.q_proj", HIDDEN, Q_HEADS * HEAD_DIM),
    ("self_attn.k_proj", HIDDEN, KV_HEADS * HEAD_DIM),
    ("self_attn.v_proj", HIDDEN, KV_HEADS * HEAD_DIM),
    ("self_attn.o_proj", Q_HEADS * HEAD_DIM, HIDDEN),
    ("mlp.gate_proj", HIDDEN, INTERMEDIATE),
    ("mlp.up_proj", HIDDEN, INTERMEDIATE),
    ("mlp.down_proj", INTERMEDIATE, HIDDEN),
)


def synthetic_adapter(num_layers: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A float32 LoRA state dict shaped and keyed as `get_peft_model_state_dict` returns it for Qwen2.5-3B."""
    state = {}
    for layer in range(num_layers):
        for module, in_features, out_features in PROJECTIONS:
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator) * 0.01
            state[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.01
    return state


def measure(num_clients: int, num_layers: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(num_clients)
    global_state = synthetic_adapter(num_layers, generator)
    updates = [
        ClientUpdate(f"client_{i}", synthetic_adapter(num_layers, generator), num_samples=100, reward=0.1 * (i % 7))
        for i in range(num_clients)
    ]
    keys = list(global_state)
    client_tensors = [[update.state[key] for key in keys] for update in updates]
    buffer = [torch.empty_like(global_state[key]) for key in keys]

    def copy_clients():
        for tensors in client_tensors:
            torch._foreach_copy_(buffer, tensors)

    # The server of a long run: Adam moments exist and every client has a reward history (rounds > 0).
    aggregator = RPGAggregator(server_optimizer=ServerAdam())
    aggregator.aggregate(global_state, updates, round_idx=0)
    round_idx = iter(range(1, 10**6))

    def aggregate():  # as the runner calls it: its admission gate has checked every value for NaN and Inf
        return aggregator.aggregate(global_state, updates, next(round_idx), check_finite=False)

    # alternated, so that machine noise hits both sides alike
    times = alternated({"copy_s": functools.partial(wall_seconds, copy_clients),
                        "aggregate_s": functools.partial(wall_seconds, aggregate)}, repeats)
    copy_s, aggregate_s = (statistics.median(times[name]) for name in times)
    # Each pair ran back to back, under the same load: the median of the pairs' ratios is the steadiest figure.
    ratio = statistics.median(a / c for a, c in zip(times["aggregate_s"], times["copy_s"]))
    adapter_mb = sum(tensor.numel() * tensor.element_size() for tensor in global_state.values()) / 1e6
    return {
        "clients": num_clients,
        "adapter_mb": adapter_mb,
        "copy_s": copy_s,
        "aggregate_s": aggregate_s,
        "ratio": ratio,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="+", type=int, default=[3, 10, 50], help="Federation sizes N to time.")
    parser.add_argument("--layers", type=int, default=6, help="Decoder layers of the synthetic adapter (36: 3B).")
    parser.add_argument("--repeats", type=int, default=9, help="Timed, alternated repeats per side.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    args = parser.parse_args()
    if args.layers < 1 or args.repeats < 1 or args.threads < 1 or min(args.clients) < 1:
        parser.error("--clients, --layers, --repeats and --threads must all be positive.")
    torch.set_num_threads(args.threads)

    results = [measure(n, args.layers, args.repeats) for n in args.clients]
    print(
        f"RPG + server Adam vs a copy of the N client adapters; {args.layers} Qwen2.5-3B-shaped layers, LoRA r={RANK} "
        f"on q,k,v,o,gate,up,down ({results[0]['adapter_mb']:.1f} MB float32 per adapter), {args.threads} "
        f"thread(s), median of {args.repeats}"
    )
    print("| N | copy (ms) | aggregate (ms) | ratio | aggregate per client (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['clients']} | {1e3 * r['copy_s']:.1f} | {1e3 * r['aggregate_s']:.1f} | {r['ratio']:.2f} | "
            f"{1e3 * r['aggregate_s'] / r['clients']:.2f} |"
        )
    if len(results) > 1:  # linear in N: a + b N; b against the copy's cost per adapter
        first, last = results[0], results[-1]
        clients = last["clients"] - first["clients"]
        aggregate_per_client = (last["aggregate_s"] - first["aggregate_s"]) / clients
        copy_per_client = (last["copy_s"] - first["copy_s"]) / clients
        print(
            f"Each further client costs the aggregation {1e3 * aggregate_per_client:.2f} ms and the copy "
            f"{1e3 * copy_per_client:.2f} ms (N = {first['clients']} to {last['clients']}): "
            f"{aggregate_per_client / copy_per_client:.2f}x."
        )


if __name__ == "__main__":
    main()
