"""Issue 26: untrusted clients. Everything a client sends, and everything the server keeps for it, is bounded.

Each test drives the server core a Flower deployment uses (`FederatedServer`: broadcast, admission through
`UpdateGate`, accept, aggregation, callbacks, checkpoints), with replies made up as an adversary would send them,
so no client trains: the attacks cost milliseconds."""

import json
import math
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trl_federated import ClientUpdate
from trl_federated.adapters import InvalidUpdateError, with_federated_adapter
from trl_federated.aggregation import aggregator_from_config
from trl_federated.core.checkpoint import OutputDirLockedError, _file_digest, read_checkpoint
from trl_federated.core.server import FederatedServer
from trl_federated.reports import server_reports


def length_reward(completions, **kwargs):
    return [len(completion) / 64 for completion in completions]


length_reward.reward_range = (0.0, 1.0)


def make_server(model_dir, fast_args, **overrides) -> FederatedServer:
    args = fast_args(**{"num_clients": 3, "num_rounds": 4, **overrides})
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(model_dir), args.seed)
    return FederatedServer(model, args, aggregator_from_config(args), [length_reward],
                           callbacks=server_reports(args.output_dir, report_header=""), writes_result=True)


def unit(server) -> float:
    """U = E · η · √d, the unit of `update_norm_bound`."""
    args = server.args
    return args.local_steps * args.learning_rate * math.sqrt(sum(t.numel() for t in server.global_state.values()))


def moved(server, direction: float, size: float = 0.5) -> dict:
    """An adapter `size` U from the global adapter (every coordinate moved alike)."""
    d = sum(t.numel() for t in server.global_state.values())
    step = direction * size * unit(server) / math.sqrt(d)
    return {key: value + step for key, value in server.global_state.items()}


def reply(server, client_id, state=None, reward=0.5, num_samples=10, metrics=None, extras=None):
    """Deliver a reply as it comes off the wire; the admitted update joins the round, or the client is dropped."""
    state = moved(server, 1.0) if state is None else state
    sent = ClientUpdate(client_id, server.wire.encode(state, server.global_state), num_samples, reward,
                        metrics if metrics is not None else {}, extras or {})
    try:
        update = server.admit(client_id, sent)
    except InvalidUpdateError as error:
        server.drop(client_id, "invalid_update", str(error))
        return None
    server.accept(update)
    return update


def honest_round(server, round_idx, client_ids=("a", "b", "c"), **replies):
    """Round `round_idx`: every client in `client_ids` replies honestly unless `replies` gives its reply's fields."""
    server.begin_round(round_idx)
    for client_id in client_ids:  # as Flower sends them, before any reply
        server.broadcast(client_id)
    for client_id in client_ids:
        reply(server, client_id, **replies.get(client_id, {}))
    return server.end_round()


# 3. One writer per output folder ------------------------------------------------------------------------------


def test_a_second_writer_of_an_output_folder_is_refused_by_name(tmp_path, tiny_model_dir, fast_args):
    output_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from trl_federated import FedGRPOConfig
            from trl_federated.core.checkpoint import prepare_output_dir
            prepare_output_dir(FedGRPOConfig(output_dir={str(output_dir)!r}, bf16=False, use_cpu=True,
                                             report_to="none"))
            print("started", flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "started"
        # Even when told to overwrite it, a second run never touches a folder another process writes.
        server = make_server(tiny_model_dir, fast_args, output_dir=str(output_dir), overwrite_output_dir=True)
        with pytest.raises(OutputDirLockedError, match=rf"output_dir {output_dir} is being written by another run "
                                                       rf"\(pid {holder.pid} on host "):
            server.start_run()
    finally:
        holder.kill()
        holder.wait()
    # The lock died with its process: no stale lock to clear by hand.
    assert server.start_run() == 0
    server.close()


# 6. Checkpoints and names -------------------------------------------------------------------------------------


def test_a_server_moment_of_the_wrong_shape_is_a_damaged_checkpoint_and_the_run_falls_back(
    tmp_path, tiny_model_dir, fast_args, caplog
):
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"), server_optimizer="adam")
    server.start_run()
    for round_idx in range(2):
        honest_round(server, round_idx)
    server.close()
    newest = tmp_path / "run" / "checkpoint-1"
    tensors = load_file(newest / "federation.safetensors")
    name = next(key for key in tensors if key.startswith("aggregator/server_optimizer/m/"))
    tensors[name] = torch.zeros(tensors[name].numel() + 1)  # one coordinate too many
    save_file(tensors, newest / "federation.safetensors", metadata={"format": "pt"})
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["federation.safetensors"] = _file_digest(newest / "federation.safetensors")
    (newest / "manifest.json").write_text(json.dumps(manifest))  # damage the checksums cannot see

    with pytest.raises(ValueError, match=r"is damaged: aggregator\['server_optimizer'\]\['m'\]\[.*\] is "
                                         r"torch.float32 \(\d+,\), expected floating point"):
        read_checkpoint(newest)
    resumed = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"), resume_from_checkpoint="true")
    assert resumed.start_run() == 1  # after checkpoint-0, the newest intact one
    assert f"Checkpoint {newest} is damaged" in caplog.text
    honest_round(resumed, 1)  # and the resumed server aggregates
    resumed.close()


# Path components, control characters, and what a console line or matplotlib's math text would read as markup
UNSAFE_CLIENT_IDS = ["../x", "a/b", "a\\b", "", "..", "a\x00b", "x" * 257, "site$a_b_c$", "a\nb", "a\u2028b", "é"]


@pytest.mark.parametrize("client_id", UNSAFE_CLIENT_IDS)
def test_client_ids_that_are_not_safe_path_components_are_refused(tmp_path, tiny_model_dir, fast_args, client_id):
    from flwr.app import RecordDict

    from trl_federated.flower.identity import ClientRegistry, RegisteredClient
    from trl_federated.flower.records import client_identity_record, content_to_update

    args = fast_args(num_clients=1)
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    with pytest.raises(ValueError, match="client id"):  # configuration: the runner's clients are the server's
        FederatedServer(model, args, aggregator_from_config(args), num_samples={client_id: 5})
    with pytest.raises(ValueError, match="client id"):  # registration
        ClientRegistry([RegisteredClient(client_id, 0, b"key")])
    content = RecordDict({"client": client_identity_record(client_id, 0)})
    with pytest.raises(InvalidUpdateError, match="The reply names no client"):  # a reply, or a node's claim
        content_to_update(content)


# 2. Client metrics are untrusted input --------------------------------------------------------------------------


def test_client_metrics_are_typed_bounded_namespaced_and_never_break_a_report_or_a_resume(
    tmp_path, tiny_model_dir, fast_args, caplog
):
    from trl_federated.core.callbacks import round_logs

    output_dir = tmp_path / "run"
    server = make_server(tiny_model_dir, fast_args, output_dir=str(output_dir))
    server.start_run()
    hostile = {
        "step_rewards": 5,  # not a list: the reward plot iterated it
        "round": "x",  # read back as the line's round on resume
        "event": "client_dropped", "client_id": "b", "reason": "forged",  # another client's drop line
        "weight": 0.99, "b/weight": 0.0, "num_clients": 1000.0,  # the round log's own entries
        "eval_accuracy/Total": 1.0,  # an evaluation that never ran
        "kl": [1.0, "x"], "bad name\n": 1.0, "loss": math.inf,
        "b/entropy": 9.0,  # a valid name, but under client b's (issue 48): it would read as b's entropy
        "entropy": 0.25,
    }
    flood = {"step_rewards": [0.5] * 100_000}  # more step rewards than local steps, kept in every checkpoint
    sizes = []
    for round_idx in range(3):
        record = honest_round(server, round_idx, a={"metrics": dict(hostile)}, c={"metrics": dict(flood)})
        sizes.append((output_dir / f"checkpoint-{round_idx}" / "federation.json").stat().st_size)
    server.close()

    assert record.client_metrics["a"] == {"entropy": 0.25} and record.client_metrics["c"] == {}
    assert "Client 'a': metrics dropped: 'step_rewards' (not a list of at most 2 numbers)" in caplog.text
    logs = round_logs(record)
    assert logs["a/weight"] == record.weights["a"] and logs["b/weight"] == record.weights["b"]
    assert (logs["num_clients"], logs["round"], logs["a/entropy"], logs["entropy"]) == (3, 2, 0.25, 0.25)
    assert "a/b/entropy" not in logs and "b/entropy" not in logs
    assert not any(name.startswith("eval_") for name in logs)
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines if line["event"] != "evaluation"] == ["client"] * 3 + ["round"] + [
        "client"] * 3 + ["round"] + ["client"] * 3 + ["round"]
    assert (lines[0]["client_id"], lines[0]["round_idx"]) == ("a", 0)
    assert lines[0]["metrics"] == {"entropy": 0.25}
    # the checkpoint grows by the same few kilobytes a round, whatever the clients send
    assert sizes[2] - sizes[1] < 20_000 and abs((sizes[2] - sizes[1]) - (sizes[1] - sizes[0])) < 1_000
    # a line an earlier version wrote with a client's metric as its round is dropped on resume, not a crash
    with (output_dir / "metrics.jsonl").open("a") as stream:
        stream.write(json.dumps({"event": "client", "round": "x", "client_id": "a"}) + "\n")
    resumed = make_server(tiny_model_dir, fast_args, output_dir=str(output_dir), resume_from_checkpoint="true")
    assert resumed.start_run() == 3
    resumed.close()
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    assert '"x"' not in "".join(lines) and json.loads(lines[-1]) == {"event": "resumed", "checkpoint_round": 2}


def test_a_client_flooding_metrics_is_refused(tmp_path, tiny_model_dir, fast_args):
    from trl_federated.core.admission import MAX_CLIENT_METRICS

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"))
    server.start_run()
    metrics = {f"m{index}": 1.0 for index in range(MAX_CLIENT_METRICS + 1)}
    record = honest_round(server, 0, a={"metrics": metrics})
    assert record.dropped == {"a": f"Update of client 'a' rejected: it sends {MAX_CLIENT_METRICS + 1} metrics, more "
                                   f"than the {MAX_CLIENT_METRICS} a client may send."}
    server.close()


# 1. Accumulated state -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_one_scaffold_client_can_neither_grow_the_controls_nor_get_honest_clients_rejected(
    tmp_path, tiny_model_dir, fast_args, action
):
    from trl_federated.adapters import state_norm

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"), aggregation="scaffold",
                         num_rounds=6, update_norm_action=action)
    server.start_run()
    args, keys = server.args, list(server.global_state)
    d = sum(tensor.numel() for tensor in server.global_state.values())
    control_bound = args.update_norm_bound * math.sqrt(d)  # update_norm_bound in units of √d
    budget = args.local_steps * args.learning_rate  # Σ_k η_k of a round
    refusals = 0
    for round_idx in range(args.num_rounds):
        server.begin_round(round_idx)
        for index, client_id in enumerate(["a", "b", "m"]):
            _, extras = server.broadcast(client_id)
            c, c_i = extras["server_control"], extras["client_control"]
            if client_id == "m":
                # Each round's Δc_m just inside the bound, always the same way, and all of the data weight: c ≈ c_m.
                delta = {key: torch.full_like(value, 0.999 * args.update_norm_bound) for key, value in c.items()}
                reply(server, "m", state=dict(server.global_state), num_samples=10**6,
                      extras={"control_delta": delta})
                continue
            # An honest client with a decoupled correction (`ScaffoldCorrection`): E steps of its mean Adam
            # direction g, which turns from round to round, plus η (c − c_i) each; then c_i⁺ = g.
            g = {key: torch.full_like(value, 0.5 * (-1) ** (round_idx + index)) for key, value in c.items()}
            state = {key: server.global_state[key] - budget * (g[key] + c[key] - c_i[key]) for key in keys}
            reply(server, client_id, state=state, extras={"control_delta": {key: g[key] - c_i[key] for key in keys}})
        record = server.end_round()
        assert set(record.weights) >= {"a", "b"}, record.dropped  # the honest clients are never rejected
        controls = server.aggregator.client_controls
        assert state_norm(controls.get("m", {"x": torch.zeros(1)})) <= control_bound * (1 + 1e-5)
        assert state_norm(server.aggregator.control) <= control_bound * (1 + 1e-5)
        if "m" in record.dropped:  # refused: what it got in before no longer acts on c, and it starts again at 0
            assert "‖c_i + Δc_i‖" in record.dropped["m"] and "exceeds the control bound" in record.dropped["m"]
            assert "m" not in controls
            refusals += 1
    assert refusals >= (2 if action == "reject" else 0)
    server.close()


# 4. Robust options that act -----------------------------------------------------------------------------------


def test_trimmed_mean_trims_one_client_at_each_end_of_a_small_federation_or_is_refused(
    tmp_path, tiny_model_dir, fast_args
):
    with pytest.raises(ValueError, match=r"trimmed_mean'` trims at least one client at each end .* set "
                                         r"`min_clients_per_round` to 3 or more \(it is 1\)"):
        fast_args(num_clients=3, robust_aggregation="trimmed_mean")
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"), aggregation="fedavg",
                         robust_aggregation="trimmed_mean", min_clients_per_round=3)  # default fraction 0.2
    server.start_run()
    honest = moved(server, 1.0)  # where both honest clients move (FedAvg's step is their mean)
    # One client of three pulls every coordinate 9 U the other way, within update_norm_bound (10 U).
    honest_round(server, 0, c={"state": moved(server, -1.0, size=9.0)})
    for key, value in server.global_state.items():  # c trimmed at the low end, an honest one at the high end
        torch.testing.assert_close(value, honest[key])
    server.close()


# 5. The liar, measured ------------------------------------------------------------------------------------------


def test_a_reward_that_is_not_the_mean_of_the_step_rewards_sent_with_it_is_refused(tmp_path, tiny_model_dir,
                                                                                      fast_args):
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path / "run"))  # W = 2 of E = 2 steps
    server.start_run()
    record = honest_round(server, 0, a={"reward": 0.9, "metrics": {"step_rewards": [0.5, 0.5]}},
                          b={"reward": 0.5, "metrics": {"step_rewards": [0.25, 0.75]}})
    assert record.dropped == {"a": "Update of client 'a' rejected: R̄ = 0.9 is not the mean of its last 2 step "
                                   "rewards (0.5)."}
    assert set(record.weights) == {"b", "c"}  # c sent no step rewards: nothing to check R̄ against
    server.close()


def test_the_liar_benchmark_reaches_the_analytic_peak():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "rpg_liar.py"
    spec = importlib.util.spec_from_file_location("rpg_liar", path)
    liar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(liar)
    # Rewards spanning 2: h reaches h_max = 10 in one round; spanning 1: h = 1 / (ι σ_min + (1 − ι) · 1).
    assert liar.peak(3, 2.5, 0.0, 2.0) == pytest.approx(math.exp(4) / (math.exp(4) + 2))
    h = 1 / (0.9 * 0.05 + 0.1)
    assert liar.peak(10, 1.5, 0.0, 1.0) == pytest.approx(math.exp(h / 1.5) / (math.exp(h / 1.5) + 9), rel=1e-6)
    assert liar.ceiling(10, 1.5, 1.0) == pytest.approx(math.exp(h / 1.5) / (math.exp(h / 1.5) + 9), rel=1e-6)
    assert liar.ceiling(3, 2.5, 2.0) == pytest.approx(liar.peak(3, 2.5, 0.0, 2.0))
    # Issue 48, 6: over 8 rounds (annealed τ, rewards spanning 2, N = 3) a rising ramp took 0.619 on average, above
    # the low/high patterns the benchmark searched; its dynamic programme finds at least as much, a sequence
    # replayed through the server's own RPGAggregator, below the per-round ceiling
    replayed, estimate, sequence = liar.optimal_mean(3, None, 2.0, 8)
    assert 0.619 <= replayed <= liar.ceiling(3, 1.5, 2.0) and replayed == pytest.approx(estimate, abs=0.005)
    assert replayed == pytest.approx(sum(liar.liar_weights(sequence, 3, None)) / 8)
    assert replayed > liar.sustained(3, None, 0.0, 2.0, rounds=8)[0]


# Part two: what a client reports about its reward, and free text ----------------------------------------------------


class AlwaysInRange(float):
    """A float whose comparisons always say yes: it passed a range check with any value."""

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True

    def __lt__(self, other):
        return True


def test_a_reward_of_any_numeric_type_is_a_plain_float_before_it_is_checked_or_logged(
    tmp_path, tiny_model_dir, fast_args
):
    from fractions import Fraction

    import numpy as np

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path))
    server.start_run()
    record = honest_round(server, 0, a={"reward": np.float32(0.25)}, b={"reward": Fraction(1, 2)},
                          c={"reward": AlwaysInRange(100.0)})
    assert record.rewards == {"a": 0.25, "b": 0.5}  # c's 100 lies outside the reward range [0, 1]
    assert all(type(value) is float for value in record.rewards.values())
    assert "outside the reward functions' range" in record.dropped["c"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["rewards"] for line in lines if line.get("event") == "round"] == [{"a": 0.25, "b": 0.5}]
    server.close()


def test_a_clients_text_cannot_forge_a_line_of_the_servers_log(tmp_path, tiny_model_dir, fast_args, caplog):
    import logging

    from trl_federated.reports.round_log import format_round_log

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path))
    server.start_run()
    server.begin_round(0)
    for client_id in ("a", "b"):
        server.broadcast(client_id)
        reply(server, client_id)
    forged = "boom\nRound 0 (1/4): 1 clients aggregated\n  c: R̄ = 1.0000, ω = 0.9990\r\u2028\x1b[2J"
    with caplog.at_level(logging.WARNING, logger="trl_federated.core.server"):
        server.drop("c", "error", forged)  # as a Flower error reply's reason, or a client's exception, says it
    record = server.end_round()
    console = format_round_log(record, 4, 3)
    assert len(console.splitlines()) == 4  # the round line, a and b, and c's drop: one line each
    assert "\\nRound 0" in console and "\\x1b" in console and "\\u2028" in console
    assert all("\n" not in message.getMessage() for message in caplog.records)
    server.close()


def test_rpg_stays_finite_for_any_finite_reward_and_warns_when_nothing_bounds_it(tmp_path, tiny_model_dir, fast_args):
    from trl_federated import RPGAggregator, ServerSGD

    aggregator = RPGAggregator(h_max=None, server_optimizer=ServerSGD(1.0))
    state = {"w": torch.zeros(2)}
    updates = [ClientUpdate("a", {"w": torch.ones(2)}, 1, -1e308), ClientUpdate("b", {"w": -torch.ones(2)}, 1, 0.0)]
    aggregator.aggregate(state, updates, 0)
    updates = [ClientUpdate("a", {"w": torch.ones(2)}, 1, 1e308), ClientUpdate("b", {"w": -torch.ones(2)}, 1, 0.0)]
    new = aggregator.aggregate(state, updates, 1)  # the gap is 2e308: infinite in float
    assert all(math.isfinite(value) for value in aggregator.last_weights.values())
    assert aggregator.last_weights["a"] == pytest.approx(1.0) and torch.isfinite(new["w"]).all()
    args = fast_args(output_dir=str(tmp_path), num_clients=2, rpg_h_max=None)
    (warning,) = [message for message in args.federation_warnings(None) if "rpg_h_max" in message]
    assert "declare no `reward_range`" in warning
    assert not [message for message in args.federation_warnings((0.0, 1.0)) if "rpg_h_max" in message]


def test_a_report_that_fails_to_draw_neither_stops_the_round_nor_its_checkpoint(
    tmp_path, tiny_model_dir, fast_args, monkeypatch, caplog
):
    import logging

    from trl_federated.reports import summary as reporting

    def broken_plot(*args, **kwargs):
        raise ValueError("matplotlib could not parse the label")

    monkeypatch.setattr(reporting, "plot_run", broken_plot)
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path))
    server.start_run()
    with caplog.at_level(logging.WARNING, logger="trl_federated.reports.summary"):
        honest_round(server, 0)
    assert (tmp_path / "checkpoint-0").is_dir() and "the run goes on" in caplog.text
    honest_round(server, 1)
    server.close()
    assert reporting.plot_label("site$a_b_c$") == r"site\$a_b_c\$" and reporting.plot_label("_x") == "x"


def evaluation(total, rows, **labels):
    """An evaluation reply as `evaluate_accuracy` gives it, through Flower's records (`evaluation_to_content`, then
    what the strategy decodes, `content_to_evaluation`), with `labels` as label=(accuracy, rows)."""
    from trl_federated.flower.records import content_to_evaluation, evaluation_to_content

    accuracy, count = {"Total": total}, {"Total": rows}
    for label, (value, label_rows) in labels.items():
        accuracy[label], count[label] = value, label_rows
    return content_to_evaluation(evaluation_to_content({"accuracy": accuracy, "count": count}, "site", 0))


def test_one_client_cannot_own_the_pooled_evaluation(tmp_path, tiny_model_dir, fast_args, caplog):
    """The Flower evaluate round's pooling (`FederatedServer.record_client_evaluation`, which the strategy calls with
    each reply decoded). Issue 48, 2: two honest replies (0.25 over 100 rows, "hard" 0.10 over 40) and one claiming
    2^63 − 1 rows read 0.75, "hard" 0.85 (capped at 4 x the Total's median), a label only the attacker reports 1.0,
    with two replies 0.9999. Now an implausible count fails the client; any other count weighs at most its label's
    median; a label is pooled only when 3 or more clients report it."""
    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path), num_clients=4)
    server.start_run()
    honest = {name: evaluation(0.25, 100, hard=(0.1, 40)) for name in ("a", "b", "c")}
    results = server.record_client_evaluation(0, {**honest, "d": evaluation(1.0, 2**63 - 1, hard=(1.0, 2**62))}, {})
    assert results["failed"]["d"] == ("invalid evaluation reply: it counts 9,223,372,036,854,775,807 rows, more than "
                                      "any evaluation counts (1,000,000)")
    assert results["accuracy"] == {"hard": pytest.approx(0.1), "Total": pytest.approx(0.25)}
    assert results["clients"]["d"]["count"]["Total"] == 2**63 - 1  # what it claimed stays in the record
    # a plausible count weighs at most the label's median: d is one client of four, up or down
    for forged, total, hard in ((1.0, (75 + 100) / 400, (12 + 40) / 160), (0.0, 75 / 400, 12 / 160)):
        d = evaluation(forged, 900_000, hard=(forged, 900_000), olympiad=(forged, 10))
        results = server.record_client_evaluation(1, {**honest, "d": d}, {})
        assert results["accuracy"] == {"hard": pytest.approx(hard), "Total": pytest.approx(total)}
        assert results["count"] == {"hard": 160, "Total": 400} and results["unpooled"] == ["olympiad"]
        assert "Client 'd''s evaluation counts more rows than the median client's ('Total': 900,000 > 100" in (
            caplog.text)
    # a label reported by fewer than 3 clients is shown per client only: with 2 replies, nothing is pooled
    results = server.record_client_evaluation(2, {"a": honest["a"], "d": evaluation(1.0, 10**6)}, {})
    assert results["accuracy"] == {} and results["unpooled"] == ["Total", "hard"] and set(results["clients"]) == {
        "a", "d"}
    for forged in (1000.0, -1e6, 1e308):  # outside the reward range: failed
        results = server.record_client_evaluation(3, {**honest, "d": evaluation(forged, 100)}, {})
        assert results["accuracy"]["Total"] == pytest.approx(0.25) and "outside" in results["failed"]["d"]
    server.close()


def test_an_evaluation_without_a_declared_range_is_pooled_by_its_median_and_known_splits_bound_counts(
    tmp_path, tiny_model_dir, fast_args
):
    """Issue 48, 2: with evaluation rewards that declare no range, one reply of 1e300 pooled to 3.3e299. Without a
    range the pooled value is the median of the clients' values; where the server knows a client's evaluation split
    (a registry's `eval-samples`), a reply counting more fails it."""

    def unbounded_reward(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    def server_of(**known):
        args = fast_args(num_clients=4, output_dir=str(tmp_path / str(len(known))))
        model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
        return FederatedServer(model, args, aggregator_from_config(args), [unbounded_reward], **known)

    server = server_of()
    server.start_run()
    assert server.evaluation_range() is None
    replies = {"a": evaluation(0.25, 100), "b": evaluation(0.5, 100), "c": evaluation(0.75, 300),
               "d": evaluation(1e300, 50)}
    results = server.record_client_evaluation(0, replies, {})
    assert results["accuracy"] == {"Total": pytest.approx(0.625)}  # the median of 0.25, 0.5, 0.75, 1e300
    assert results["count"] == {"Total": 100 + 100 + 100 + 50}  # c bounded by the median (100)
    server.close()
    server = server_of(eval_samples={"a": 100, "d": 50})
    server.start_run()
    results = server.record_client_evaluation(1, {**replies, "d": evaluation(0.5, 51)}, {})
    assert results["failed"] == {"d": "invalid evaluation reply: it counts 51 rows, more than the 50 of its "
                                      "evaluation split"}
    assert results["accuracy"] == {"Total": pytest.approx(0.5)}
    server.close()


def test_one_admitted_scaffold_control_cannot_steer_the_federation_for_good(tmp_path, tiny_model_dir, fast_args):
    """A client gets one control accepted in round 0, within the per-client bound and 10x an honest client's, and
    is refused every round after: its c_i leaves c at its first refusal. While admitted, its c_i enters c at most at
    twice the median client's length, however much data it claims."""
    from trl_federated.adapters import state_norm

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path), aggregation="scaffold", num_clients=4,
                         num_rounds=4)
    server.start_run()
    args, keys = server.args, list(server.global_state)
    d = sum(tensor.numel() for tensor in server.global_state.values())
    budget = args.local_steps * args.learning_rate
    direction = {key: torch.randn(value.shape, generator=torch.Generator().manual_seed(7)) for key, value in
                 server.global_state.items()}
    scale = 0.9 * args.update_norm_bound * math.sqrt(d) / state_norm(direction)
    attack = {key: value * scale for key, value in direction.items()}  # c_m: just inside the bound
    for round_idx in range(3):
        server.begin_round(round_idx)
        for index, client_id in enumerate(["a", "b", "c", "m"]):
            _, extras = server.broadcast(client_id)
            c, c_i = extras["server_control"], extras["client_control"]
            if client_id == "m":
                if round_idx == 0:
                    reply(server, "m", state=dict(server.global_state), num_samples=10**6,
                          extras={"control_delta": attack})
                else:  # refused from now on
                    reply(server, "m", state=dict(server.global_state), reward=float("nan"),
                          extras={"control_delta": {key: torch.zeros_like(value) for key, value in c.items()}})
                continue
            g = {key: torch.full_like(value, 0.1 * (-1) ** (round_idx + index)) for key, value in c.items()}
            state = {key: server.global_state[key] - budget * (g[key] + c[key] - c_i[key]) for key in keys}
            reply(server, client_id, state=state, extras={"control_delta": {key: g[key] - c_i[key] for key in keys}})
        record = server.end_round()
        control = server.aggregator.control
        flat = torch.cat([control[key].flatten() for key in keys])
        along = torch.dot(flat, torch.cat([attack[key].flatten() for key in keys])) / (
            state_norm(attack) * max(state_norm(control), 1e-30))
        honest = statistics.median(state_norm(server.aggregator.client_controls[name]) for name in "abc")
        if round_idx == 0:
            assert "m" in record.weights
            assert state_norm(control) <= 2 * honest * (1 + 1e-5)  # c_m clipped to 2x the median before weighing
        else:
            assert "m" in record.dropped and "m" not in server.aggregator.client_controls
            assert abs(float(along)) < 0.05  # c no longer points along the attacker's direction
    server.close()


# Part three (issue 48): SCAFFOLD's bound, counts no client can inflate, log entries only a client's own, ids that
# cannot corrupt a checkpoint ---------------------------------------------------------------------------------------


def flat(state: dict) -> torch.Tensor:
    return torch.cat([value.double().flatten() for _, value in sorted(state.items())])


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_a_scaffold_client_that_parks_its_control_on_the_bound_gains_no_update_norm(
    tmp_path, tiny_model_dir, fast_args, action
):
    """Issue 48, 1: the gate added E·η·‖c − c_i‖ to the bound, and c_i is the client's doing: parked on the control
    bound, it sent 19.56 U orthogonal to c − c_i, admitted. Now the update less its prescribed correction,
    ‖(θ_i − θ) + E·η·(c − c_i)‖, is what `update_norm_bound` bounds."""
    from trl_federated.adapters import state_norm

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path), aggregation="scaffold", num_rounds=4,
                         update_norm_action=action)
    server.start_run()
    args, keys = server.args, list(server.global_state)
    d = sum(tensor.numel() for tensor in server.global_state.values())
    budget, bound = args.local_steps * args.learning_rate, args.update_norm_bound * unit(server)
    generator = torch.Generator().manual_seed(3)
    direction = {key: torch.randn(value.shape, generator=generator) for key, value in server.global_state.items()}
    scale = 0.999 * args.update_norm_bound * math.sqrt(d) / state_norm(direction)
    parked = {key: value * scale for key, value in direction.items()}  # c_m just inside the control bound
    attacks = 0
    for round_idx in range(4):
        server.begin_round(round_idx)
        for index, client_id in enumerate(["a", "b", "m"]):
            _, extras = server.broadcast(client_id)
            c, c_i = extras["server_control"], extras["client_control"]
            if client_id != "m":  # honest: decoupled correction, c_i⁺ = g
                g = {key: torch.full_like(value, 0.5 * (-1) ** (round_idx + index)) for key, value in c.items()}
                state = {key: server.global_state[key] - budget * (g[key] + c[key] - c_i[key]) for key in keys}
                reply(server, client_id, state=state,
                      extras={"control_delta": {key: g[key] - c_i[key] for key in keys}})
                continue
            if "m" not in server.aggregator.client_controls:  # parks c_m on the bound (again, once refused)
                reply(server, "m", state=dict(server.global_state), extras={"control_delta": parked})
                continue
            attacks += 1
            # 19.56 U orthogonal to c − c_m: within the old allowance (10 U + E·η·‖c − c_m‖ ≈ 20 U)
            correction = flat({key: c[key] - c_i[key] for key in keys})
            w = torch.randn(correction.shape, generator=generator, dtype=torch.float64)
            w -= torch.dot(w, correction) / torch.dot(correction, correction) * correction
            w *= 1.956 * bound / w.norm()
            offsets = dict(zip(sorted(keys), torch.split(w, [server.global_state[k].numel() for k in sorted(keys)])))
            state = {key: server.global_state[key] + offsets[key].view_as(server.global_state[key]).float()
                     for key in keys}
            assert state_norm({key: state[key] - server.global_state[key] for key in keys}) < bound + budget * (
                correction.norm().item())  # what the old gate admitted
            admitted = reply(server, "m", state=state, extras={"control_delta": {k: torch.zeros_like(v)
                                                                                 for k, v in c.items()}})
            if action == "reject":
                assert admitted is None
            else:  # clipped: the client's own part on the bound, the prescribed correction kept
                residual = flat({key: admitted.state[key] - server.global_state[key] + budget * (c[key] - c_i[key])
                                 for key in keys})
                assert residual.norm().item() == pytest.approx(bound, rel=1e-4)
        record = server.end_round()
        assert {"a", "b"} <= set(record.weights), record.dropped  # honest clients stay admitted
        if round_idx % 2 and action == "reject":
            assert "the update less its prescribed correction" in record.dropped["m"]
            assert "exceeds update_norm_bound" in record.dropped["m"]
    assert attacks == (2 if action == "reject" else 3)
    server.close()


@pytest.mark.parametrize("aggregation", ["rpg", "scaffold"])
def test_a_client_id_that_reads_as_a_tensor_marker_cannot_make_a_checkpoint_unreadable(
    tmp_path, tiny_model_dir, fast_args, aggregation
):
    """Issue 48, 5: the id `__tensor__` as a round's only reporter made RPG's baselines (SCAFFOLD's client controls)
    read back as a tensor reference: checkpoint-0 was corrupt and nothing resumed. Keys are now escaped."""
    from trl_federated.core.checkpoint import latest_intact_checkpoint

    output_dir = tmp_path / "run"
    server = make_server(tiny_model_dir, fast_args, output_dir=str(output_dir), aggregation=aggregation)
    server.start_run()
    ids = ("__tensor__", "\\x", "b")  # and a key beginning with the escape (the server core admits any id)
    for round_idx, reporters in enumerate([ids[:1], ids]):
        server.begin_round(round_idx)
        for client_id in reporters:
            _, extras = server.broadcast(client_id)
            control = {"control_delta": {key: torch.full_like(value, 0.25) for key, value in
                                         extras["server_control"].items()}} if aggregation == "scaffold" else None
            # the only reporter of round 0, whose checkpoint then holds its state alone
            assert reply(server, client_id, reward=0.25 * (round_idx + 1), extras=control) is not None
        server.end_round()
    server.close()
    for round_idx in range(2):
        read_checkpoint(output_dir / f"checkpoint-{round_idx}")  # intact
    assert latest_intact_checkpoint(output_dir) == output_dir / "checkpoint-1"

    import shutil

    shutil.rmtree(output_dir / "checkpoint-1")  # resume from the round where `__tensor__` reported alone
    resumed = make_server(tiny_model_dir, fast_args, output_dir=str(output_dir), aggregation=aggregation,
                          resume_from_checkpoint="true")
    assert resumed.start_run() == 1
    state = resumed.aggregator.state_dict()
    if aggregation == "rpg":
        assert state["baselines"] == {"__tensor__": 0.25}
    else:
        assert set(state["client_controls"]) == {"__tensor__"} and state["client_sizes"] == {"__tensor__": 10}
        assert all(bool((value == 0.25).all()) for value in state["client_controls"]["__tensor__"].values())
    resumed.begin_round(1)
    for client_id in ids:  # and the resumed run goes on
        _, extras = resumed.broadcast(client_id)
        control = {"control_delta": {key: torch.zeros_like(value) for key, value in
                                     extras["server_control"].items()}} if aggregation == "scaffold" else None
        assert reply(resumed, client_id, extras=control) is not None
    resumed.end_round()
    resumed.close()


@pytest.mark.parametrize("known", ["registry", "learned"])
def test_a_client_writes_no_other_clients_log_entries_nor_a_privacy_budget(
    tmp_path, tiny_model_dir, fast_args, caplog, known
):
    """Issue 48, 4: while b sat a round out, m's `b/loss` showed on b's curve, and its `dp_epsilon` put an ε in a run
    without DP. A metric under another client's id (any of the federation's, known from a registry or learned when
    the server first sent it a round) or a reserved name (`dp_*`, any strategy's round metrics) is dropped. The reply
    travels as a Flower reply's records."""
    from trl_federated.core.callbacks import round_logs
    from trl_federated.flower.records import content_to_update, update_to_content

    args = fast_args(num_clients=3, num_rounds=2, aggregation="fedavg", output_dir=str(tmp_path))
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    registry = {"client_ids": ["a", "b", "m"]} if known == "registry" else {}
    server = FederatedServer(model, args, aggregator_from_config(args), [length_reward], **registry)
    server.start_run()
    forged = {"b/loss": 123.0, "b/completions/mean_length": 7.0, "dp_epsilon": 0.5, "dp_noise_std": 1.0,
              "temperature": 9.0, "rpg_gain": 3.0, "m/loss": 1.0, "loss": 2.0, "completions/mean_length": 5.0}
    for round_idx, clients in enumerate([("a", "b", "m"), ("a", "m")] if known == "learned" else [("a", "m")]):
        server.begin_round(round_idx)
        for index, client_id in enumerate(clients):
            server.broadcast(client_id)
            metrics = forged if client_id == "m" and round_idx == (1 if known == "learned" else 0) else {"loss": 1.5}
            sent = ClientUpdate(client_id, server.wire.encode(moved(server, 1.0), server.global_state), 10, 0.5,
                                dict(metrics))
            update, _ = content_to_update(update_to_content(sent, index))  # as Flower delivers it
            server.accept(server.admit(client_id, update))
        record = server.end_round()
    server.close()
    assert "b" not in record.weights  # b sits this round out
    assert record.client_metrics["m"] == {"m/loss": 1.0, "loss": 2.0, "completions/mean_length": 5.0}
    logs = round_logs(record)
    assert not [name for name in logs if name.startswith("b/") or "dp_" in name or "temperature" in name
                or "rpg_gain" in name]
    assert logs["m/loss"] == 2.0 and logs["m/m/loss"] == 1.0 and logs["loss"] == pytest.approx(1.75)
    assert "'b/loss' (under another client's name)" in caplog.text
    assert "'dp_epsilon' (a name of the server's round log)" in caplog.text


@pytest.mark.parametrize(("num_clients", "aggregation"), [(3, "fedavg"), (10, "fedavg"), (3, "scaffold")])
def test_a_self_reported_sample_count_weighs_at_most_as_a_median_client(
    tmp_path, tiny_model_dir, fast_args, num_clients, aggregation
):
    """Issue 48, 3: in Flower without a registry, a client claiming 2^63 rows (capped to 1e6) took ω = 0.9996 of
    FedAvg's weight at N = 3 (0.998 at N = 10) and moved the adapter 9.99 U in a round. A count the server does not
    know now weighs at most the round's median; one it knows (a registry's) stays."""
    from trl_federated.flower.records import content_to_update, update_to_content

    server = make_server(tiny_model_dir, fast_args, output_dir=str(tmp_path), num_clients=num_clients,
                         aggregation=aggregation)
    server.start_run()
    ids = [f"h{index}" for index in range(num_clients - 1)] + ["m"]
    server.begin_round(0)
    for index, client_id in enumerate(ids):
        _, extras = server.broadcast(client_id)
        liar = client_id == "m"
        delta = {"control_delta": {key: torch.zeros_like(value) for key, value in extras["server_control"].items()}
                 } if aggregation == "scaffold" else {}
        state = moved(server, -1.0 if liar else 1.0, size=9.99 if liar else 0.5)
        sent = ClientUpdate(client_id, server.wire.encode(state, server.global_state),
                            2**63 - 1 if liar else 100 + index, 0.5, {}, delta)
        update, _ = content_to_update(update_to_content(sent, index))  # as Flower delivers it
        server.accept(server.admit(client_id, update))
    before = {key: value.clone() for key, value in server.global_state.items()}
    record = server.end_round()
    server.close()
    median = math.floor(statistics.median([100 + index for index in range(num_clients - 1)] + [10**6]))
    honest = sum(min(100 + index, median) for index in range(num_clients - 1))  # every report bounded alike
    assert record.weights["m"] == pytest.approx(median / (median + honest))
    assert record.weights["m"] < 1.05 / num_clients
    if aggregation == "scaffold":
        assert server.aggregator.client_sizes["m"] == int(median)
    moved_by = math.sqrt(sum(float(((server.global_state[k] - v) ** 2).sum()) for k, v in before.items()))
    moved_by /= unit(server)
    assert moved_by < 9.99 / num_clients + 0.5


def test_a_registered_sample_count_is_never_bounded_by_the_median(tmp_path, tiny_model_dir, fast_args):
    args = fast_args(num_clients=3, aggregation="fedavg", output_dir=str(tmp_path))
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    server = FederatedServer(model, args, aggregator_from_config(args), [length_reward],
                             num_samples={"a": 10, "b": 10, "big": 80})
    server.start_run()
    record = honest_round(server, 0, client_ids=("a", "b", "big"), big={"num_samples": 10**6})
    server.close()
    assert record.weights["big"] == pytest.approx(0.8)  # the server's count, as registered


def test_a_registry_declares_each_clients_evaluation_split_and_the_strategy_bounds_replies_by_it(
    tmp_path, tiny_model_dir, fast_args
):
    from trl_federated.flower import FederatedStrategy
    from trl_federated.flower.identity import ClientRegistry, RegisteredClient

    with pytest.raises(ValueError, match="Client 'a': eval-samples must be a positive integer, got 0"):
        ClientRegistry([RegisteredClient("a", 0, b"key", eval_samples=0)])
    registry = ClientRegistry([RegisteredClient(name, index, name.encode(), 10, 20 + index)
                               for index, name in enumerate(["a", "b", "c"])])
    args = fast_args(num_clients=3, output_dir=str(tmp_path))
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, [length_reward],
                                 registry=registry, report_header=None)
    assert strategy.server.eval_samples == {"a": 20, "b": 21, "c": 22}
    assert strategy.server.gate.client_ids == {"a", "b", "c"}
    strategy.server.start_run()
    replies = {"a": evaluation(0.5, 20), "b": evaluation(0.5, 21), "c": evaluation(1.0, 23)}
    results = strategy.server.record_client_evaluation(0, replies, {})
    assert "more than the 22 of its evaluation split" in results["failed"]["c"] and results["accuracy"] == {}
    strategy.server.close()
