"""Peak memory of a federated run with many clients against one client: one base model, adapters only per client.

    python benchmarks/memory.py [--model tiny|default] [--clients 1 3 10]

Each configuration runs in its own process (peak RSS is per process); the figure is the ratio of the peaks,
measured side by side in one invocation. Every run does the same number of local steps in total, spread over
its clients, so only the number of clients differs. Target: ratio <= 1.10 at 10 clients.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile

TOTAL_STEPS = 12


def worker(num_clients: int, model: str) -> None:
    import torch
    from datasets import Dataset

    from trl_federated import FederatedRunner, FedGRPOConfig
    from trl_federated.testing import save_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(save_tiny_model(f"{tmp}/tiny")) if model == "tiny" else None
        rounds = 2
        local_steps = max(1, TOTAL_STEPS // (rounds * num_clients))
        args = FedGRPOConfig(
            output_dir=f"{tmp}/run", bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
            per_device_train_batch_size=4, num_generations=4, max_completion_length=16, learning_rate=1e-3,
            num_rounds=rounds, local_steps=local_steps, reward_window=1, save_every_round=False,
        )
        clients = [
            Dataset.from_dict({"prompt": [f"Client {c} question {i}" for i in range(8)]}) for c in range(num_clients)
        ]
        runner = FederatedRunner(
            model_path or "smollm2-135m-instruct", lambda completions, **_: [len(c) / 64 for c in completions], args,
            clients,
        )
        runner.run()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"clients": num_clients, "peak_rss_mib": peak_mib, "local_steps": local_steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 3, 10])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model)
        return
    results = []
    for num_clients in args.clients:
        output = subprocess.run(
            [sys.executable, __file__, "--worker", str(num_clients), "--model", args.model],
            check=True, capture_output=True, text=True,
        ).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
    base = results[0]["peak_rss_mib"]
    print(f"model={args.model}")
    print("| clients | local steps each | peak RSS (MiB) | ratio to 1 client |")
    print("|---:|---:|---:|---:|")
    for result in results:
        print(
            f"| {result['clients']} | {result['local_steps']} | {result['peak_rss_mib']:.0f} | "
            f"{result['peak_rss_mib'] / base:.3f} |"
        )


if __name__ == "__main__":
    main()
