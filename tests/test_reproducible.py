"""When a run is reproducible: two runs of the same command at one thread end on the same bits (what the grid
relies on: its cells run one thread each, `OMP_NUM_THREADS=1`), on the grid's path (the embedded benchmark, sampled
generation from the merged bf16 copy, the shared-prefix loss) with a reward that varies on the tiny model's text."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_twice(tmp_path: Path, tiny_model_dir: Path, threads: int) -> list[tuple[str, list]]:
    results = []
    for attempt in range(2):
        output = tmp_path / f"threads{threads}-run{attempt}"
        command = [
            sys.executable, "-m", "trl_federated.cli", "run", "--model_name_or_path", str(tiny_model_dir),
            "--output_dir", str(output), "--benchmark_size", "48", "--max_eval_samples", "4", "--num_clients", "2",
            "--dirichlet_alpha", "1.0", "--num_rounds", "2", "--local_steps", "2", "--reward_window", "1",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "12",
            "--per_device_eval_batch_size", "4", "--use_cpu", "true", "--bf16", "false",
            "--gradient_checkpointing", "false", "--report_to", "none", "--fast_generation", "true",
            "--shared_prefix", "true", "--temperature", "1.0", "--eval_initial", "false",
            "--reward_funcs", "tests.scripts.federated_run.length_reward",
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        subprocess.run(command, cwd=ROOT, env=environment, check=True, capture_output=True, timeout=900)
        digest = hashlib.sha256((output / "adapter_model.safetensors").read_bytes()).hexdigest()
        rounds = json.loads((output / "result.json").read_text())["rounds"]
        results.append((digest, [record["rewards"] for record in rounds]))
    return results


@pytest.mark.timeout(1800)
def test_two_runs_at_one_thread_end_on_the_same_bits(tmp_path, tiny_model_dir):
    (first_digest, first_rewards), (second_digest, second_rewards) = run_twice(tmp_path, tiny_model_dir, threads=1)
    assert any(reward > 0 for rewards in first_rewards for reward in rewards.values())  # it learned on something
    assert first_rewards == second_rewards
    assert first_digest == second_digest
