"""Real DeepSpeed ZeRO-2 on CPU (one gloo process, `accelerate launch` with examples/accelerate/deepspeed_zero2.yaml):
FedProx and SCAFFOLD act as without DeepSpeed, and under bf16 clients send DeepSpeed's exact float32 values."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_distributed import free_port

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).parent / "scripts" / "engine_round.py"
CONFIG = Path(__file__).parent.parent / "examples" / "accelerate" / "deepspeed_zero2.yaml"


def run(tmp_path, tiny_model_dir, name, mode, overrides=(), mixed_precision=None):
    """tests/scripts/engine_round.py in a process of its own: under `accelerate launch` with DeepSpeed ZeRO-2 and
    `mixed_precision`, or, with None, plain Python. Returns what it wrote."""
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=os.getcwd())
    script = [str(SCRIPT), str(tiny_model_dir), str(out), mode, *overrides]
    if mixed_precision is None:
        command = [sys.executable, *script]
    else:
        accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
        command = [
            accelerate, "launch", "--config_file", str(CONFIG), "--num_processes", "1", "--mixed_precision",
            mixed_precision, "--main_process_port", str(free_port()), *script,
        ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def max_difference(state, other):
    return max((state[key].float() - other[key].float()).abs().max().item() for key in state)


def test_fedprox_and_scaffold_under_zero_2_train_as_without_it(tmp_path, tiny_model_dir):
    """fp32 ZeRO-2, 3 steps of 2 micro-batches with clipping and a linear schedule: each method's adapter and Δc_i
    are the plain Trainer's (ZeRO-2 steps inside `backward`, where a gradient edited before `optimizer.step()` is
    lost), and the corrections moved them away from FedAvg's."""
    plain = run(tmp_path, tiny_model_dir, "plain", "methods", ["fedavg=true"])
    zero_2 = run(tmp_path, tiny_model_dir, "zero2", "methods", mixed_precision="no")
    assert set(zero_2) == {"fedprox", "scaffold-decoupled", "scaffold-gradient"}
    for method, update in zero_2.items():
        assert max_difference(update["state"], plain[method]["state"]) < 1e-6, method
        assert max_difference(plain[method]["state"], plain["fedavg"]["state"]) > 1e-2, method
        if update["control_delta"] is not None:
            assert max_difference(update["control_delta"], plain[method]["control_delta"]) < 1e-5, method


def test_bf16_zero_2_clients_send_deepspeeds_float32_values(tmp_path, tiny_model_dir):
    """bf16 ZeRO-2 casts the model, LoRA included, to bf16; its fp32 copies live in the optimizer. The run completes
    (2 rounds x 2 clients); every client starts from the global adapter exactly and sends float32 updates equal to
    DeepSpeed's fp32 values, which the bf16 module only approximates; the global adapter is not bf16-rounded."""
    result = run(tmp_path, tiny_model_dir, "bf16", "federation", ["bf16=true"], mixed_precision="bf16")
    assert result["rounds"] == 2 and len(result["updates"]) == len(result["engine"]) == 4
    starts = [result["initial"]] * 2 + [result["global_states"][0]] * 2
    for update, engine, start in zip(result["updates"], result["engine"], starts):
        assert max_difference(engine["start"], start) == 0.0  # loaded into the fp32 copies, not from bf16
        assert all(value.dtype == torch.float32 for value in update.values())
        assert max_difference(update, engine["fp32"]) == 0.0
        assert all(value.dtype == torch.bfloat16 for value in engine["module"].values())
        assert max_difference(engine["fp32"], engine["module"]) > 1e-4  # what sending the module would have cost
    global_state = result["global_states"][0]
    assert all(value.dtype == torch.float32 for value in global_state.values())
    assert max_difference(global_state, result["initial"]) > 1e-3  # the round trained
    entries = sum(value.numel() for value in global_state.values())
    representable = sum((value.to(torch.bfloat16).float() == value).sum().item() for value in global_state.values())
    assert representable / entries < 0.01, "the global adapter is bf16-rounded"
