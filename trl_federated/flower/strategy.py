"""`FederatedStrategy`: the server of a federated run as a Flower strategy, over the runner's own server core."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from datasets import Dataset
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from peft import PeftConfig, PeftModel
from transformers import PreTrainedModel

from ..adapters import InvalidUpdateError, with_federated_adapter
from ..aggregation import Aggregator, ClientUpdate, aggregator_from_config
from ..config import FedGRPOConfig
from ..core.admission import bounded_text, read_reply
from ..core.callbacks import round_logs
from ..core.evaluation import TOTAL
from ..core.round_record import RoundRecord
from ..core.server import FederatedServer, NotEnoughClientsError, ServerStateView
from ..reports import server_reports
from ..reports.summary import round_label
from .identity import Claim, ClientRegistry, NodeBinder
from .records import (
    ACCURACY,
    LABEL_ACCURACY,
    NUM_EXAMPLES,
    TrainInstruction,
    array_record_to_state,
    content_to_evaluation,
    content_to_update,
    read_client_identity,
    state_to_array_record,
)
from .stream import show_package_logs

logger = logging.getLogger(__name__)

# A query message that asks a ClientApp which data owner it serves (per-client state, such as SCAFFOLD's c_i, is
# addressed to each client).
IDENTIFY = f"{MessageType.QUERY}.identify"
# Seconds a reply may take beyond `client_timeout`: a ClientApp process starts, imports and loads its model first.
REPLY_SLACK = 300.0
# Seconds to wait for replies without a `client_timeout` (Flower's own default for `Strategy.start`).
DEFAULT_REPLY_TIMEOUT = 3600.0
# Seconds between two "waiting for SuperNodes" log lines.
WAIT_LOG_INTERVAL = 10.0


@dataclass
class _Sent:
    """A train message of this round and the client it was addressed to."""

    message: Message
    node_id: int
    client_id: str
    client_index: int
    sent_at: float  # time.time(), the clock of Flower's message timestamps


class FederatedStrategy(ServerStateView, Strategy):
    """The server of a federated GRPO run as a Flower `Strategy`, for a federation of SuperNodes.

    The server itself is `self.server`, the `server.FederatedServer` that `FederatedRunner` drives in process: the
    same admission gate, wire format, aggregator, per-client state (SCAFFOLD's c_i), byte accounting, round records,
    evaluation, checkpoints and reports. The strategy only turns rounds into Flower messages and back.

    Every round it sends the global adapter to the connected SuperNodes that serve the clients the server samples
    (`FederatedServer.begin_round`: all of them by default; `fraction_train` and `min_train_clients` as Flower's
    `FedAvg` takes `fraction_train` and `min_train_nodes`, but drawn by client index from (seed, round), so the
    runner trains the same clients) and delivers each reply to the server, which admits it or drops its client with
    the reason. The server waits, up to `node_wait_timeout`, only for the nodes of the clients the round samples; a
    sampled client that no connected node serves then is named in the log (its index stays in the round record's
    `sampled`, with neither weight nor drop); the others sit the round out, their per-client state unchanged.
    Replies are attributed by the server's own record of what it sent (the id of each train message → the client it
    was addressed to), never by what a reply says about itself: a SuperNode that dies mid-round is one
    `client_dropped` line for its client, with Flower's reason and the elapsed time, whichever node (the SuperLink)
    reports it. Accepted updates are aggregated in client-index order, so a Flower run ends on the runner's adapter
    bit for bit. Fewer than `min_clients_per_round` accepted updates stop the run with `NotEnoughClientsError`, the
    last checkpoint intact.

    With `fraction_evaluate` > 0, Flower's evaluate round after each round sends the new global adapter to the
    clients `FederatedServer.evaluation_clients` samples; each evaluates it on its own held-out data
    (`ClientSite.eval_dataset`) and replies with its accuracy and row count, which the server pools by rows and
    logs (`client_evaluation` lines in metrics.jsonl; `Result.evaluate_metrics_clientapp`). A round's checkpoint is
    written before its evaluate round: a resumed run whose checkpointed round has no `client_evaluation` line yet (the
    interrupted run stopped during that evaluate round) redoes that evaluate round first.

    Which client a node serves is the server's call, made before any training message is sent, by `self.binder`
    (`identity.NodeBinder`; the strategy only sends its questions). With a `registry` (`identity.ClientRegistry`) it
    follows from the node's authenticated public key alone, and every node whose key is not registered is refused.
    Without one, a node is asked once (its SuperNode's `--node-config`) and trusted on first use: a claim outside the
    federation's `num_clients`, or of a client or index another connected node already serves, is refused.
    Per-client state is keyed by that stable client id, never by Flower's node id, which changes when a SuperNode
    restarts.

    The server writes what the runner writes (`output_dir/metrics.jsonl`, `round-<t>/`, the atomic `checkpoint-<t>/`,
    the evaluations of `eval_dataset`, `summary.md`, the plots, `result.json`, the final adapter with its model
    card), and logs every round (each client's R̄, h, ω and traffic, τ, the drops, the evaluation) where
    `flwr run --stream` shows it. `run()`, or `start()` inside a ServerApp of one's own, with
    `args.resume_from_checkpoint` continues an interrupted run (with new node ids, even new SuperNodes for the same
    clients). The message contract, both ways, is the docstring of `flower.records`.

    Args:
        model: The base model (wrapped here in `peft_config`'s LoRA, seeded with `args.seed`, so that the initial
            global adapter equals the runner's and the ClientApps') or a `PeftModel` whose active adapter is federated.
        args: The federation's `FedGRPOConfig`: `num_clients`, `num_rounds`, aggregation, wire format, checkpoints,
            `node_wait_timeout`.
        reward_funcs: The reward functions the clients train with: their declared `reward_range` bounds a reported
            R̄, and they score `eval_dataset` unless `eval_reward_funcs` is given.
        peft_config: LoRA configuration for a model that is not yet a `PeftModel` (default: `default_lora_config`).
        aggregator: Server strategy; built from `args` when omitted.
        callbacks: `RoundCallback`s to fire on the server (round, client and evaluation events).
        reply_timeout: Seconds to wait for the replies of a round (default: `client_timeout` + 300 s, else 3600 s).
        registry: The federation's clients by SuperNode public key (and optionally sample count), for a deployment
            across organisations; without it, nodes declare their client (see above).
        eval_dataset, eval_reward_funcs, processing_class: Held-out prompts the server scores before training,
            every `eval_every` rounds and after the last, as the runner does (see `FederatedRunner`).
        report_header: A line describing the run atop `summary.md`; None writes no summary, plots or result.json.
        dataset_name: The Hub id of the clients' data, named in the model card.
    """

    def __init__(
        self,
        model: PreTrainedModel | PeftModel,
        args: FedGRPOConfig,
        reward_funcs=None,
        peft_config: PeftConfig | None = None,
        aggregator: Aggregator | None = None,
        callbacks: list | None = None,
        reply_timeout: float | None = None,
        registry: ClientRegistry | None = None,
        eval_dataset: Dataset | None = None,
        eval_reward_funcs: Callable | list[Callable] | None = None,
        processing_class=None,
        report_header: str | None = "",
        dataset_name: str | None = None,
    ):
        if not isinstance(args, FedGRPOConfig):
            raise TypeError(f"`args` must be a FedGRPOConfig, got {type(args).__name__}.")
        self.binder = NodeBinder(args.num_clients, registry)
        self.args = args
        model = with_federated_adapter(model, args.seed, peft_config)
        if aggregator is None:
            aggregator = aggregator_from_config(args, args.num_clients)
        if reward_funcs is not None and not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        # The server holds no client data: a checkpoint pins the model, LoRA, aggregation and training settings.
        self.server = FederatedServer(
            model, args, aggregator, reward_funcs,
            num_samples=None if registry is None else registry.num_samples(),
            callbacks=[*(callbacks or []), *server_reports(args.output_dir, report_header, dataset_name)],
            client_ids=None if registry is None else [client.client_id for client in registry.clients],
            eval_samples=None if registry is None else registry.eval_samples(),
            processing_class=processing_class, eval_dataset=eval_dataset, eval_reward_funcs=eval_reward_funcs,
            writes_result=report_header is not None,
        )
        if reply_timeout is None:
            reply_timeout = DEFAULT_REPLY_TIMEOUT if args.client_timeout is None else args.client_timeout + REPLY_SLACK
        self.reply_timeout = reply_timeout
        self.first_round = 0  # federation round of Flower's server_round 1 (after a resume: the next round)
        self.started = False  # whether `start` runs: Flower's `Strategy.start` of a wrapper around this one does not
        self._sent: list[_Sent] = []  # this round's train messages, until their replies are in
        self._evaluating: list[_Sent] = []  # this round's evaluate messages, until their replies are in

    # The server's state (with `server.ServerStateView`) ------------------------------------------------------

    @property
    def model(self) -> PeftModel:
        return self.server.model

    # Running -----------------------------------------------------------------------------------------------

    def run(self, grid: Grid) -> list[RoundRecord]:
        """Run the rounds left of `args.num_rounds` (all, or those after the checkpoint `args.resume_from_checkpoint`
        names) and write the run's outputs (see the class docstring)."""
        self.start(grid)
        return self.history

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's `Strategy.start`, for a ServerApp of one's own (see `examples/flower/fgrpo_app/own_server_app.py`).

        `initial_arrays`, when given, is the global adapter the federation starts from (the model's own adapter
        otherwise; it must have its keys and shapes); a resumed run starts from its checkpoint instead. `num_rounds`,
        when given, must be `args.num_rounds`, the federation's length (the learning-rate schedule and the last
        evaluation follow it); a resumed run does the rounds its checkpoint lacks. `timeout` is the reply timeout of
        a round (default: the strategy's `reply_timeout`); `train_config` entries travel in every train message's
        config record. The run's outputs are written at the end; the `Result` holds the final global adapter and each
        round's metrics (`callbacks.round_logs`), with a redone evaluate round (see the class docstring) under server
        round 0.
        """
        show_package_logs()
        if num_rounds is not None and num_rounds != self.args.num_rounds:
            raise ValueError(
                f"num_rounds={num_rounds}, but the federation's FedGRPOConfig.num_rounds is {self.args.num_rounds}: "
                "set num_rounds there (the learning-rate schedule and the last evaluation follow it; a resumed run "
                "does the rounds its checkpoint lacks), and leave num_rounds out or equal to it."
            )
        if initial_arrays is not None:
            self._set_initial_adapter(initial_arrays)
        timeout = self.reply_timeout if timeout is None else timeout
        self.started = True
        with self.server.session() as first_round:  # closed however the run ends
            self.first_round = first_round
            redone = self._redo_evaluate_round(grid, evaluate_config, timeout)
            remaining = self.server.num_rounds - self.first_round  # fewer than configured under a privacy budget
            result = Result(arrays=state_to_array_record(self.global_state))
            if remaining > 0:
                result = super().start(
                    grid, state_to_array_record(self.global_state), num_rounds=remaining, timeout=timeout,
                    train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=evaluate_fn,
                )
            if redone is not None:
                result.evaluate_metrics_clientapp[0] = redone  # server round 0: the checkpointed round
            self.server.finish_run()
        return result

    def _redo_evaluate_round(self, grid: Grid, config: ConfigRecord | None, timeout: float) -> MetricRecord | None:
        """On a resume, the evaluate round of the checkpointed round t (server round 0) if the interrupted run did not
        record it: a round's checkpoint is written before its evaluate round, so a run stopped during that evaluate
        round would otherwise never have round t's clients' evaluation. The nodes of the clients it samples are bound
        first: a restarted ServerApp has bound none. Returns `aggregate_evaluate`'s metrics; None when nothing is
        redone."""
        round_idx = self.first_round - 1  # -1 on a fresh run
        sampled = self.server.evaluation_clients(round_idx) if round_idx >= 0 else []
        if not sampled or self.server.client_evaluation_recorded(round_idx):
            return None
        logger.info("Round %s: redoing its evaluate round after the resume: the interrupted run checkpointed the round "
                    "but recorded no clients' evaluation of it.", self._round_label(round_idx))
        self._wait_for_nodes(grid, round_idx, sampled, training=False)
        messages = self.configure_evaluate(0, state_to_array_record(self.global_state), config, grid)
        return self.aggregate_evaluate(0, grid.send_and_receive(messages, timeout=timeout))

    def _set_initial_adapter(self, initial_arrays: ArrayRecord) -> None:
        from ..adapters import check_state

        state = array_record_to_state(initial_arrays)
        check_state(state, self.server.global_state, "`initial_arrays`")
        server = self.server
        if self.args.beta != 0 and any(
            not torch.equal(state[key], value) for key, value in server.global_state.items()
        ):
            raise ValueError(
                "`initial_arrays` differ from the seeded adapter, but beta != 0: each ClientApp's KL reference π_ref "
                "is its own seeded adapter θ^{[0]}, so the federation must start from it (leave initial_arrays out), "
                "or set beta: 0."
            )
        server.global_state = {key: value.to(server.global_state[key].dtype) for key, value in state.items()}
        server.gate.open_round(server.global_state)

    def summary(self) -> None:
        """Log the run's shape; `Strategy.start` calls it first. A strategy that wraps this one (Flower's
        `DifferentialPrivacyServerSideFixedClipping`, `...ClientSideFixedClipping` and the adaptive-clipping
        wrappers) starts itself instead and reaches this from its own summary: refused, with what to use instead."""
        if not self.started:
            raise TypeError(
                "FederatedStrategy was started by a strategy that wraps it (such as Flower's "
                "DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyClientSideFixedClipping or the "
                "adaptive-clipping wrappers). Flower's DP wrappers would add their noise after this strategy's server "
                "optimizer (Adam's step has no bounded sensitivity to one client), assume equal FedAvg weights (RPG's "
                "are neither), and leave each client's R̄ in clear. Use this library's client-level DP instead: set "
                "`dp_noise_multiplier` (and `dp_clip_norm`, `dp_max_epsilon`) in the FedGRPOConfig, see "
                "docs/privacy.md, and call FederatedStrategy.start or run directly."
            )
        logger.info(
            "FederatedStrategy: %s, %d clients (%d sampled, at least %d aggregated a round), rounds %d-%d of %d, "
            "wire %s/%s, output_dir %s",
            type(self.aggregator).__name__, self.args.num_clients, self.server.clients_per_round,
            self.args.min_clients_per_round, self.first_round,
            self.args.num_rounds - 1, self.args.num_rounds, self.args.lora_aggregation, self.args.transfer_dtype,
            self.args.output_dir,
        )

    def _round_idx(self, server_round: int) -> int:
        return self.first_round + server_round - 1

    # Training ----------------------------------------------------------------------------------------------

    def _round_label(self, round_idx: int) -> str:
        """The round as the server's round lines and the ClientApps' lines name it, beside Flower's `[ROUND k/T]`."""
        return round_label(round_idx, self.args.num_rounds)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per connected SuperNode that serves a client the round samples, carrying the global
        adapter as the wire format sends it (kept here as tensors: `arrays` holds the same values), the round, the
        wire format and `config`'s entries, and the aggregator's extras for that client (SCAFFOLD: c and its c_i)."""
        round_idx = self._round_idx(server_round)
        sampled = self.server.begin_round(round_idx)
        node_ids = self._wait_for_nodes(grid, round_idx, sampled)
        self.server.add_clients(self.binder.client_of(node_id)[0] for node_id in node_ids)  # sampled or not
        self._sent = []
        for node_id in node_ids:
            client_id, client_index = self.binder.client_of(node_id)
            if client_index not in sampled:
                continue  # sits the round out
            sent, extras = self.server.broadcast(client_id, client_index)
            content = TrainInstruction(
                sent, round_idx, self.args.num_clients, extras, self.args.lora_aggregation, self.args.transfer_dtype,
            ).to_content(dict(config or {}))
            message = Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=str(round_idx))
            self._sent.append(_Sent(message, node_id, client_id, client_index, time.time()))
        logger.info("Round %s: sent the global adapter to %s.", self._round_label(round_idx),
                    ", ".join(sent.client_id for sent in self._sent) or "no client")
        return [sent.message for sent in self._sent]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Deliver each reply to the server, drop the clients that sent none, aggregate, record and checkpoint the
        round; the metrics are the round's log entry (`callbacks.round_logs`: each client's R̄, h, ω, bytes, τ,
        the evaluation)."""
        round_idx = self._round_idx(server_round)
        # The grid gave each message its id when it pushed it: a reply names the id it answers.
        awaiting = {sent.message.metadata.message_id: sent for sent in self._sent}
        accepted: list[ClientUpdate] = []
        for reply in replies:
            self._receive(reply, round_idx, awaiting, accepted)
        now = time.time()
        for sent in awaiting.values():
            self.server.drop(sent.client_id, "timeout", self._no_reply(sent, now))
        self._sent = []
        # The runner's order (the clients' indices), so that summation order, and with it every bit of the result, is
        # the same.
        self.server.accept_in_order(accepted)
        record = self.server.end_round()
        return state_to_array_record(self.global_state), MetricRecord(round_logs(record))

    def _receive(
        self, reply: Message, round_idx: int, awaiting: dict[str, _Sent], accepted: list[ClientUpdate]
    ) -> None:
        """Deliver one reply to the server, for the client its train message was addressed to (`_attribute`)."""
        sent = self._attribute(reply, awaiting, round_idx)
        if sent is None:
            return
        if reply.has_error():
            self.server.drop(sent.client_id, *self._read_failure(reply, sent))
            return
        try:
            update, claimed_index = read_reply(sent.client_id, lambda: content_to_update(reply.content))
            self._check_claim(sent, update.client_id, claimed_index)
            update = self.server.admit(sent.client_id, update)
        except (InvalidUpdateError, ValueError) as error:
            reason = str(error) if isinstance(error, InvalidUpdateError) else (
                f"Update of client {sent.client_id!r} rejected: {error}."
            )
            self.server.drop(sent.client_id, "invalid_update", reason)
            return
        accepted.append(update)

    @staticmethod
    def _check_claim(sent: _Sent, client_id, client_index) -> None:
        """`ValueError` unless a reply to `sent` speaks for the client and index the message was addressed to: the
        server's own record of what it sent decides, never the reply (train and evaluate replies alike)."""
        if (client_id, client_index) != (sent.client_id, sent.client_index):
            raise ValueError(
                f"it speaks for client {bounded_text(repr(client_id), 100)} at index {client_index!r}; its node "
                f"serves {sent.client_id!r} at index {sent.client_index}"
            )

    def _no_reply(self, sent: _Sent, now: float) -> str:
        return f"no reply after {now - sent.sent_at:.0f} s (reply timeout {self.reply_timeout:.0f} s)"

    @staticmethod
    def _attribute(reply: Message, awaiting: dict, round_idx: int | None = None):
        """The message that `reply` answers, taken out of `awaiting` (message id → what was sent: a `_Sent`, or the
        node id of an IDENTIFY query), by the server's own record alone: a reply counts once, and in the round it was
        asked for (`round_idx`; None for a query of no round); a result counts only when it comes from the node the
        message was sent to, while an error may come from the SuperLink (a node that died). None for any other
        reply, logged and ignored. The one attribution of train, evaluate and identity replies."""
        where = "Identify" if round_idx is None else f"Round {round_idx}"
        try:
            answers, group_id, node_id = (
                reply.metadata.reply_to_message_id, reply.metadata.group_id, reply.metadata.src_node_id
            )
        except Exception as error:  # not a Message: nothing to attribute it to
            logger.warning("%s: ignored a reply without metadata (%s).", where, type(error).__name__)
            return None
        sent = awaiting.get(answers)
        if sent is None or (round_idx is not None and group_id != str(round_idx)):
            logger.warning(
                "%s: ignored a reply from node %s for round %s: no message of this round awaits it (late, duplicate "
                "or unasked).", where, node_id, bounded_text(group_id, 40),
            )
            return None
        sent_to = sent if isinstance(sent, int) else sent.node_id
        try:
            foreign = not reply.has_error() and node_id != sent_to
        except Exception as error:  # a malformed reply: nothing to attribute it to
            logger.warning("%s: ignored a malformed reply (%s).", where, type(error).__name__)
            return None
        if foreign:
            logger.warning("%s: ignored a result from node %s in answer to the message sent to node %d.",
                           where, node_id, sent_to)
            return None
        return awaiting.pop(answers)

    def _read_failure(self, reply: Message, sent: _Sent) -> tuple[str, str]:
        """(kind, reason) of an error reply to the train or evaluate message `sent`: the ClientApp's own report
        (`make_client_app` sends JSON), else Flower's reason (the node became unavailable, its ClientApp process
        crashed or could not be loaded) with the seconds since the message was sent. The failure is that message's
        client's, whichever client the report names."""
        try:
            elapsed = max(0.0, float(reply.metadata.created_at) - sent.sent_at)
        except (TypeError, ValueError):
            elapsed = time.time() - sent.sent_at
        flower_reason = (f"Flower error {reply.error.code} after {elapsed:.0f} s: "
                         f"{bounded_text(reply.error.reason)}")
        try:
            report = json.loads(reply.error.reason or "")
        except (json.JSONDecodeError, TypeError, RecursionError):
            return "error", flower_reason
        if not isinstance(report, dict) or not isinstance(report.get("reason"), str):
            return "error", flower_reason
        kind = report.get("kind") if report.get("kind") in ("error", "timeout") else "error"
        reason = bounded_text(report["reason"])
        if report.get("client-id") != sent.client_id:
            reason += f" (the report names client {bounded_text(repr(report.get('client-id')), 100)})"
        return kind, reason

    # Which client each node serves (`identity.NodeBinder` decides; the strategy asks) --------------------------

    def _wait_for_nodes(self, grid: Grid, round_idx: int, sampled: list[int], training: bool = True) -> list[int]:
        """The connected SuperNodes bound to a client of the federation (`_identify`), once every client index the
        round samples is served by one or `args.node_wait_timeout` has passed, logged while waiting: a SuperNode gone
        for good delays only the rounds that sample its client. Nodes that serve no client (with a registry: those not
        in it) never count, so they cannot start a round early; each is refused once a round (`server.refuse`).
        `NotEnoughClientsError` when fewer than `min_clients_per_round` sampled clients are served. An evaluate round
        (`training` False) opens no server round: its refusals are logged, and too few clients never stop the run."""
        started = time.monotonic()
        deadline, next_log = started + self.args.node_wait_timeout, started
        refused: dict[int, str] = {}  # node id → why it serves no client, for this round
        while True:
            node_ids = self._identify(grid, refused)
            missing = sorted(set(sampled) - {self.binder.client_of(node_id)[1] for node_id in node_ids})
            now = time.monotonic()
            if not missing or now >= deadline:
                break
            if now >= next_log:
                logger.info(
                    "Round %s: no connected SuperNode serves the sampled client indices %s yet; waiting up to %.0f s "
                    "more (node_wait_timeout=%.0f s).", self._round_label(round_idx), missing, deadline - now,
                    self.args.node_wait_timeout,
                )
                next_log = now + WAIT_LOG_INTERVAL
            time.sleep(min(2.0, max(0.0, deadline - now)))
        for node_id, reason in refused.items():
            if training:
                self.server.refuse(f"node-{node_id}", reason)
            else:
                logger.warning("Round %s: node-%d is sent no evaluate message: %s.", self._round_label(round_idx),
                               node_id, reason)
        if not missing:
            return node_ids
        waited = time.monotonic() - started
        logger.warning("Round %s: no connected SuperNode serves the sampled client indices %s after %.0f s; the round "
                       "goes on without them.", self._round_label(round_idx), missing, waited)
        if training and len(sampled) - len(missing) < self.args.min_clients_per_round:
            refusals = "; ".join(f"node-{node_id}: {reason}" for node_id, reason in refused.items())
            raise NotEnoughClientsError(
                f"Round {round_idx}: only {len(sampled) - len(missing)} of the {len(sampled)} sampled clients are "
                f"served by a connected SuperNode after {waited:.0f} s (node_wait_timeout="
                f"{self.args.node_wait_timeout:.0f} s), fewer than min_clients_per_round="
                f"{self.args.min_clients_per_round}. No node serves the client indices {missing}; refused nodes: "
                f"{refusals or 'none'}."
            )
        return node_ids

    def _identify(self, grid: Grid, refused: dict[int, str]) -> list[int]:
        """The connected nodes that serve a client of the federation (`NodeBinder.bind`). Every other node (not
        registered, silent, or whose claim is refused) is added to `refused` with the reason, is sent no training
        message, and is not asked again while `refused` holds it (this round)."""
        node_ids = [node_id for node_id in sorted(grid.get_node_ids()) if node_id not in refused]
        refused.update(self.binder.bind(grid, node_ids, lambda unknown: self._ask_identities(grid, unknown)))
        return [node_id for node_id in node_ids if node_id not in refused]

    def _ask_identities(self, grid: Grid, node_ids: list[int]) -> Iterator[tuple[int, Claim]]:
        """Ask `node_ids` which client each serves (an IDENTIFY query, which `make_client_app` answers) and yield, per
        answer, the node and its claim (client id, client index) or why it made none."""
        queries = [Message(RecordDict(), dst_node_id=node_id, message_type=IDENTIFY) for node_id in node_ids]
        replies = grid.send_and_receive(queries, timeout=self.reply_timeout)
        # As for training: a reply is attributed by the query it answers (an error may come from the SuperLink).
        asked = {query.metadata.message_id: query.metadata.dst_node_id for query in queries}
        for reply in replies:
            node_id = self._attribute(reply, asked)
            if node_id is None:
                continue  # not asked, or a result from another node: an identity speaks only for its own node
            try:
                if reply.has_error():
                    claim = f"did not identify its client ({bounded_text(reply.error.reason, 200)})"
                else:
                    claim = read_client_identity(reply.content)
            except Exception as error:  # a malformed answer costs that node the round, not the server its run
                claim = f"sent an unreadable identity ({type(error).__name__}: {bounded_text(error, 200)})"
            yield node_id, claim

    # Evaluation: the server's of `eval_dataset` (in `aggregate_train`), and with `fraction_evaluate` > 0 the clients'
    # of their own held-out data (Flower's evaluate round) -------------------------------------------------------

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One evaluate message per connected SuperNode that serves a client the evaluate round samples
        (`FederatedServer.evaluation_clients`), carrying the global adapter the round made as a train message
        carries it, without extras, and `config`'s entries; none with `fraction_evaluate` 0, the default."""
        round_idx = self._round_idx(server_round)
        sampled = self.server.evaluation_clients(round_idx)
        self._evaluating = []
        if not sampled:
            return []
        serving: dict[int, tuple[int, str]] = {}  # client index → (node id, client id)
        for node_id in sorted(grid.get_node_ids()):
            client = self.binder.bound_client(node_id)
            if client is not None and client[1] in sampled:
                serving.setdefault(client[1], (node_id, client[0]))
        global_state = self.server.wire.sent(self.global_state)
        for client_index, (node_id, client_id) in sorted(serving.items()):
            content = TrainInstruction(
                global_state, round_idx, self.args.num_clients, {}, self.args.lora_aggregation,
                self.args.transfer_dtype,
            ).to_content(dict(config or {}))
            message = Message(content, dst_node_id=node_id, message_type=MessageType.EVALUATE, group_id=str(round_idx))
            self._evaluating.append(_Sent(message, node_id, client_id, client_index, time.time()))
        if missing := [index for index in sampled if index not in serving]:
            logger.warning("Round %s: no connected SuperNode serves the client indices %s sampled to evaluate.",
                           self._round_label(round_idx), missing)
        return [sent.message for sent in self._evaluating]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Pool the clients' evaluations (`FederatedServer.record_client_evaluation`: each client's accuracy per label
        and the row-weighted mean, logged and in metrics.jsonl), naming each client whose reply is an error, is
        malformed, speaks for another client or never came. Returns the pooled "accuracy" and "num-examples", with
        "accuracy/<label>", for Flower's `Result`; None without an evaluate round or any evaluation."""
        if not self._evaluating:
            return None
        round_idx = self._round_idx(server_round)
        awaiting = {sent.message.metadata.message_id: sent for sent in self._evaluating}
        evaluations: list[tuple[int, str, dict]] = []
        failed: dict[str, str] = {}
        for reply in replies:
            sent = self._attribute(reply, awaiting, round_idx)
            if sent is None:
                continue
            if reply.has_error():
                failed[sent.client_id] = self._read_failure(reply, sent)[1]
                continue
            try:
                self._check_claim(sent, *read_client_identity(reply.content))
                evaluations.append((sent.client_index, sent.client_id, content_to_evaluation(reply.content)))
            except ValueError as error:
                failed[sent.client_id] = f"invalid evaluation reply: {bounded_text(error)}"
        now = time.time()
        for sent in awaiting.values():
            failed[sent.client_id] = self._no_reply(sent, now)
        self._evaluating = []
        # In client-index order, as the training's updates: the pooled sums are the same however replies arrived.
        results = self.server.record_client_evaluation(
            round_idx, {client_id: evaluation for _, client_id, evaluation in sorted(evaluations, key=lambda e: e[0])},
            failed,
        )
        if not results["count"]:
            return None
        accuracy = results["accuracy"]
        return MetricRecord({
            ACCURACY: accuracy[TOTAL], NUM_EXAMPLES: results["count"][TOTAL],
            **{LABEL_ACCURACY + label: value for label, value in accuracy.items() if label != TOTAL},
        })
