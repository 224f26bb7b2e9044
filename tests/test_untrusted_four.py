"""Issue 59: untrusted clients and private rounds, part four. Each attack of the issue, driven through the server core
(`FederatedServer`, with replies made up as an adversary would send them, as in test_untrusted.py) and, where a path
exists, the Flower records."""

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from test_untrusted import honest_round, make_server, moved
from trl_federated import ClientUpdate
from trl_federated.adapters import InvalidUpdateError, with_federated_adapter
from trl_federated.aggregation import aggregator_from_config
from trl_federated.aggregation.privacy import DamagedLedgerError
from trl_federated.core.server import FederatedServer

# 1. The DP release ledger ---------------------------------------------------------------------------------------

DP = dict(dp_noise_multiplier=1.0, dp_noise_seed=7, update_norm_bound=None, save_total_limit=None)


def released(run_dir, round_idx):
    """The global adapter a DP run released in round `round_idx` (its checkpoint's)."""
    return load_file(run_dir / f"checkpoint-{round_idx}" / "adapter_model.safetensors")


def ledger(run_dir):
    return [json.loads(line) for line in (run_dir / "dp-releases.jsonl").read_text().splitlines()]


def dp_run(tmp_path, tiny_model_dir, fast_args, name, rounds, **overrides):
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / name), **{**DP, **overrides})
    first = server.start_run()
    records = [honest_round(server, round_idx) for round_idx in range(first, first + rounds)]
    server.close()
    return server, records


def test_a_resume_into_another_folder_draws_fresh_noise_and_charges_it(tmp_path, tiny_model_dir, fast_args, caplog):
    """Resuming A/checkpoint-0 into folder B used to read B's empty ledger, count the checkpoint's one release and
    draw round 1's noise again: the two releases of round 1 differed by the clients' updates alone, and ε was not
    charged. Now B's ledger starts from the checkpoint's, the resumed process draws fresh noise, and ε counts it."""
    caplog.set_level(logging.INFO, logger="trl_federated.aggregation.privacy")
    _, whole = dp_run(tmp_path, tiny_model_dir, fast_args, "a", 2)
    _, resumed = dp_run(tmp_path, tiny_model_dir, fast_args, "b", 1,
                        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-0"))
    # the same clients sent the same updates in both: only the noise can tell the two releases of round 1 apart
    first, again = released(tmp_path / "a", 1), released(tmp_path / "b", 1)
    difference = torch.cat([(first[key] - again[key]).view(-1) for key in first])
    assert difference.std() > 0.5 * torch.cat([value.view(-1) for value in first.values()]).std()
    assert resumed[0].dp_epsilon == whole[1].dp_epsilon > whole[0].dp_epsilon  # two releases counted in B too
    entries = ledger(tmp_path / "b")
    assert [entry["event"] for entry in entries] == [entry["event"] for entry in ledger(tmp_path / "a")]
    assert entries[0]["from_checkpoint"] and entries[1]["session"] is not None  # the fresh randomness, recorded
    assert "draws fresh noise (session" in caplog.text


def test_a_ledger_that_does_not_start_with_the_checkpoints_is_refused_by_name(tmp_path, tiny_model_dir, fast_args):
    """σ rewritten to 100 in dp-releases.jsonl made the reported ε 0.058 instead of 9.010: the checkpoint carries its
    releases, and a file whose start differs from them is refused, naming it."""
    dp_run(tmp_path, tiny_model_dir, fast_args, "a", 2)
    path = tmp_path / "a" / "dp-releases.jsonl"
    original = path.read_text().splitlines(keepends=True)
    entries = ledger(tmp_path / "a")
    for entry in entries:
        entry["event"]["noise_multiplier"] = entry["event"]["reward_noise_multiplier"] = 100.0
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    with pytest.raises(DamagedLedgerError, match=rf"ledger {path} does not start with the 2 releases"):
        dp_run(tmp_path, tiny_model_dir, fast_args, "a", 1, resume_from_checkpoint="true")
    path.write_text(original[0])  # a release removed
    with pytest.raises(DamagedLedgerError, match=r"release 1 is missing"):
        dp_run(tmp_path, tiny_model_dir, fast_args, "a", 1, resume_from_checkpoint="true")


def test_a_damaged_line_before_the_last_is_refused_and_a_later_sigma_is_charged_at_the_costlier(
    tmp_path, tiny_model_dir, fast_args
):
    """One bad line in the middle used to stop the reading there: the releases after it went uncounted and the redone
    round took an ordinal already used. Releases logged after the checkpoint, which it cannot vouch for, count at
    least what this run's own would."""
    server, whole = dp_run(tmp_path, tiny_model_dir, fast_args, "a", 3)
    path = tmp_path / "a" / "dp-releases.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "{not json\n" + "".join(lines[2:]))
    checkpoint_0 = str(tmp_path / "a" / "checkpoint-0")
    with pytest.raises(DamagedLedgerError, match=rf"ledger {path} is damaged at line 2"):
        dp_run(tmp_path, tiny_model_dir, fast_args, "a", 1, resume_from_checkpoint=checkpoint_0)

    # releases 1 and 2 (after checkpoint 0) rewritten to σ = 100: still charged at this run's σ = 1
    entries = [json.loads(line) for line in lines]
    for entry in entries[1:]:
        entry["event"]["noise_multiplier"] = entry["event"]["reward_noise_multiplier"] = 100.0
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    _, redone = dp_run(tmp_path, tiny_model_dir, fast_args, "a", 1, resume_from_checkpoint=checkpoint_0)
    assert redone[0].dp_epsilon == pytest.approx(server.aggregator.privacy.epsilon_after(1))  # 4 releases
    assert redone[0].dp_epsilon > whole[2].dp_epsilon

    # a torn last line (a crash while appending) is still tolerated: that release never left
    path.write_text("".join(lines) + '{"event": {"noise')
    _, after_tear = dp_run(tmp_path, tiny_model_dir, fast_args, "a", 1, resume_from_checkpoint="true")
    assert after_tear[0].round_idx == 3


# 2. Record-level ε, as each client reports it ---------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [None, -1.0, float("nan"), float("inf"), True, "0.5"])
def test_under_record_level_dp_an_update_without_a_finite_epsilon_is_refused_by_name(
    tmp_path, tiny_model_dir, fast_args, epsilon
):
    """A client that left `record_epsilon` out, or made it negative, was aggregated silently, and the model card still
    read "worst ε reported by a client = 1.000". The reply travels as a Flower reply's records where they can carry
    the value (a str or bool cannot be a Flower metric: it goes straight to the server core)."""
    from trl_federated.flower.records import content_to_update, update_to_content

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"), aggregation="fedavg",
                         dp_record_noise_multiplier=1.0, dp_noise_seed=5, min_clients_per_round=2)
    server.start_run()
    server.begin_round(0)
    for client_id in ("a", "b", "c"):
        server.broadcast(client_id)
    for index, client_id in enumerate(("a", "b", "c")):
        metrics = {} if client_id == "c" and epsilon is None else {"record_epsilon": epsilon if client_id == "c"
                                                                  else 1.0}
        sent = ClientUpdate(client_id, server.wire.encode(moved(server, 1.0), server.global_state), 10, 0.5, metrics)
        if not isinstance(epsilon, (bool, str)):
            sent, _ = content_to_update(update_to_content(sent, index))  # as Flower delivers it
        try:
            server.accept(server.admit(client_id, sent))
        except InvalidUpdateError as error:
            server.drop(client_id, "invalid_update", str(error))
    record = server.end_round()
    assert set(record.weights) == {"a", "b"}
    assert "reports no finite ε ≥ 0 for its records (`record_epsilon`: " in record.dropped["c"]
    assert record.dp_record_epsilon_worst == 1.0
    # a client's ε only grows: a later, lower report does not lower the worst the run states
    record = honest_round(server, 1, **{client_id: {"metrics": {"record_epsilon": 0.25}} for client_id in "abc"})
    server.close()
    assert record.dp_record_epsilon_worst == 1.0


# 3. Client ids that are the server's own log names -----------------------------------------------------------------


@pytest.mark.parametrize("client_id", ["eval_accuracy", "eval_rewards", "test_accuracy", "dp_epsilon", "dp_x",
                                       "train", "round", "num_clients", "reward", "delta_norm", "rewards",
                                       "completions", "temperature"])
def test_a_client_id_that_prefixes_the_servers_own_log_entries_is_refused_by_name(
    tmp_path, tiny_model_dir, fast_args, client_id
):
    """Clients named `eval_accuracy` or `eval_rewards` wrote `eval_accuracy/Total` = 0.99 and
    `eval_rewards/accuracy/mean` = 0.97 into a run that never evaluated. Such an id is refused wherever an id enters:
    the configuration, a registry, a Flower reply's records, and the gate that admits every update."""
    from flwr.app import RecordDict

    from trl_federated.core.callbacks import round_logs
    from trl_federated.flower.identity import ClientRegistry, RegisteredClient
    from trl_federated.flower.records import client_identity_record, content_to_update, update_to_content

    reserved = rf"client id '{client_id}' is reserved"
    args = fast_args(num_clients=1)
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    with pytest.raises(ValueError, match=reserved):
        FederatedServer(model, args, aggregator_from_config(args), num_samples={client_id: 5})
    with pytest.raises(ValueError, match=reserved):
        ClientRegistry([RegisteredClient(client_id, 0, b"key")])
    with pytest.raises(InvalidUpdateError, match=reserved):
        content_to_update(RecordDict({"client": client_identity_record(client_id, 0)}))

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"), aggregation="fedavg",
                         min_clients_per_round=2)
    server.start_run()
    server.begin_round(0)
    for name in ("a", "b", client_id):
        server.broadcast(name)
    forged = {"Total": 0.99, "accuracy/mean": 0.97, "weight": 1.0}
    for index, name in enumerate(("a", "b", client_id)):
        sent = ClientUpdate(name, server.wire.encode(moved(server, 1.0), server.global_state), 10, 0.5,
                            dict(forged) if name == client_id else {})
        if name != client_id:
            sent, _ = content_to_update(update_to_content(sent, index))  # as Flower delivers it
        try:
            server.accept(server.admit(name, sent))  # the forger's reply straight to the core: no records to check
        except InvalidUpdateError as error:
            server.drop(name, "invalid_update", str(error))
    record = server.end_round()
    server.close()
    assert reserved in record.dropped[client_id]
    assert not [name for name in round_logs(record) if name.startswith(f"{client_id}/")]


# 4. Robust combiners under RPG --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("robust", "num_clients"), [("multi_krum", 5), ("trimmed_mean", 5)])
def test_a_robust_combiner_averages_with_equal_weights_not_rpgs(tiny_model_dir, fast_args, robust, num_clients):
    """A client lying about its R̄ within the allowed range took ω = 0.815 of RPG's weights, and kept it inside the
    robust combiners: 0.85 of a Multi-Krum average of four (fair 0.25), 0.90 of a trimmed mean keeping three (fair
    1/3). Every update here moves every coordinate alike, so the global adapter moves by the mean of what the
    combiner kept, each with an equal share, whatever RPG's weights."""
    ids = [f"c{i}" for i in range(num_clients)]
    server = make_server(tiny_model_dir, fast_args, num_clients=num_clients, min_clients_per_round=num_clients,
                         aggregation="rpg", robust_aggregation=robust, robust_num_malicious=1,
                         server_optimizer="sgd", server_learning_rate=1.0, update_norm_bound=None)
    sizes = [0.1, 0.2, 0.22, 0.3, 0.4]  # the liar, c2, sits among the honest clients (not at their mean): kept
    for round_idx, liar_reward in enumerate([0.2, 1.0]):  # RPG's gain needs a baseline: the lie comes in round 1
        start = {key: value.clone() for key, value in server.global_state.items()}
        replies = {client_id: {"state": moved(server, 1.0, size), "reward": liar_reward if client_id == "c2" else 0.2}
                   for client_id, size in zip(ids, sizes)}
        record = honest_round(server, round_idx, client_ids=ids, **replies)
    # RPG's gains put the liar far ahead (its softmax weight was 0.815), which the combiner must not use: ω as applied
    # (the round record's) is an equal share of the clients kept
    gains = server.aggregator.last_gains
    assert max(gains, key=gains.get) == "c2" and gains["c2"] > 1
    assert record.weights["c2"] == pytest.approx(1 / (4 if robust == "multi_krum" else num_clients))
    key = next(iter(start))
    unit_shift = float((server.global_state[key] - start[key]).mean()) / float(
        (moved(server, 1.0, 1.0)[key] - server.global_state[key]).mean())  # in units of a 1 U move
    if robust == "multi_krum":
        kept = [sizes[i] for i in server.aggregator.combiner.selected]
        assert len(kept) == 4 and 0.22 in kept
    else:
        kept = sizes[1:4]  # one trimmed at each end of every coordinate
    assert unit_shift == pytest.approx(sum(kept) / len(kept), rel=1e-3)


def test_multi_krum_selects_at_most_n_minus_f_and_the_config_refuses_more(tmp_path):
    """`robust_num_selected` 5 of 5 clients (or 6 when dropouts left 5) was accepted, and a far attacker was then
    averaged in, moving the result 2.0 honest spreads."""
    from trl_federated import FedGRPOConfig
    from trl_federated.aggregation import FedAvgAggregator, Krum, ServerSGD

    settings = dict(output_dir=str(tmp_path), bf16=False, num_clients=10, robust_aggregation="multi_krum",
                    robust_num_malicious=1, min_clients_per_round=5)
    with pytest.raises(ValueError, match=r"`robust_num_selected` = 5 exceeds `min_clients_per_round` − "
                                         r"`robust_num_malicious` = 4"):
        FedGRPOConfig(**settings, robust_num_selected=5)
    FedGRPOConfig(**settings, robust_num_selected=4)

    zero = {"w": torch.zeros(4)}
    honest = [{"w": torch.full((4,), value)} for value in (0.1, 0.2, 0.3, 0.4)]
    attacker = {"w": torch.full((4,), -10.0)}
    for num_selected in (5, 6):
        aggregator = FedAvgAggregator(ServerSGD(1.0), combiner=Krum(num_malicious=1, num_selected=num_selected))
        updates = [ClientUpdate(f"c{i}", state, 1, 0.0) for i, state in enumerate([*honest, attacker])]
        new = aggregator.aggregate(zero, updates, 0)
        assert aggregator.combiner.selected == [0, 1, 2, 3]
        assert torch.allclose(new["w"], torch.full((4,), 0.25))


# 5. `flwr run --format json --stream` ----------------------------------------------------------------------------

# A stand-in `flwr` whose `run` prints what Flower 1.42's does under `--format json`, through Flower's own code
# (`cli_output_handler`, `print_json_to_stdout`: an indented JSON object, the started line swallowed), then, by
# FLWR_MODE: "refused" raises as a SuperLink's refusal does (Flower prints its JSON error and exits 0), "interrupt"
# sends its caller Ctrl-C and waits to be stopped. `ls` reports RUN_STATUS; every call is appended to FLWR_CALLS.
JSON_FLWR = """#!{python}
import json, os, signal, sys, time
import click
from flwr.cli.utils import cli_output_handler, print_json_to_stdout
with open(os.environ["FLWR_CALLS"], "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
mode = os.environ.get("FLWR_MODE", "")
if sys.argv[1] == "run":
    with cli_output_handler(output_format="json"):
        if mode == "refused":  # as `flwr.cli.run.run` when the SuperLink answers no run id
            raise click.ClickException("Failed to start run")
        print("Successfully started run 7")  # captured: under --format json Flower prints only the JSON
        print_json_to_stdout({{"success": True, "run-id": "7", "federation-id": "", "fab-id": "flwrlabs/app",
                               "fab-name": "app", "fab-version": "1.0.0", "fab-hash": "0123abcd",
                               "fab-filename": "flwrlabs.app.1-0-0.0123abcd.fab"}})
    sys.stdout.flush()
    if mode == "interrupt":  # a person's Ctrl-C, after the wrapper has read the run id (not within microseconds)
        time.sleep(1)
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(30)
elif sys.argv[1] == "ls":
    run = {{"run-id": "7", "status": os.environ["RUN_STATUS"], "status-details": "ServerApp raised"}}
    print(json.dumps({{"success": True, "runs": [run]}}))
"""


APP_DIR = Path(__file__).parents[1] / "examples" / "flower"


@pytest.fixture
def json_flwr(tmp_path, monkeypatch):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "flwr").write_text(JSON_FLWR.format(python=sys.executable))
    (bin_dir / "flwr").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FLWR_CALLS", str(calls))
    return calls


@pytest.mark.parametrize(("mode", "status", "exit_status", "calls"), [
    ("", "finished:completed", 0, ["ls --run-id 7 --format json"]),
    ("", "finished:failed", 1, ["ls --run-id 7 --format json"]),  # exited 0: the JSON's run id was never read
    ("refused", "finished:completed", 1, []),  # no run started, and Flower exits 0
    ("interrupt", "running", 128 + signal.SIGINT, ["stop 7"]),  # Ctrl-C sent no `flwr stop`
])
def test_flwr_run_under_format_json_reads_the_run_id_and_exits_with_the_runs_status(
    json_flwr, monkeypatch, capsys, mode, status, exit_status, calls
):
    from trl_federated.flower import flwr_run

    monkeypatch.setenv("FLWR_MODE", mode)
    monkeypatch.setenv("RUN_STATUS", status)
    argv = [str(APP_DIR), "--stream", "--format", "json", "-c", "num-server-rounds=1"]
    assert flwr_run.main(argv) == exit_status
    assert json_flwr.read_text().splitlines() == [" ".join(["run", *argv]), *calls]
    if mode == "refused":
        assert "reported no run id" in capsys.readouterr().err


# 6. Weaker points ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float32, torch.float16])
def test_a_bfloat16_wire_refuses_a_payload_of_another_dtype_by_name(tiny_model_dir, fast_args, dtype):
    """bf16 payloads of dtype int64 or complex64 were accepted (`.float()` read them as some change). The reply
    travels as a Flower reply's records where they carry the dtype (they refuse complex numbers themselves)."""
    from trl_federated.flower.records import content_to_update, update_to_content

    server = make_server(tiny_model_dir, fast_args, num_clients=2, transfer_dtype="bfloat16")
    server.begin_round(0)
    payload = server.wire.encode(moved(server, 1.0), server.global_state)
    key = next(iter(payload))
    forged = ClientUpdate("a", {**payload, key: payload[key].to(dtype)}, 4, 0.5)
    if not dtype.is_complex:
        forged, _ = content_to_update(update_to_content(forged, 0))
    with pytest.raises(InvalidUpdateError, match=rf"{key}'?: dtype {dtype}, expected torch.bfloat16"):
        server.admit("a", forged)
    server.admit("a", ClientUpdate("a", payload, 4, 0.5))  # the payload as encoded


def test_bulyans_last_picks_score_each_candidate_by_a_neighbour_not_its_index(tiny_model_dir, fast_args):
    """Bulyan with f = 1 ran its last Krum over 3 candidates with n − f − 2 = 0 neighbours: every score was 0 and the
    first candidate by index was picked. An attacker that is client 0 then joined the selection."""
    ids = [f"c{i}" for i in range(7)]
    server = make_server(tiny_model_dir, fast_args, num_clients=7, min_clients_per_round=7, aggregation="fedavg",
                         robust_aggregation="bulyan", robust_num_malicious=1)
    replies = {client_id: {"state": moved(server, 1.0, 0.2 + 0.02 * index)} for index, client_id in enumerate(ids)}
    replies["c0"] = {"state": moved(server, -1.0, 2.0)}  # the attacker, first by index
    honest_round(server, 0, client_ids=ids, **replies)
    assert 0 not in server.aggregator.combiner.selected


@pytest.mark.parametrize("size", [0.0, 1e-6, 1e-4])
def test_an_update_shorter_than_a_thousandth_of_u_is_idle_and_takes_at_most_its_data_share(
    tiny_model_dir, fast_args, size
):
    """The idle rule flagged only adapters back bit for bit: a client that moved by 1e-6 U with a high R̄ escaped it
    and took ω = 0.573 of RPG's weight for a step that moved nothing. Under 1e-3 U an update is idle."""
    server = make_server(tiny_model_dir, fast_args, aggregation="rpg", update_norm_bound=None)
    for round_idx, reward in enumerate([0.2, 1.0]):  # RPG's gain needs a baseline: the lure comes in round 1
        replies = {client_id: {"state": moved(server, 1.0, 0.3 + 0.05 * index)}
                   for index, client_id in enumerate("abc")}
        replies["c"] = {"state": moved(server, 1.0, size), "reward": reward}
        record = honest_round(server, round_idx, **replies)
    assert record.idle == {"a": 0, "b": 0, "c": 1}
    assert record.weights["c"] <= 1 / 3 + 1e-9  # its data share (equal counts)


def constant_reward(completions, **kwargs):
    return [0.5] * len(completions)


constant_reward.reward_range = (0.0, 1.0)


@pytest.mark.parametrize("record_level", [False, True])
def test_under_record_level_dp_the_idle_rule_is_off_in_practice(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args,
                                                                record_level):
    """Clients whose every group scores alike have no learning signal: idle, at most their data share. Under
    record-level DP a client sends no metric computed from its data (`frac_reward_zero_std` among them) and its
    noise moves the adapter far beyond 1e-3 U, so no client is ever idle: the rule is off (docs/methods.md says so)."""
    from test_record_privacy import prompts
    from trl_federated import FederatedRunner

    privacy = dict(dp_record_noise_multiplier=1.0, dp_noise_seed=5) if record_level else {}
    args = fast_args(num_clients=2, num_rounds=1, eval_initial=False, output_dir=str(tmp_path / "run"), **privacy)
    runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), constant_reward, args,
                             [prompts(5, client) for client in range(2)], processing_class=tiny_tokenizer,
                             report_header="")
    (record,) = runner.run()
    if record_level:
        assert record.idle == {"client_0": 0, "client_1": 0}
        assert record.zero_signal_share == {"client_0": None, "client_1": None}
    else:
        assert record.idle == {"client_0": 1, "client_1": 1}
        assert record.zero_signal_share == {"client_0": 1.0, "client_1": 1.0}


def test_importing_a_name_from_the_working_directory_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    """`names.import_object` left the working directory first on `sys.path`: every later import looked there first,
    and a `json.py` in the folder a run started from would have shadowed the standard library's."""
    from trl_federated.names import import_object

    (tmp_path / "my_rewards_59.py").write_text("def reward(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    before = list(sys.path)
    assert import_object("my_rewards_59:reward", "reward_funcs")([]) == [1.0]
    assert sys.path == before
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_59'"):
        import_object("no_such_module_59:reward", "reward_funcs")
    assert sys.path == before
