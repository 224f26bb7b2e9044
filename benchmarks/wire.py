"""Bytes each client sends and receives per round, against the size of its adapter, for every wire format; and, from
finished quickstart runs, the bytes and accuracy of each format at the quickstart's budget.

    python benchmarks/wire.py [--model tiny|default]
    python benchmarks/wire.py --runs RUN_DIR [RUN_DIR ...]

One real round of 2 clients (FedAvg, server SGD at lr 1, so the new global adapter is the clients' weighted
average) per format, all from the same seed, so the clients train identically and only the wire differs. Prints
the bytes up (client → server) and down (server → client) per client, sent/adapter bytes (targets: 1.00 as trained,
0.50 in bfloat16, 0.27 in int8, 0.14 in nf4 and fp4: codes plus a float32 scale per block of 64), and how far
the aggregate lies from the float32 one, relative to the round's change of the adapter: its largest coordinate
error over the largest change, and ‖θ − θ_float32‖ / ‖θ_float32 − θ^{[0]}‖ (the relative reconstruction error).

`--runs` reads the result.json of `trl-federated run` output folders named `<transfer_dtype>-seed<k>` (the quickstart
with `--transfer_dtype` and `--seed` overridden) and prints, per folder, bytes per round each way per client and the
final held-out accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch
from datasets import Dataset

from trl_federated import FedAvgAggregator, FederatedRunner, FedGRPOConfig, ServerSGD
from trl_federated.adapters import state_nbytes

PRECISIONS = ["float32", "bfloat16", "int8", "nf4", "fp4"]
FORMATS = [(lora_aggregation, precision) for lora_aggregation in ("separate", "freeze_a") for precision in PRECISIONS]


def one_round(model_path: str, lora_aggregation: str, transfer_dtype: str, output_dir: str):
    args = FedGRPOConfig(
        output_dir=output_dir, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=16, learning_rate=1e-3,
        num_rounds=1, local_steps=2, reward_window=1, save_every_round=False,
        lora_aggregation=lora_aggregation, transfer_dtype=transfer_dtype,
    )
    clients = [Dataset.from_dict({"prompt": [f"Client {c} question {i}" for i in range(8)]}) for c in range(2)]
    runner = FederatedRunner(
        model_path, lambda completions, **_: [len(c) / 64 for c in completions], args, clients,
        aggregator=FedAvgAggregator(server_optimizer=ServerSGD(learning_rate=1.0)),
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    (record,) = runner.run()
    return initial, runner.global_state, record


def norm(state: dict) -> float:
    return math.sqrt(sum(value.double().pow(2).sum().item() for value in state.values()))


def one_round_table(model: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if model == "tiny":
            from trl_federated.testing import save_tiny_model

            model_path = str(save_tiny_model(f"{tmp}/tiny"))
        else:
            model_path = "smollm2-135m-instruct"
        results = {}
        for lora_aggregation, transfer_dtype in FORMATS:
            results[lora_aggregation, transfer_dtype] = one_round(
                model_path, lora_aggregation, transfer_dtype, f"{tmp}/{lora_aggregation}-{transfer_dtype}"
            )
    print(f"{'lora_aggregation':<17}{'transfer_dtype':<15}{'adapter bytes':>14}{'up/client':>12}{'down/client':>12}"
          f"{'up ratio':>9}{'max error / max change':>24}{'L2 error / change':>19}")
    for (lora_aggregation, transfer_dtype), (initial, final, record) in results.items():
        adapter = state_nbytes(initial)
        sent = sorted(set(record.bytes_sent.values()))
        received = sorted(set(record.bytes_received.values()))
        errors = ""
        if transfer_dtype != "float32":
            _, exact, _ = results[lora_aggregation, "float32"]
            change = max((exact[key] - initial[key]).abs().max().item() for key in initial)
            gap = max((final[key] - exact[key]).abs().max().item() for key in initial)
            relative = norm({k: final[k] - exact[k] for k in initial}) / norm(
                {k: exact[k] - initial[k] for k in initial}
            )
            errors = f"{gap / change:>24.2e}{relative:>19.2e}"
        print(f"{lora_aggregation:<17}{transfer_dtype:<15}{adapter:>14,}{','.join(f'{s:,}' for s in sent):>12}"
              f"{','.join(f'{r:,}' for r in received):>12}{sent[0] / adapter:>9.3f}{errors}")


def runs_table(run_dirs: list[str]) -> None:
    print(f"{'run':<28}{'transfer_dtype':<15}{'seed':>5}{'up B/round/client':>19}{'down B/round/client':>21}"
          f"{'accuracy':>10}")
    for run_dir in run_dirs:
        transfer_dtype, seed = Path(run_dir).name.rsplit("-seed", 1)
        result = json.loads((Path(run_dir) / "result.json").read_text(encoding="utf-8"))
        up = statistics.mean(value for record in result["rounds"] for value in record["bytes_sent"].values())
        down = statistics.mean(value for record in result["rounds"] for value in record["bytes_received"].values())
        last = max(result["evaluations"], key=int)
        accuracy = result["evaluations"][last]["accuracy"]["Total"]
        print(f"{Path(run_dir).name:<28}{transfer_dtype:<15}{seed:>5}"
              f"{up:>19,.0f}{down:>21,.0f}{accuracy:>10.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--runs", nargs="+", help="output folders of finished `trl-federated run`s to summarise")
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.runs:
        runs_table(options.runs)
    else:
        one_round_table(options.model)


if __name__ == "__main__":
    main()
