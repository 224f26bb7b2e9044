"""The benchmark scripts stay runnable and measure what they claim, on small shapes and the tiny model."""

import argparse
import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from scipy import stats

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_adapter_has_the_qwen25_3b_lora_shape():
    aggregate = load("aggregate")
    state = aggregate.synthetic_adapter(2, torch.Generator().manual_seed(0))
    assert len(state) == 2 * 7 * 2
    prefix = "base_model.model.model.layers.1"
    assert state[f"{prefix}.self_attn.q_proj.lora_A.weight"].shape == (32, 2048)
    assert state[f"{prefix}.self_attn.k_proj.lora_B.weight"].shape == (256, 32)
    assert state[f"{prefix}.mlp.down_proj.lora_A.weight"].shape == (32, 11008)
    assert state[f"{prefix}.mlp.up_proj.lora_B.weight"].shape == (11008, 32)
    per_layer = sum(tensor.numel() for tensor in state.values()) / 2
    assert per_layer * 36 * 4 == pytest.approx(239.5e6, rel=1e-3)  # the whole 3B adapter, float32


def test_aggregate_benchmark_times_both_sides():
    result = load("aggregate").measure(num_clients=2, num_layers=1, repeats=1)
    assert result["copy_s"] > 0 and result["aggregate_s"] > 0 and result["ratio"] > 0
    assert result["adapter_mb"] == pytest.approx(239.5 / 36, rel=1e-3)


def test_overhead_benchmark_runs_equal_steps_and_times_every_phase(tmp_path):
    overhead = load("overhead")
    args = argparse.Namespace(model="tiny", clients=2, rounds=1, local_steps=1, max_completion_length=8)
    setup = overhead.Setup(args, tmp_path)
    plain = overhead.run_plain(setup, tmp_path / "plain")
    federated = overhead.run_federated(setup, tmp_path / "federated")

    assert plain.calls["GRPO steps"] == federated.calls["GRPO steps"] == 2
    assert plain.calls["trainer construction"] == 1
    assert federated.calls["trainer construction"] == 2  # a trainer per client and round
    assert federated.calls["aggregation"] == 1 and federated.calls["checkpoint writes"] == 1
    assert federated.calls[overhead.GC_PHASE] >= 2
    # phases exclude what is nested in them, so together they never exceed the wall time
    for timer in (plain, federated):
        assert 0 < sum(timer.seconds.values()) <= timer.total * 1.001


def test_shared_prefix_benchmark_counts_tokens_and_compares_gradients():
    shared_prefix = load("shared_prefix")
    (result,) = shared_prefix.measure(model="tiny", group_sizes=[4], num_prompts=1, micro_batch=4, repeats=1)
    prompt, completion = shared_prefix.PROMPT_LENGTH, shared_prefix.COMPLETION_LENGTH
    assert result["rows"] == 4 and result["micro_batches"] == 1 and result["distinct_prompts"] == 1
    assert result["standard_model"] == 4 * (prompt + completion)
    assert result["shared_model"] == (prompt - 1) + 4 * (completion + 1)
    assert result["standard_cpu_s"] > 0 and result["shared_cpu_s"] > 0
    assert result["gradient_relative_difference"] <= 1e-5


def test_rollouts_benchmark_generates_equal_work_and_gives_each_row_its_clients_adapter(tiny_model_dir):
    from trl_federated.runtime.models import load_model_and_tokenizer

    rollouts_benchmark = load("rollouts")
    model, tokenizer = load_model_and_tokenizer(str(tiny_model_dir))
    prompts = rollouts_benchmark.rollout_prompts(tokenizer, count=4, min_tokens=0, max_tokens=10**6)
    rollouts = rollouts_benchmark.Rollouts(model, tokenizer, prompts, num_generations=2, max_new_tokens=3)

    by_size = rollouts_benchmark.measure_batch_sizes(rollouts, [2, 4], repeats=2)
    assert [call.completion_tokens for call in by_size[4]] == [4 * 3, 4 * 3]
    calls = rollouts_benchmark.measure_mixed_vs_sequential(rollouts, num_clients=2, rows_per_client=2, repeats=2)
    assert [call.completion_tokens for call in calls["mixed"] + calls["sequential"]] == [2 * 2 * 3] * 4
    assert all(call.seconds > 0 for call in calls["mixed"] + calls["sequential"])

    # The same prompt under both clients' adapters in one batch: each row gets its own client's logits.
    inputs = rollouts.left_padded([prompts[0], prompts[0]])
    with torch.no_grad():
        mixed = rollouts.model(**inputs, adapter_names=["client_0", "client_1"]).logits
        alone = []
        for name in ("client_0", "client_1"):
            rollouts.model.set_adapter(name)
            alone.append(rollouts.model(**inputs).logits[0])
    torch.testing.assert_close(mixed[0], alone[0])
    torch.testing.assert_close(mixed[1], alone[1])
    assert (alone[0] - alone[1]).abs().max() > 100 * (mixed[0] - alone[0]).abs().max()


def test_rollouts_whole_step_gain_counts_only_the_generation_share():
    rollouts_benchmark = load("rollouts")
    assert rollouts_benchmark.whole_step_gain(2.0, generation_share=0.4) == pytest.approx(1 / 0.8)
    assert rollouts_benchmark.whole_step_gain(1.0, generation_share=0.4) == pytest.approx(1.0)


def test_run_profile_gives_every_phase_of_a_cli_run_its_own_peak(tmp_path, tiny_model_dir):
    import accelerate
    from trl import GRPOTrainer

    backward = accelerate.Accelerator.backward
    meter = load("run_profile").main([
        "run", "--output_dir", str(tmp_path), "--model_name_or_path", str(tiny_model_dir),
        "--dataset_name", "reasoning_gym", "--benchmark_size", "24", "--max_eval_samples", "4", "--num_clients", "2",
        "--min_partition_size", "2", "--num_rounds", "1", "--local_steps", "1", "--reward_window", "1",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_generations", "4",
        "--max_completion_length", "8", "--per_device_eval_batch_size", "4", "--use_cpu", "true", "--bf16", "false",
        "--gradient_checkpointing", "false", "--report_to", "none",
    ])  # fmt: skip
    calls = {name: row[0] for name, row in meter.table.items()}
    assert calls["model load"] == 1 and calls["server round"] == 1
    assert calls["evaluation"] == 2  # before training and after the round
    assert calls["trainer construction"] == calls["generation + scoring"] == 2  # a trainer and a step per client
    assert calls["loss forward"] == calls["backward"] == 4  # 2 micro-batches per step
    assert all(row[1] > 0 for row in meter.table.values())
    assert accelerate.Accelerator.backward is backward and "measured" not in GRPOTrainer.__init__.__qualname__


def test_gated_mlp_benchmark_gives_equal_gradients():
    result = load("gated_mlp").measure(model="tiny", repeats=1)
    assert result["gradients_equal"]
    assert result["autograd_cpu_s"] > 0 and result["recomputed_cpu_s"] > 0


def test_gpu_check_runs_the_plain_path_on_cpu_and_builds_its_table(tmp_path):
    """`benchmarks/gpu_check.py`'s CPU setting: the quickstart and one round of each method on the tiny model, in
    this process (the DeepSpeed and concurrent parts need a GPU)."""
    gpu_check = load("gpu_check")
    argv = ["--device", "cpu", "--tiny", "--parts", "quickstart,plain", "--output_dir", str(tmp_path)]
    # the tiny model never earns the accuracy reward; random text earns the letter share unevenly, so adapters move
    assert gpu_check.main([*argv, "--reward_funcs", gpu_check.REWARD]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text(encoding="utf-8"))
    rows = result["rows"]
    assert [(row["part"], row["run"]) for row in rows] == [
        ("quickstart", "3 clients"), ("plain", "fgrpo"), ("plain", "fedprox"), ("plain", "scaffold")
    ]
    for row in rows:
        assert 0 < row["step_s"] < row["round_s"] < row["wall_s"] and row["eval_s"] > 0
        assert "peak_gpu_gib" not in row and "note" not in row
    assert (tmp_path / "fgrpo" / "adapter_model.safetensors").exists()
    fgrpo, fedprox = gpu_check.load_adapter(tmp_path / "fgrpo"), gpu_check.load_adapter(tmp_path / "fedprox")
    assert gpu_check.max_abs_diff(fgrpo, fgrpo) == 0
    assert gpu_check.lora_b_relative_diff(fgrpo, fgrpo) == 0
    # FedProx's proximal term pulls its adapter short of FGRPO's: the two differ by a share of the update
    assert 0 < gpu_check.lora_b_relative_diff(fgrpo, fedprox) < 1
    scaffold_rounds = [json.loads(line) for line in (tmp_path / "scaffold" / "metrics.jsonl").open()]
    assert {record["round_idx"] for record in scaffold_rounds if "round_idx" in record} == {0, 1}
    table = (tmp_path / "gpu_check.md").read_text(encoding="utf-8")
    assert "| part | run | wall_s |" in table and table.count("| plain |") == 3


def test_local_step_speed_benchmark_times_both_paths_against_the_floors(tmp_path, capsys):
    """`benchmarks/local_step_speed.py --tiny --quick`: the quickstart's rows on the tiny model, both paths, every
    figure, and the report's last line the summary of this run's ratios."""
    speed = load("local_step_speed")
    config = str(BENCHMARKS.parent / "examples" / "configs" / "quickstart.yaml")
    argv = ["--config", config, "--tiny", "--quick", "--decode_tokens", "3", "--eval_rows", "4"]
    results = speed.main([*argv, "--output_dir", str(tmp_path)])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary == speed.summary_line(results) and summary.startswith("summary: whole step ")
    assert results["setting"]["steps"] == 1 and results["setting"]["repeats"] == 1  # --quick's
    assert results["setting"]["decode_tokens"] == 3  # a flag given beats --quick's
    assert results["setting"]["rows"] == 8 and results["setting"]["distinct_prompts"] == 2  # 2 prompts x 4
    assert all(value > 0 for value in [*results["floors"].values(), *results["floor"].values()])
    names = {"decode_ms", "prefill_s", "generation_s", "loss_s", "rest_s", "step_s", "evaluation_s", "eval_accuracy"}
    for path in ("today", "fast"):
        assert set(results[path]) == names
        # decode_ms is a difference of two timings: on the tiny model, noise can outweigh it
        assert all(results[path][name] > 0 for name in names - {"eval_accuracy", "rest_s", "decode_ms"})


def test_loss_parts_splits_the_profiled_loss_into_groups_and_its_products_against_their_floor(capsys):
    """`benchmarks/loss_parts.py --tiny`: every profiled operator lands in one group (the groups' seconds sum to the
    operators'), the products carry FLOPs and a floor in their dtype, and the report ends with the summary line."""
    parts = load("loss_parts")
    config = str(BENCHMARKS.parent / "examples" / "configs" / "quickstart.yaml")
    results = parts.main(["--config", config, "--tiny", "--steps", "1"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == parts.summary_line(results)
    assert set(results["groups"]) == set(parts.GROUPS) and results["loss_s"] > 0
    grouped = sum(group["seconds"] for group in results["groups"].values())
    assert grouped == pytest.approx(sum(operator["seconds"] for operator in results["operators"]))
    assert results["groups"]["products"]["calls"] > 0 and results["groups"]["attention"]["calls"] > 0
    products = results["products"]
    assert {product["dtype"] for product in products} <= {"bfloat16", "float32"}
    assert all(product["gflop"] > 0 and product["floor_s"] > 0 for product in products)
    assert results["products_floor_s"] == pytest.approx(sum(product["floor_s"] for product in products))
    assert parts.group_of("aten::add_") == "elementwise and reductions" and parts.group_of("aten::view") == "the rest"


def test_decode_parts_profiles_a_decode_step_as_the_long_generation_less_the_short_one(tiny_model):
    """`decode_parts.operators_per_step`: per decode step, the operators of generating 1 + n tokens less those of 1
    token, over n: each decode step of the tiny model runs its layers' products, one LM head among them."""
    parts = load("decode_parts")
    input_ids = torch.randint(1, 100, (2, 5))

    def generate(new_tokens):
        return tiny_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    rows = {name: (ms, calls) for name, ms, calls in parts.operators_per_step(generate, 3)}
    projections = sum(isinstance(module, torch.nn.Linear) for module in tiny_model.modules())
    assert rows["aten::linear"][1] == projections  # every projection once a step, the LM head included
    assert all(ms > 0 for name, (ms, calls) in rows.items() if calls >= 1 and name.startswith("aten::mm"))


def test_tier_calibration_on_a_run_configs_test_split(tmp_path, tiny_model_dir, capsys):
    """`calibrate_tiers.py --config`: the base model's per-tier and per-(task, tier) rates on a run config's test
    split, evaluated as the run's round -1, or read from a finished run's base evaluation (the same per-item scores)."""
    import yaml

    calibrate = load("calibrate_tiers")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "benchmark_size": 48, "max_completion_length": 4,
        "per_device_eval_batch_size": 4, "use_cpu": True, "bf16": False, "report_to": "none",
    }))  # fmt: skip
    output = tmp_path / "calibration.json"
    assert calibrate.main(["--config", str(config), "--output", str(output), "--max_eval_samples", "6"]) == 0
    measured = json.loads(output.read_text())
    assert measured["test_items"] == 6 and measured["by_tier"]["Total"]["count"] == 6
    assert measured["by_tier"]["Total"]["rate"] == 0.0  # the tiny model answers nothing right
    # 48 items: one test item per (task, tier); the first 6 (grouped by task, then tier) are chain_sum's and products'
    assert set(measured["by_group"]) == {f"{task}/{tier}" for task in ("chain_sum", "products")
                                         for tier in ("simple", "medium", "hard")} | {"Total"}

    capsys.readouterr()
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"evaluations": {"-1": {"row_rewards": scores}, "1": {}}}))
    argv = ["--config", str(config), "--output", str(output), "--max_eval_samples", "6", "--from_result", str(result)]
    assert calibrate.main(argv) == 0
    tiers = json.loads(output.read_text())["by_tier"]
    assert {tier: tiers[tier]["rate"] for tier in tiers} == {"simple": 0.5, "medium": 0.0, "hard": 0.5,
                                                            "Total": pytest.approx(2 / 6)}
    assert tiers["Total"]["stderr"] == pytest.approx((2 / 6 * 4 / 6 / 6) ** 0.5)
    assert "50.0% ± 35.4  (n=2)  (target 50%)" in capsys.readouterr().out.splitlines()[0]
    result.write_text(json.dumps({"evaluations": {"-1": {"row_rewards": scores[:5]}}}))
    with pytest.raises(ValueError, match="scored 5 items"):
        calibrate.main(argv)


def test_server_step_harness_reads_validation_and_the_step_per_round(tmp_path):
    """`benchmarks/server_step.py`: the validation slice takes the first items of every task × tier group in the
    training split's order, splits accuracy into arithmetic and the other tasks by items, and the report holds a
    row per round with the clients' entropy and the server step's diagnostics."""

    from datasets import Dataset

    from trl_federated.reports.compare import Cell

    server_step = load("server_step")
    train = Dataset.from_dict({
        "category": ["gcd", "products", "gcd", "gcd", "products", "chain_sum"],
        "difficulty": ["hard", "hard", "hard", "simple", "hard", "hard"],
        "row": list(range(6)),
    })
    assert server_step.validation_slice(train, 2)["row"] == [0, 1, 2, 3, 4, 5]
    assert server_step.validation_slice(train, 1)["row"] == [0, 1, 3, 5]  # the first of each group
    evaluation = {"accuracy": {"chain_sum": 0.5, "products": 0.0, "gcd": 1.0, "Total": 0.6},
                  "count": {"chain_sum": 2, "products": 2, "gcd": 1, "Total": 5}}
    assert server_step.split_accuracy(evaluation) == {"arith": 25.0, "other": 100.0, "total": pytest.approx(60.0)}

    cell = Cell("fgrpo-adam-norm", 0, 3, "0.05")
    directory = cell.directory(tmp_path)
    directory.mkdir(parents=True)
    record = {"event": "round", "round_idx": 0, "rewards": {"a": 0.5, "b": 0.25}, "server_step_ratio": 1.0,
              "weights": {"a": 0.8, "b": 0.2}, "update_norms": {"a": 1e-9, "b": 0.5}, "delta_norm": 0.1,
              "server_step_cosine": 0.8, "server_step_momentum_cosine": None, "server_step_norm_a": 0.1,
              "server_step_norm_b": 0.2, "client_metrics": {"a": {"entropy": 1.0, "frac_reward_zero_std": 0.5},
                                                            "b": {"entropy": 0.5, "frac_reward_zero_std": 0.25}}}
    idle_round = {**record, "round_idx": 1, "update_norms": {"a": 0.0, "b": 0.0}, "delta_norm": 0.0}  # all alike
    (directory / "metrics.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(idle_round) + "\n")
    (directory / server_step.VALIDATION_FILE).write_text(json.dumps({"0": evaluation}))
    (tmp_path / server_step.BASE_VALIDATION_FILE).write_text(json.dumps({"-1": evaluation}))
    report = server_step.write_report(tmp_path, [cell], "python benchmarks/server_step.py")
    assert "Base model: arithmetic 25.0, other 100.0, total 60.0 (5 items)." in report
    assert ("| fgrpo-adam-norm | 0 | 0 | 25.0 | 100.0 | 60.0 | 0.38 | 0.75 | 0.38 | 0.80 | 0.40 | 1.00 | 0.80 | – | "
            "0.100 | 0.200 |" in report)  # idle ω: a's update is 2e-9 of b's; ‖Δ‖ / mean ‖u‖ = 0.1 / 0.25
    assert server_step.round_rows(directory)[1]["idle_weight"] == 1.0  # every client idle: ‖Δ‖ / mean ‖u‖ undefined
    assert math.isnan(server_step.round_rows(directory)[1]["delta_share"])
    assert (tmp_path / server_step.REPORT_FILE).read_text() == report


def test_dp_cost_calibrates_sigma_to_the_runs_own_accountant_and_reports_each_cell(tmp_path):
    """`benchmarks/dp_cost.py`: σ spends exactly the target ε over the run's rounds under the accountant the run
    uses (R̄'s release under RPG costs more noise for the same ε), and the report reads a finished cell's accuracy,
    the ε its last round reported, its rewards and the σ its folder's budget.json recorded."""
    from trl_federated.aggregation.privacy import ClientLevelPrivacy
    from trl_federated.reports.compare import Cell

    dp_cost = load("dp_cost")
    sigma = dp_cost.noise_multiplier_for(4.0, rounds=2, num_clients=4, sample_size=2, releases_rewards=False)
    mechanism = ClientLevelPrivacy(noise_multiplier=sigma, clip_norm=1.0, num_clients=4, sample_size=2, noise_seed=0)
    assert mechanism.epsilon_after(2) == pytest.approx(4.0, abs=1e-2)
    assert dp_cost.noise_multiplier_for(4.0, rounds=2, num_clients=4, sample_size=2, releases_rewards=True) > sigma

    cell = Cell("fedavg", 0, 4, "1.0")
    directory = cell.directory(tmp_path / "fedavg-eps4")
    directory.mkdir(parents=True)
    budget = {"config": {"local_steps": 2}, "flags": ["--num_rounds", "2", "--dp_noise_multiplier", f"{sigma:.6g}"]}
    (tmp_path / "fedavg-eps4" / "budget.json").write_text(json.dumps(budget))  # σ as the cell ran with it
    (directory / "result.json").write_text(json.dumps({"evaluations": {"-1": {"accuracy": {"Total": 0.1}},
                                                                       "1": {"accuracy": {"Total": 0.25}}}}))
    rounds = [{"event": "round", "round_idx": t, "rewards": {"a": r, "b": 0.0}, "dp_epsilon": e, "dp_noise_std": 0.5,
               "update_norms": {"a": 1.0, "b": u}, "delta_norm": d,
               "client_metrics": {"a": {"train_seconds": 10.0}, "b": {"train_seconds": s}}}
              for t, (r, e, u, d, s) in enumerate([(0.5, 2.5, 0.5, 30.0, 20.0), (1.0, 3.99, 1.5, 50.0, 30.0)])]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in rounds))
    report = dp_cost.write_report(tmp_path, {("fedavg", "4"): cell, ("fgrpo", "4"): cell}, "cmd")
    # base and final accuracy; mean ‖ū‖ over clients then rounds (0.75, 1.25 -> 1), mean ‖Δ‖ over rounds (40), a
    # client's seconds per step (train_seconds / 2 local steps: 5, 10, 5, 15 -> 8.75)
    assert f"| fedavg | 4 | {sigma:.3g} | 10.0 | 25.0 | 3.99 | 0.5 | 1 | 40 | 8.8 | 0.25 0.50 |" in report
    # record-level: ε reached is the worst a client reported, σ each client's own
    budget["flags"] = ["--num_rounds", "2", "--dp_record_epsilon", "4"]
    (tmp_path / "fedavg-eps4" / "budget.json").write_text(json.dumps(budget))
    for record in rounds:
        record["dp_record_epsilon_worst"] = record.pop("dp_epsilon")
    (directory / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in rounds))
    for client, sigma in (("a", 1.2), ("b", 1.25)):  # each client's ledger, with the σ it calibrated
        ledger = directory / "clients" / client / "record-dp-releases.jsonl"
        ledger.parent.mkdir(parents=True)
        ledger.write_text(json.dumps({"noise_multiplier": sigma}) + "\n")
    report = dp_cost.write_report(tmp_path, {("fedavg", "4"): cell}, "cmd", kind="record")
    assert "# What record-level DP costs" in report and "| fedavg | 4 | 1.2-1.25 | 10.0 | 25.0 | 3.99 |" in report
    assert "| fgrpo |" not in report  # not run: no folder
    assert (tmp_path / dp_cost.CURVES_FILE).stat().st_size > 0
    assert "Update norms" not in report  # no cell without DP


def test_dp_cost_reads_the_update_norms_a_clip_norm_is_set_against(tmp_path):
    # norms 0, 0.2, ..., 1 over 3 rounds of 2 clients: quartiles by linear interpolation (statistics' "inclusive")
    dp_cost = load("dp_cost")
    rounds = [{"event": "round", "round_idx": index, "update_norms": {"a": a, "b": b}}
              for index, (a, b) in enumerate([(0.0, 0.4), (0.2, 0.8), (0.6, 1.0)])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in rounds))
    count, quartiles = dp_cost.update_norm_quartiles([tmp_path])
    assert count == 6 and quartiles == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_the_premise_report_regenerates_from_its_committed_cells(tmp_path):
    """benchmarks/results/grid-premise/premise.md is what `premise.py --report_only` writes from the committed cells
    (the harness's command, the cells' figures, the gate, the constant-answer floors), byte for byte but its command
    line, which names the copy's folder."""
    import shutil

    premise = load("premise")
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "grid-premise"
    copy = tmp_path / "grid-premise"
    shutil.copytree(committed, copy)
    (copy / "premise.md").unlink()
    assert premise.main(["--methods", "fedavg", "fgrpo", "fgrpo-noise-aware", "--seeds", "0", "1", "--report_only",
                         "--output_dir", str(copy)]) == 0
    expected = (committed / "premise.md").read_text(encoding="utf-8").replace(
        "--seeds 0 1`", f"--seeds 0 1 --output_dir {copy}`").replace(
        "--grid benchmarks/results/grid-premise`", f"--grid {copy}`")
    assert (copy / "premise.md").read_text(encoding="utf-8") == expected


def test_the_balanced_report_regenerates_from_its_committed_cells_with_tasks_as_its_only_endpoints(tmp_path):
    """benchmarks/results/grid-balanced/balanced.md is what `balanced.py --report_only` writes from the committed
    cells, but its command line; its endpoints are the total, the worst task and each task (a cell's cost is no
    endpoint), and a cell resumed from an attempt that recorded no cost shows its CPU as a lower bound."""
    import shutil

    balanced = load("balanced")
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "grid-balanced"
    copy = tmp_path / "grid-balanced"
    shutil.copytree(committed, copy)
    (copy / "balanced.md").unlink()
    assert balanced.main(["--parallel", "2", "--report_only", "--output_dir", str(copy)]) == 0
    expected = (committed / "balanced.md").read_text(encoding="utf-8").replace(
        "--parallel 2`", f"--parallel 2 --output_dir {copy}`")
    assert (copy / "balanced.md").read_text(encoding="utf-8") == expected
    record = json.loads((copy / "balanced.json").read_text(encoding="utf-8"))
    endpoints = list(record["comparisons"]["fgrpo"]["endpoints"])
    result = json.loads((balanced.Cell("fedavg", 0, 3, "0.05").directory(copy) / "result.json").read_text())
    tasks = sorted(set(result["evaluations"]["-1"]["row_labels"]))
    assert endpoints == ["Total", "worst task", *tasks]
    assert "| fedavg | 2 |" in expected and "| ≥0.49 |" in expected


def test_the_balanced_premise_pilot_gates_on_the_runs_own_z_and_its_report_regenerates_from_the_cells(tmp_path):
    """benchmarks/premise_balanced.py's report from a folder of finished cells: the gate (an RPG variant's mean z over
    its 2 seeds > 2) PENDING until all 6 cells finished, then read from each run's last round record; each RPG variant's
    total accuracy minus FedAvg's paired by seed; `--report_only` writes the same report again from the same cells."""
    from trl_federated.reports.compare import Cell

    script = load("premise_balanced")
    grid = tmp_path / "grid-premise-balanced"
    z = {"fgrpo": (0.5, -0.3), "fgrpo-held-out": (2.4, 1.8)}
    totals = {"fedavg": (0.30, 0.32), "fgrpo": (0.31, 0.30), "fgrpo-held-out": (0.33, 0.34)}

    def write(method, seed):
        directory = Cell(method, seed, 4, None).directory(grid)
        directory.mkdir(parents=True)
        accuracy = {"chain_sum": 0.2, "gcd": totals[method][seed], "Total": totals[method][seed]}
        base = {"accuracy": {"chain_sum": 0.1, "gcd": 0.1, "Total": 0.1}, "row_rewards": [1, 0, 0, 0, 0, 0, 0, 0],
                "row_labels": ["chain_sum"] * 4 + ["gcd"] * 4, "row_gold": ["3", "4", "5", "6", "2", "2", "2", "1"]}
        (directory / "result.json").write_text(json.dumps({"evaluations": {"-1": base, "11": {"accuracy": accuracy}}}))
        rounds = [{"event": "round", "round_idx": t, "rewards": {"client_0": 0.1 * t, "client_1": 0.2},
                   "reward_stderr": {"client_0": 0.03, "client_1": 0.05},
                   **({} if method == "fedavg" else {"gain_predictiveness_run": 0.1, "gain_predictiveness_null": -0.4,
                                                     "gain_predictiveness_z": z[method][seed]})} for t in range(4)]
        (directory / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in rounds))
        (directory / "cost.json").write_text(json.dumps([{"cpu_seconds": 3600.0, "wall_seconds": 3700.0}]))

    for method in ("fedavg", "fgrpo", "fgrpo-held-out"):
        write(method, 0)
    assert script.main(["--report_only", "--output_dir", str(grid)]) == 0
    pending = json.loads((grid / "premise-balanced.json").read_text())
    assert pending["status"] == "PENDING" and pending["gate"]["fgrpo-held-out"] == {"mean_z": 2.4, "seeds": 1}
    for method in ("fedavg", "fgrpo", "fgrpo-held-out"):
        write(method, 1)
    assert script.main(["--report_only", "--output_dir", str(grid)]) == 0
    summary = json.loads((grid / "premise-balanced.json").read_text())
    assert summary["status"] == "PASS"  # held-out: mean z 2.1; the paper's gain 0.1
    assert summary["gate"]["fgrpo"]["mean_z"] == pytest.approx(0.1)
    assert summary["paired"]["fgrpo-held-out"]["by_seed"] == {"0": pytest.approx(3.0), "1": pytest.approx(2.0)}
    assert summary["paired"]["fgrpo"]["mean"] == pytest.approx(-0.5)
    report = (grid / "premise-balanced.md").read_text()
    assert report.startswith("# The premise pilot on the balanced benchmark (PASS)") and script.GATE in report
    assert "- fgrpo-held-out: seed 0 +3.00, seed 1 +2.00; mean +2.50" in report
    # what no information scores: gcd's constant "2" (3 of 4) beats the base model's 0 of 4; chain_sum's base 1 of 4
    assert "| gcd | 4 | 2 | 75.00 | 0.00 | 75.00 |" in report and "reference policy's 50.00" in report
    assert "- fedavg seed 0: 30.00 (**does not beat it**)" in report
    (grid / "premise-balanced.md").unlink()
    assert script.main(["--report_only", "--output_dir", str(grid)]) == 0
    assert (grid / "premise-balanced.md").read_text() == report

    # the follow-up the passed gate calls for: held-out (the only variant past the gate, +2.5 points) at 6 seeds
    assert script.followup_plan(summary) == ("fgrpo-held-out", [0, 1, 2, 3, 4, 5])
    totals.update(fedavg=(0.30, 0.32, 0.30, 0.31, 0.29, 0.30), **{"fgrpo-held-out": (0.33, 0.34, 0.31, 0.33, 0.28,
                                                                                    0.32)})
    z["fgrpo-held-out"] += (0.0,) * 4
    for seed in (2, 3, 4):
        write("fedavg", seed)
        write("fgrpo-held-out", seed)
    assert script.main(["--followup", "--report_only", "--output_dir", str(grid)]) == 0
    followup = json.loads((grid / "premise-balanced-followup.json").read_text())
    differences = [3.0, 2.0, 1.0, 2.0, -1.0]  # seed 5 not finished: 5 paired seeds
    assert followup["status"] == "PARTIAL: 10 of 12 cells finished" and followup["seeds"] == [0, 1, 2, 3, 4]
    assert followup["endpoints"]["Total"]["mean"] == pytest.approx(statistics.fmean(differences))
    assert followup["endpoints"]["Total"]["p"] == pytest.approx(stats.ttest_1samp(differences, 0).pvalue)
    assert "p_holm" not in followup["endpoints"]["Total"]  # the primary is not corrected
    # the secondaries: chain_sum and the worst task (chain_sum's 20 in every cell) do not spread and have no p, so
    # Holm corrects gcd's alone
    assert math.isnan(followup["endpoints"]["worst task"]["p"]) and math.isnan(followup["endpoints"]["chain_sum"]["p"])
    assert followup["endpoints"]["gcd"]["p_holm"] == pytest.approx(followup["endpoints"]["gcd"]["p"])
    assert "Endpoints, named before any cell ran" in (grid / "premise-balanced-followup.md").read_text()


def test_the_premise_follow_up_waits_for_a_passed_gate_and_sizes_itself_by_the_pilots_effect(tmp_path):
    script = load("premise_balanced")
    pilot = {"status": "PASS", "gate": {"fgrpo": {"mean_z": 2.5}, "fgrpo-held-out": {"mean_z": 3.0}},
             "paired": {"fgrpo": {"mean": 1.2}, "fgrpo-held-out": {"mean": 0.4}}}
    # both passed: the larger accuracy difference, under 2 points: 13 seeds
    assert script.followup_plan(pilot) == ("fgrpo", list(range(13)))
    pilot["gate"]["fgrpo"]["mean_z"] = 1.9  # only held-out passed
    assert script.followup_plan(pilot)[0] == "fgrpo-held-out"
    for status in ("FAIL", "PENDING"):
        with pytest.raises(ValueError, match=f"status {status}"):
            script.followup_plan({**pilot, "status": status})
    with pytest.raises(SystemExit):  # no pilot report: a usage error naming it
        script.main(["--followup", "--report_only", "--output_dir", str(tmp_path)])
