"""The main job end to end on the tiny model: the drop-in federated mode and the `trl-federated run` CLI."""

import importlib.util
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from trl import ModelConfig

from conftest import OPEN_R1_FIXTURE, length_reward
from trl_federated import FedGRPOTrainer
from trl_federated.adapters import default_lora_config, get_adapter_state, with_federated_adapter
from trl_federated.arguments import BenchmarkArguments, parse_run_args
from trl_federated.cli import main
from trl_federated.data.loading import load_benchmark
from trl_federated.names import closest_key_hint
from trl_federated.runtime.models import load_model, lora_config
from trl_federated.scoring.rewards import check_reward_columns, reward_functions, training_rewards

ROOT = Path(__file__).resolve().parents[1]


def labelled_dataset(n=24):
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)],
            "answer": [str(2 * i) for i in range(n)],
            "difficulty": [("simple", "medium", "hard")[i % 3] for i in range(n)],
        }
    )


def test_drop_in_federates_when_num_clients_above_one(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, caplog):
    args = fast_args(num_clients=3, dirichlet_alpha=float("inf"), num_rounds=2, local_steps=1, reward_window=1)
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=labelled_dataset(), processing_class=tiny_tokenizer, peft_config=default_lora_config(),
    )
    initial = {k: v.clone() for k, v in get_adapter_state(trainer.model).items()}
    with caplog.at_level(logging.INFO, logger="trl_federated.core.server"):
        output = trainer.train()
    assert f"The global adapter is in {(tmp_path / 'run').resolve()}" in caplog.text  # where `train()` left it
    assert output.global_step == 3 * 2 * 1  # clients x rounds x local steps
    assert output.metrics["num_rounds"] == 2
    final = get_adapter_state(trainer.model)
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {line["client_id"] for line in lines if line["event"] == "client"} == {"client_0", "client_1", "client_2"}
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_drop_in_evaluates_a_trl_style_eval_set_with_the_training_reward(
    tmp_path, tiny_model_dir, tiny_tokenizer, fast_args
):
    """A TRL-style eval set (`prompt`, `solution`, no label column) is scored by the training reward, which gets
    the `solution` column, and reported as a Total only."""

    def solution_reward(completions, solution, **kwargs):
        return [len(completion) / 64 + float(gold) / 100 for completion, gold in zip(completions, solution)]

    train = labelled_dataset().map(lambda row: {"solution": row["answer"]}).remove_columns("answer")
    trl_eval = Dataset.from_dict({"prompt": [f"What is {i} + 1?" for i in range(3)], "solution": ["1", "2", "3"]})
    args = fast_args(num_clients=2, dirichlet_alpha=float("inf"), num_rounds=1, local_steps=1, reward_window=1)
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=solution_reward, args=args,
        train_dataset=train, eval_dataset=trl_eval, processing_class=tiny_tokenizer, peft_config=default_lora_config(),
    )
    trainer.train()
    evaluations = [line for line in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
                   if line["event"] == "evaluation"]
    assert [line["round_idx"] for line in evaluations] == [-1, 0]
    for line in evaluations:
        assert list(line["accuracy"]) == ["Total"] and line["count"] == {"Total": 3}
        assert line["accuracy"]["Total"] > 0  # scored by solution_reward, not by a correctness reward
        assert line["rewards"] == {"solution_reward": line["accuracy"]["Total"]}


def test_drop_in_rejects_a_missing_partition_column(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(num_clients=2, partition_column="category")
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=labelled_dataset(), processing_class=tiny_tokenizer, peft_config=default_lora_config(),
    )
    with pytest.raises(ValueError, match="'category'"):
        trainer.train()
    # without `prompt`: named with the fix, before any client trains (TRL would fail at the first local step)
    trainer.train_dataset = labelled_dataset().rename_column("prompt", "question")
    with pytest.raises(ValueError, match=r"no `prompt` column.*rename_column\('question', 'prompt'\)"):
        trainer.train()


def test_cli_run_end_to_end(tmp_path, tiny_model_dir, caplog, monkeypatch):
    output_dir = tmp_path / "cli-run"
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(output_dir),
                "model_name_or_path": str(tiny_model_dir),
                "dataset_name": "reasoning_gym",
                "benchmark_size": 60,
                "max_eval_samples": 12,
                "num_clients": 3,
                "dirichlet_alpha": 0.5,
                "min_partition_size": 2,
                "num_rounds": 2,
                "local_steps": 1,
                "reward_window": 1,
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "max_completion_length": 8,
                "per_device_eval_batch_size": 8,
                "use_cpu": True,
                "bf16": False,
                "gradient_checkpointing": False,
                "report_to": "none",
                "reward_funcs": ["accuracy", "format"],
            }
        )
    )
    # a machine whose 2 cores are both busy: one thread, not two spinning against the other job
    import trl_federated.federation as federation

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(federation, "usable_cores", lambda: 2)
    monkeypatch.setattr(federation.os, "getloadavg", lambda: (2.5, 2.0, 1.5))
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="trl_federated"):
        assert main(["run", "--config", str(config), "--num_rounds", "2", "--aggregation", "rpg"]) == 0
    assert torch.get_num_threads() == 1
    # on the CPU, before the data and the model load: the threads and why, and the demo's time where measured
    notices = [index for index, record in enumerate(caplog.records) if record.getMessage().startswith("CPU run on ")]
    assert len(notices) == 1
    notice = caplog.records[notices[0]].getMessage()
    assert "1 thread a process, for the cores the load average 2.50 leaves free" in notice
    assert not any(record.name.startswith("trl_federated.data") for record in caplog.records[: notices[0]])

    for name in ("metrics.jsonl", "summary.md", "rewards.png", "weights.png", "accuracy.png",
                 "adapter_model.safetensors", "adapter_config.json"):
        assert (output_dir / name).exists(), name
    assert (output_dir / "round-1" / "adapter_model.safetensors").exists()
    summary = (output_dir / "summary.md").read_text()
    assert "Before training" in summary and "Total" in summary
    # "Round t" and the per-round table's t are the global adapters' round-<t>/ folders (0-based)
    assert sorted(path.name for path in output_dir.glob("round-*")) == ["round-0", "round-1"]
    assert re.findall(r"^\| Round (\d+) \|", summary, re.MULTILINE) == ["1"]  # evaluated before training and at the end
    # the round's metrics (τ, RPG's predictiveness, "-" where a round has none), then the client
    assert re.findall(r"^\| (\d+) \| [^|]+(?: \| [^|]+)* \| client_0 \|", summary, re.MULTILINE) == ["0", "1"]
    assert re.search(r"Evaluation: \d+ rows, greedy, [\d.]+ s per pass \(2 passes", summary)
    # Table 4's quantity: one adapter up and one down per client and round
    adapter = load_file(output_dir / "adapter_model.safetensors")
    adapter_bytes = sum(tensor.numel() * tensor.element_size() for tensor in adapter.values())
    mib = f"{adapter_bytes / 2**20:.3f} MiB"
    assert f"{mib} sent ({adapter_bytes:,} bytes, its adapter), {mib} received ({adapter_bytes:,} bytes" in summary
    events = [json.loads(line)["event"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert events.count("round") == 2 and events.count("evaluation") == 2 and events.count("client") == 6


def test_a_cpu_run_takes_the_free_cores_and_promises_a_time_only_on_a_measured_kind_of_cpu():
    # one line: the threads, from the cores the load leaves free (one when the load exceeds the cores), and the demo's
    # time only where docs/getting-started.md measured it on this kind of CPU
    from trl_federated.federation import DEMO_TIMES, cpu_run_notice
    from trl_federated.runtime.devices import free_cpu_threads

    assert [free_cpu_threads(1, cores=2, load=load) for load in (0.0, 0.4, 1.0, 2.0, 4.8)] == [2, 2, 1, 1, 1]
    assert free_cpu_threads(1, cores=16, load=3.2) == 13 and free_cpu_threads(2, cores=16, load=0.0) == 8
    guide = " ".join((ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8").split())
    for times in DEMO_TIMES.values():
        assert all(figure in guide for figure in re.findall(r"\d+ (?:h \d+ )?min(?: \d+ s)?", times)), times
    quiet = cpu_run_notice("AMD EPYC", 2, True, 2, 0.1, threads_set=False)
    assert quiet.startswith("CPU run on 2 cores (AMD EPYC) with native bf16") and "\n" not in quiet
    assert "2 threads a process, for the cores the load average 0.10 leaves free" in quiet
    assert "`make demo` took 4 min 37 s (quiet, the first benchmark, 2026-11-26) on 2 cores of this kind" in quiet
    xeon = cpu_run_notice("Intel(R) Xeon(R) Processor", 2, True, 2, 0.1, threads_set=False)
    assert "`make demo` took 4 min 25 s (quiet, 2026-11-28) on 2 cores of this kind" in xeon
    busy = cpu_run_notice("AMD EPYC", 2, True, 1, 4.8, threads_set=False)
    assert "1 thread a process, for the cores the load average 4.80 leaves free" in busy
    assert "takes longer beside other jobs" in busy
    elsewhere = cpu_run_notice("Intel(R) Xeon(R) Processor", 4, True, 2, 0.0, threads_set=False)
    assert "no `make demo` time was measured on this kind of CPU" in elsewhere and " min " not in elsewhere
    assert "3 threads a process, as OMP_NUM_THREADS sets" in cpu_run_notice("AMD EPYC", 8, False, 3, 0.0, True)


def test_cli_takes_a_reward_model_by_path(tiny_model_dir):
    # kept as given: FederatedRunner loads it once for the whole run (tests/test_runner.py)
    assert reward_functions(["accuracy", str(tiny_model_dir)])[1] == str(tiny_model_dir)


def test_cli_rejects_unknown_reward_before_touching_the_output_dir(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")  # a previous run's, which overwrite would clear
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir", "true", "--model_name_or_path",
              str(tiny_model_dir), "--bf16", "false", "--reward_funcs", "accuracy", "vibes"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("trl-federated run: error: Unknown `reward_funcs` 'vibes';") and error.count("\n") == 1
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == "{}\n"
    with pytest.raises(SystemExit) as exit_info:  # TRL's accuracy_reward reads `solution`, which the data lacks
        main(["run", "--output_dir", str(tmp_path / "out"), "--overwrite_output_dir", "true", "--model_name_or_path",
              str(tiny_model_dir), "--bf16", "false", "--benchmark_size", "40", "--reward_funcs", "accuracy_reward"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("trl-federated run: error: `reward_funcs`: accuracy_reward (trl.rewards")
    assert "['solution']" in error and error.count("\n") == 1
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == "{}\n"


def test_cli_without_command_prints_usage(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_paper_benchmarks_read_their_source():
    train, test = load_benchmark(
        BenchmarkArguments(dataset_name="open_r1", benchmark_source=str(OPEN_R1_FIXTURE), max_eval_samples=4)
    )
    assert (len(train), len(test)) == (18, 4) and "difficulty" in train.column_names and "image" in test.column_names
    _, capped = load_benchmark(
        BenchmarkArguments(dataset_name="open_r1", benchmark_source=str(OPEN_R1_FIXTURE), max_pixels=24 * 24)
    )
    assert {image.size for image in capped["image"]} == {(24, 24)}  # the fixture's figures are 48 x 48
    for name, value in (("benchmark_source", str(OPEN_R1_FIXTURE)), ("max_pixels", 24 * 24)):
        with pytest.raises(ValueError, match=name):
            load_benchmark(BenchmarkArguments(dataset_name="reasoning_gym", **{name: value}))


# `trl-federated run` flags that parse on a machine without a GPU.
CPU_FLAGS = ["--output_dir", "unused", "--bf16", "false", "--use_cpu", "true"]


def test_cli_refuses_flag_prefixes(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse would take it for --num_rounds
        main(["run", "--output_dir", str(tmp_path), "--model_name_or_path", str(tmp_path / "absent"), "--bf16",
              "false", "--num_round", "3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "trl-federated run: error: unknown flag `--num_round`. Did you mean `--num_rounds`?\n"
    )


def test_cli_names_a_misspelled_yaml_key_and_the_closest_valid_one_in_one_line(tmp_path, capsys):
    # TRL's parser raised "Unknown arguments from config file: ['--num_round', '2']" after a traceback
    config = tmp_path / "run.yaml"
    config.write_text("num_round: 2\nlearning_rate: 1.0e-4\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(["--config", str(config), *CPU_FLAGS])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"trl-federated run: error: unknown key `num_round` in {config}. Did you mean `num_rounds`?\n"
    )
    config.write_text("dataset_streaming: true\n", encoding="utf-8")  # TRL's script argument: its equivalent
    with pytest.raises(SystemExit):
        parse_run_args(["--config", str(config), *CPU_FLAGS])
    assert "cannot stream the dataset" in capsys.readouterr().err


def test_the_names_checked_before_trl_imports_are_the_parsers(tmp_path, monkeypatch):
    from trl_federated.arguments import flags, known_flags, parsing

    assert Path(known_flags.__file__).read_text(encoding="utf-8") == parsing.known_flags_source(), (
        "rewrite it: python -m trl_federated.arguments.parsing"
    )
    # the parsers, recorded in a fresh interpreter as the command line runs: without the names that tests register
    probe = "import sys\nfrom trl_federated.arguments import parsing\nsys.stdout.write(parsing.known_parsers_source())"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, encoding="utf-8",
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert flags.KNOWN_PARSERS.read_text(encoding="utf-8") == result.stdout, (
        "rewrite it: python -m trl_federated.arguments.parsing"
    )
    config = tmp_path / "run.yaml"
    config.write_text("num_round: 2\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        flags.check_before_import(["--config", str(config)])
    # other versions of TRL or transformers, or a trainer's own config class: the parser names the fields
    flags.check_before_import(["--config", str(config), "--trainer_config_class", "my_lib:MyConfig"])
    monkeypatch.setattr(flags, "installed_versions", lambda: ("0.0", "0.0"))
    flags.check_before_import(["--config", str(config)])


@pytest.mark.parametrize("columns", ["70", "160"])
def test_the_recorded_parser_prints_the_parsers_help(monkeypatch, columns, registries_as_recorded):
    # `run --help` before TRL imports prints the recorded parser's help: the parser's, text for text, whatever the
    # terminal's width
    from trl_federated.arguments import flags, parsing
    from trl_federated.config import CONFIG_CLASSES

    monkeypatch.setenv("COLUMNS", columns)
    for algorithm, config in CONFIG_CLASSES.items():
        assert flags.recorded_parser(algorithm).format_help() == parsing.run_parser(config).format_help(), algorithm
    assert flags.recorded_parser("ppo") is None
    from trl_federated.choices import AGGREGATIONS, Aggregation

    monkeypatch.setitem(AGGREGATIONS, "own", Aggregation(None))  # registered in this process: the parser's choices
    assert flags.recorded_parser("grpo") is None


def stderr_of(call, capsys) -> str | None:
    """What `call()` wrote to stderr as it exited with status 2, or None when it returned."""
    try:
        call()
    except SystemExit as stop:
        assert stop.code == 2
        return capsys.readouterr().err
    return None


def test_value_errors_answered_before_trl_imports_are_the_parsers(tmp_path, capsys, registries_as_recorded):
    """A value that does not convert, or is outside its field's choices, is refused from the record in the words the
    parser refuses it with; a type the record leaves to the parser (TRL's `DebugOption`), a range the config checks
    (`__post_init__`), and `--help` beside a YAML (its values are the defaults --help shows) are the parser's."""
    from trl_federated.arguments import flags

    config = tmp_path / "run.yaml"
    config.write_text("num_rounds: abc\n", encoding="utf-8")
    refused = [
        ["--num_rounds", "abc"], ["--learning_rate", "x"], ["--max_eval_samples", "x"], ["--bf16", "maybe"],
        ["--bf16", "false", "--num_rounds", "abc"], ["--eval_strategy", "steps", "--num_rounds", "abc"],
        ["--num_rounds"], ["--aggregation", "foo"], ["--algorithm", "dapo", "--epsilon_high", "x"],
        ["--config", str(config)], ["--config", str(config), "--num_rounds", "2", "--seed", "x"],
    ]  # fmt: skip
    for argv in refused:
        fast = stderr_of(lambda: flags.check_before_import(argv), capsys)
        assert fast is not None and fast.count("\n") == 1, argv
        assert fast == stderr_of(lambda: parse_run_args(argv), capsys), argv
    for argv in (["--num_rounds", "-1"], ["--debug", "foo", "--num_rounds", "abc"], ["--config", str(config), "-h"]):
        assert stderr_of(lambda: flags.check_before_import(argv), capsys) is None, argv
    assert "invalid DebugOption value: 'foo'" in stderr_of(lambda: parse_run_args(["--debug", "foo"]), capsys)


def test_the_flower_run_config_and_the_yaml_share_one_hint():
    from trl_federated.flower import run_config

    assert run_config.closest_key_hint is closest_key_hint
    assert closest_key_hint("num-roundz", ["num-rounds", "local-steps"]) == " Did you mean `num-rounds`?"
    assert closest_key_hint("zzz", ["num-rounds"]) == ""


def test_cli_takes_trl_grpo_reward_names_dotted_paths_and_a_reward_model(tiny_model_dir):
    from trl.rewards import accuracy_reward as trl_accuracy_reward
    from trl.rewards import think_format_reward

    from trl_federated.scoring.rewards import answer_accuracy_reward

    assert reward_functions(["accuracy_reward", "think_format_reward"]) == [trl_accuracy_reward, think_format_reward]
    assert reward_functions(["trl_federated.scoring.rewards.answer_accuracy_reward"]) == [answer_accuracy_reward]
    # The name this reward had before it stopped sharing TRL's: the refusal names the new one.
    with pytest.raises(ValueError, match=r"no attribute 'accuracy_reward'\. Did you mean `answer_accuracy_reward`\?"):
        reward_functions(["trl_federated.scoring.rewards.accuracy_reward"])
    assert callable(reward_functions(["get_soft_overlong_punishment"])[0])
    with pytest.raises(ValueError, match="reward_funcs.*cannot import module 'no_such_pkg.rewards'"):
        reward_functions(["no_such_pkg.rewards.mine"])
    with pytest.raises(ValueError, match="Did you mean `accuracy_reward`"):
        reward_functions(["acuracy_reward"])
    # `trl grpo`'s --reward_model_name_or_path comes first; alone, it replaces the default `accuracy`
    _, _, data_args = parse_run_args([*CPU_FLAGS, "--reward_model_name_or_path", str(tiny_model_dir)])
    assert training_rewards(data_args) == [str(tiny_model_dir)]
    _, _, data_args = parse_run_args([*CPU_FLAGS, "--reward_model_name_or_path", str(tiny_model_dir),
                                      "--reward_funcs", "format"])
    assert training_rewards(data_args)[0] == str(tiny_model_dir) and len(training_rewards(data_args)) == 2
    _, _, data_args = parse_run_args(CPU_FLAGS)
    assert training_rewards(data_args) == [answer_accuracy_reward]


def test_cli_refuses_a_trl_reward_whose_column_the_data_lacks_naming_the_equivalent():
    from trl_federated.scoring.rewards import answer_accuracy_reward

    rows = Dataset.from_dict({"prompt": ["1+1?"], "answer": ["2"]})
    check_reward_columns([answer_accuracy_reward, "org/reward-model"], rows)
    with pytest.raises(ValueError, match=r" accuracy_reward \(trl\.rewards.*\['solution'\].*`accuracy` is this.*"
                       r"`answer_accuracy_reward`"):
        check_reward_columns(reward_functions(["accuracy_reward"]), rows)


def test_cli_passes_dataset_config_to_load_dataset(monkeypatch):
    import datasets

    calls = []
    splits = {"train": Dataset.from_dict({"prompt": ["a"]}), "test": Dataset.from_dict({"prompt": ["b"]})}
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append(args) or splits)
    load_benchmark(BenchmarkArguments(dataset_name="org/data", dataset_config="main"))
    assert calls == [("org/data", "main")]
    with pytest.raises(ValueError, match="dataset_config"):
        load_benchmark(BenchmarkArguments(dataset_name="reasoning_gym", dataset_config="main"))


@pytest.mark.parametrize("attn_implementation, dtype", [("eager", torch.bfloat16), ("sdpa", torch.float32)])
def test_cli_loads_the_model_as_model_config_asks(tiny_model_dir, attn_implementation, dtype):
    args, model_args, _ = parse_run_args(
        [*CPU_FLAGS, "--model_name_or_path", str(tiny_model_dir), "--attn_implementation", attn_implementation,
         "--dtype", str(dtype).removeprefix("torch.")]
    )
    model, _ = load_model(model_args, args)
    assert model.config._attn_implementation == attn_implementation
    assert model.dtype == dtype


def test_cli_lora_fields_shape_the_adapter(tiny_model_dir):
    _, model_args, _ = parse_run_args(CPU_FLAGS)
    default = lora_config(model_args)
    for name in ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type"):
        assert getattr(default, name) == getattr(default_lora_config(), name), name

    # Without --use_peft: the federation always trains LoRA, so the lora_* flags alone set it.
    _, model_args, _ = parse_run_args([*CPU_FLAGS, "--lora_target_modules", "q_proj", "v_proj", "--lora_r", "4"])
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 0, lora_config(model_args))
    adapted = {name.split(".")[-3] for name, _ in model.named_modules() if name.endswith("lora_A.default")}
    assert adapted == {"q_proj", "v_proj"}
    assert {tensor.shape[0] for name, tensor in get_adapter_state(model).items() if "lora_A" in name} == {4}

    _, model_args, _ = parse_run_args([*CPU_FLAGS, "--use_peft", "false"])
    with pytest.raises(ValueError, match="use_peft"):
        lora_config(model_args)


def test_cli_refuses_model_fields_it_cannot_honour(tiny_model_dir, fast_args):
    args = fast_args()
    if importlib.util.find_spec("bitsandbytes") is None:  # where it is installed, QLoRA loading is TRL's own path
        with pytest.raises(ValueError, match="load_in_4bit"):
            load_model(ModelConfig(model_name_or_path=str(tiny_model_dir), load_in_4bit=True), args)
    with pytest.raises(ValueError, match="bnb_4bit_quant_type"):  # read only with load_in_4bit
        load_model(ModelConfig(model_name_or_path=str(tiny_model_dir), bnb_4bit_quant_type="fp4"), args)
    with pytest.raises(ValueError, match="model_revision"):  # the embedded default model has no revisions
        load_model(ModelConfig(model_revision="v1.0"), args)
    with pytest.raises(ValueError, match="attn_implementation"):
        load_model(ModelConfig(), fast_args(model_init_kwargs={"attn_implementation": "eager"}))


def test_cli_faults_are_one_line_errors_naming_the_field_and_the_fix(tmp_path, capsys):
    """A bad value in the YAML gets the one line a bad flag gets; a method name given as `--aggregation` gets the
    settings that make it; a missing --config, a reward window longer than the local steps, a misspelled built-in
    dataset, a reward function that does not exist and a model folder that does not exist are one line each, before
    any data or model loads."""
    from trl_federated.choices import AGGREGATIONS  # the built-in four, and any a test registered before

    config = tmp_path / "run.yaml"
    config.write_text("aggregation: fedavgg\n", encoding="utf-8")
    cases = [
        (["--config", str(config)],
         f"`aggregation: fedavgg` in {config} is not one of {list(AGGREGATIONS)}. Did you mean `fedavg`?"),
        (["--aggregation", "fgrpo"],
         f"argument --aggregation: invalid choice: 'fgrpo' (choose from {', '.join(map(repr, AGGREGATIONS))}). "
         "`fgrpo` names the method FGRPO; `run` takes it as `--aggregation rpg --server_optimizer sgd`."),
        (["--config", str(tmp_path / "absent.yaml")],
         f"cannot read --config {tmp_path / 'absent.yaml'}: No such file or directory."),
        (["--local_steps", "1", "--reward_window", "2"], "`reward_window` (W=2) must not exceed `local_steps` (E=1)."),
        (["--dataset_name", "openr1"], "unknown `dataset_name` 'openr1'. Did you mean `open_r1`?"),
        (["--reward_funcs", "trl_federated.scoring.rewards.accuracy_reward"],
         "`reward_funcs` 'trl_federated.scoring.rewards.accuracy_reward': module 'trl_federated.scoring.rewards' has "
         "no attribute 'accuracy_reward'. Did you mean `answer_accuracy_reward`?"),
        (["--eval_reward_funcs", "accuracy_rewrd"],
         "Unknown `eval_reward_funcs` 'accuracy_rewrd'; choose among ['accuracy', 'format', 'accuracy_reward', "
         "'reasoning_accuracy_reward', 'think_format_reward', 'get_soft_overlong_punishment'], a function's dotted "
         "import path (`my_lib.rewards.custom_reward`), or a reward model's Hub id (`org/name`) or local folder. Did "
         "you mean `accuracy_reward`?"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["run", *CPU_FLAGS, *flags])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"trl-federated run: error: {message}\n", flags
    absent = tmp_path / "models" / "smol"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *CPU_FLAGS, "--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(absent)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"trl-federated run: error: `model_name_or_path` '{absent}': no such folder.")
    assert error.count("\n") == 1 and not (tmp_path / "out").exists()
