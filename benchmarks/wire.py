"""Bytes each client sends per round, against the size of its adapter, for every wire format.

    python benchmarks/wire.py [--model tiny|default]

One real round of 2 clients (FedAvg, server SGD at lr 1, so the new global adapter is the clients' weighted
average) per format, all from the same seed, so the clients train identically and only the wire differs. Prints
sent/adapter bytes (targets: 1.00 as trained, 0.50 in bfloat16) and how far the bfloat16 aggregate lies from
the float32 one, relative to the round's change of the adapter.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset

from trl_federated import FedAvgAggregator, FederatedRunner, FedGRPOConfig, ServerSGD
from trl_federated.adapters import state_nbytes

FORMATS = [("separate", "float32"), ("separate", "bfloat16"), ("freeze_a", "float32"), ("freeze_a", "bfloat16")]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    options = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if options.model == "tiny":
            from trl_federated.testing import save_tiny_model

            model_path = str(save_tiny_model(f"{tmp}/tiny"))
        else:
            model_path = "smollm2-135m-instruct"
        results = {}
        for lora_aggregation, transfer_dtype in FORMATS:
            results[lora_aggregation, transfer_dtype] = one_round(
                model_path, lora_aggregation, transfer_dtype, f"{tmp}/{lora_aggregation}-{transfer_dtype}"
            )
    print(f"{'lora_aggregation':<17}{'transfer_dtype':<15}{'adapter bytes':>14}{'sent/client':>13}{'ratio':>7}"
          f"{'bf16 error / round change':>27}")
    for (lora_aggregation, transfer_dtype), (initial, final, record) in results.items():
        adapter = state_nbytes(initial)
        sent = sorted(set(record.bytes_sent.values()))
        error = ""
        if transfer_dtype != "float32":
            _, exact, _ = results[lora_aggregation, "float32"]
            change = max((exact[key] - initial[key]).abs().max().item() for key in initial)
            gap = max((final[key] - exact[key]).abs().max().item() for key in initial)
            error = f"{gap / change:.2e}"
        print(f"{lora_aggregation:<17}{transfer_dtype:<15}{adapter:>14,}{','.join(f'{s:,}' for s in sent):>13}"
              f"{sent[0] / adapter:>7.3f}{error:>27}")


if __name__ == "__main__":
    main()
