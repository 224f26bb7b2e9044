"""The example configs ship with the package (`trl_federated/examples/`, copies of `examples/`): `trl-federated run
--config quickstart` reads them by name where no clone is at hand, and `--accelerate_config cpu_two_processes` launches
the run on the processes an accelerate config describes, as `trl grpo --accelerate_config` does."""

import fnmatch
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from trl_federated.arguments.shipped import SHIPPED, shipped_file, shipped_names
from trl_federated.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_configs_are_the_examples_byte_for_byte_and_in_the_package_data():
    for folder, pattern in (("configs", "*.yaml"), ("accelerate", "*.yaml"), ("flower", "pyproject.toml")):
        examples = ROOT / "examples" / folder
        source = {path.relative_to(examples): path for path in examples.rglob(pattern)}
        copies = {path.relative_to(SHIPPED / folder): path for path in (SHIPPED / folder).rglob(pattern)}
        assert sorted(copies) == sorted(source), f"trl_federated/examples/{folder} is not examples/{folder}: copy it"
        for name, path in source.items():
            assert copies[name].read_bytes() == path.read_bytes(), f"trl_federated/examples/{folder}/{name}: copy it"
    # every copy travels in the wheel: setup.py's package_data names it
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    patterns = yaml.safe_load("[" + setup.split('"trl_federated": [', 1)[1].split("]", 1)[0] + "]")
    for path in [*SHIPPED.rglob("*.yaml"), *SHIPPED.rglob("*.toml")]:
        relative = str(path.relative_to(SHIPPED.parent))
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative


def test_run_reads_a_shipped_config_by_name_outside_a_clone(tmp_path, monkeypatch):
    import trl_federated.federation as federation

    monkeypatch.chdir(tmp_path)  # no examples/ here, as after a pip install
    assert "quickstart" in shipped_names("configs") and "paper/fgrpo" in shipped_names("configs")
    assert shipped_file("quickstart", "configs") == shipped_file("examples/configs/quickstart.yaml", "configs")
    assert shipped_file("absent", "configs") == "absent"  # left for the reader to refuse, by its name
    parsed = []
    monkeypatch.setattr(federation, "run_federation", lambda *arguments: parsed.append(arguments) or 0)
    assert main(["run", "--config", "quickstart", "--use_cpu", "true", "--bf16", "false", "--num_rounds", "1"]) == 0
    ((args, _, data_args),) = parsed
    quickstart = yaml.safe_load((ROOT / "examples" / "configs" / "quickstart.yaml").read_text(encoding="utf-8"))
    assert (args.output_dir, args.num_clients, args.local_steps) == (
        quickstart["output_dir"], quickstart["num_clients"], quickstart["local_steps"])
    assert data_args.benchmark_size == quickstart["benchmark_size"] and args.num_rounds == 1


def test_run_launches_on_the_processes_a_shipped_accelerate_config_names(tmp_path, tiny_model_dir):
    """`--accelerate_config cpu_two_processes`: two gloo processes on the CPU, each training its half of every
    client's batch (a reward that records the process it ran in), the outputs written once."""
    (tmp_path / "rank_reward.py").write_text(textwrap.dedent("""
        import os
        from pathlib import Path

        def rank_reward(completions, **kwargs):
            Path(__file__).with_name(f"rank-{os.environ.get('RANK', 'none')}").touch()
            return [len(str(completion)) / 64 for completion in completions]
    """), encoding="utf-8")
    argv = [
        "run", "--accelerate_config", "cpu_two_processes", "--model_name_or_path", str(tiny_model_dir),
        "--output_dir", str(tmp_path / "out"), "--num_clients", "2", "--dirichlet_alpha", "inf", "--num_rounds", "1",
        "--local_steps", "1", "--benchmark_size", "24", "--max_eval_samples", "4", "--eval_initial", "false",
        "--per_device_train_batch_size", "2", "--num_generations", "4", "--max_completion_length", "8",
        "--per_device_eval_batch_size", "2", "--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing",
        "false", "--report_to", "none", "--reward_funcs", "rank_reward.rank_reward",
        "--eval_reward_funcs", "rank_reward.rank_reward",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    result = subprocess.run([sys.executable, "-m", "trl_federated.cli", *argv], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(path.name for path in tmp_path.glob("rank-*")) == ["rank-0", "rank-1"]
    events = [line for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if '"round"' in line]
    assert len(events) == 1 and (tmp_path / "out" / "adapter_model.safetensors").is_file()
