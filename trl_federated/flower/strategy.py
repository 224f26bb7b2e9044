"""`FederatedStrategy`: the server of `FederatedRunner` as a Flower strategy, over the same aggregators."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from peft import PeftConfig, PeftModel
from transformers import PreTrainedModel

from ..adapters import AdapterState, InvalidUpdateError, get_adapter_state, save_adapter, state_nbytes
from ..admission import UpdateGate, bounded_text
from ..aggregation import Aggregator, ClientUpdate, ScaffoldAggregator, aggregator_from_config
from ..callbacks import MetricsLoggerCallback, RoundRecord, fire_round_callbacks
from ..checkpoint import CheckpointedServer, prepare_output_dir, run_identity
from ..client import zero_control
from ..config import FedGRPOConfig
from ..rewards import combined_reward_range
from ..runner import NotEnoughClientsError, with_federated_adapter
from .identity import ClientRegistry
from .records import TrainInstruction, content_to_update, read_client_identity, state_to_array_record

logger = logging.getLogger(__name__)

# A query message that asks a ClientApp which data owner it serves (SCAFFOLD addresses c_i to each client).
IDENTIFY = f"{MessageType.QUERY}.identify"
# Seconds a reply may take beyond `client_timeout`: a ClientApp process starts, imports and loads its model first.
REPLY_SLACK = 300.0
# Seconds to wait for replies without a `client_timeout` (Flower's own default for `Strategy.start`).
DEFAULT_REPLY_TIMEOUT = 3600.0


class FederatedStrategy(CheckpointedServer, Strategy):
    """The server side of `FederatedRunner` as a Flower `Strategy`, for a federation of SuperNodes.

    Every round it sends the global adapter to every connected SuperNode that serves a client of the federation
    (full participation, as in the runner), turns the replies of the `ClientApp`s (`make_client_app`) into
    `ClientUpdate`s through the runner's own `admission.UpdateGate` (decoding, identity, values, sample count,
    update norm), and hands the accepted ones, in client-index order, to the same `Aggregator` the runner uses (`aggregator_from_config(args)`: RPG + server Adam, FedAvg, FedProx, SCAFFOLD). A client whose
    ClientApp failed, timed out or replied with an invalid update is dropped from the round and logged; fewer than
    `min_clients_per_round` accepted updates stop the run with `NotEnoughClientsError`.

    Which client a node serves is the server's call, made before any training message is sent. With a
    `registry` (`identity.ClientRegistry`) it follows from the node's authenticated public key alone, and every
    node whose key is not registered is refused. Without one, a node is asked once (its SuperNode's
    `--node-config`) and trusted on first use: a claim outside the federation's `num_clients`, or of a client or
    index another connected node already serves, is refused. Either way a reply counts only for the client of the
    node it comes from, whatever it says. Per-client state is keyed by that stable client id, never by Flower's node
    id, which changes when a SuperNode restarts. SCAFFOLD's client control variates c_i
    stay with the server, as in the runner: c_i is the sum of the client's accepted Δc_i, which the server
    receives anyway, so keeping it reveals nothing new, survives SuperNode restarts, and is checkpointed.

    After every round the strategy writes `output_dir/metrics.jsonl`, `round-<t>/` and the atomic
    `checkpoint-<t>/` exactly as the runner does, so `run()` with `args.resume_from_checkpoint` continues an
    interrupted Flower run (with new node ids, even with new SuperNodes for the same clients). The strategy does
    not evaluate: score a saved `round-<t>/` adapter with `evaluation.evaluate_accuracy`.

    Args:
        model: The base model (wrapped here in `peft_config`'s LoRA, seeded with `args.seed`, so that the initial
            global adapter equals the runner's) or a `PeftModel` whose active adapter is federated.
        args: The federation's `FedGRPOConfig`: `num_clients`, `num_rounds`, aggregation, checkpoints.
        reward_funcs: The reward functions the clients train with; only their declared `reward_range` is used, to
            reject a reported R̄ outside it.
        peft_config: LoRA configuration for a model that is not yet a `PeftModel` (default: `default_lora_config`).
        aggregator: Server strategy; built from `args` when omitted.
        callbacks: `RoundCallback`s to fire on the server (round and client events).
        node_wait_timeout: Seconds to wait each round for all `num_clients` SuperNodes to be connected; the round
            then goes on with those connected if they are at least `min_clients_per_round`.
        reply_timeout: Seconds to wait for the replies of a round (default: `client_timeout` + 300 s, else 3600 s).
        registry: The federation's clients by SuperNode public key (and optionally sample count), for a deployment
            across organisations; without it, nodes declare their client (see above).
    """

    def __init__(
        self,
        model: PreTrainedModel | PeftModel,
        args: FedGRPOConfig,
        reward_funcs=None,
        peft_config: PeftConfig | None = None,
        aggregator: Aggregator | None = None,
        callbacks: list | None = None,
        node_wait_timeout: float = 600.0,
        reply_timeout: float | None = None,
        registry: ClientRegistry | None = None,
    ):
        if not isinstance(args, FedGRPOConfig):
            raise TypeError(f"`args` must be a FedGRPOConfig, got {type(args).__name__}.")
        if args.min_clients_per_round > args.num_clients:
            raise ValueError(
                f"`min_clients_per_round` ({args.min_clients_per_round}) exceeds `num_clients` ({args.num_clients}): "
                "no round could ever aggregate."
            )
        unsupported = {
            name: value
            for name, value, default in (
                ("lora_aggregation", args.lora_aggregation, "separate"),
                ("transfer_dtype", args.transfer_dtype, "float32"),
            )
            if value != default
        }
        if unsupported:
            raise ValueError(
                f"The Flower deployment sends whole float32 adapters; {unsupported} are only supported by the "
                "in-process FederatedRunner so far."
            )
        if registry is not None and len(registry) != args.num_clients:
            raise ValueError(f"The registry holds {len(registry)} clients, `num_clients` is {args.num_clients}.")
        self.args = args
        self.registry = registry
        self.model = with_federated_adapter(model, args.seed, peft_config)
        self.aggregator = aggregator if aggregator is not None else aggregator_from_config(args, args.num_clients)
        self.reward_range = None if reward_funcs is None else combined_reward_range(reward_funcs, args.reward_weights)
        for message in args.federation_warnings(self.reward_range):
            logger.warning(message)
        self.callbacks = [MetricsLoggerCallback(args.output_dir), *(callbacks or [])]
        self.node_wait_timeout = node_wait_timeout
        if reply_timeout is None:
            reply_timeout = DEFAULT_REPLY_TIMEOUT if args.client_timeout is None else args.client_timeout + REPLY_SLACK
        self.reply_timeout = reply_timeout
        self.global_state: AdapterState = get_adapter_state(self.model)
        self.history: list[RoundRecord] = []
        self.client_controls: dict[str, AdapterState] = {}  # SCAFFOLD's c_i, by client id
        self.evaluations: dict[int, dict] = {}  # the Flower path does not evaluate on the server
        # The server holds no client data: a checkpoint pins the model, LoRA, aggregation and training settings.
        self.identity = run_identity(self.model, {}, self.aggregator, args)
        self.first_round = 0  # federation round of Flower's server_round 1 (after a resume: the next round)
        self.node_clients: dict[int, tuple[str, int]] = {}  # Flower node id → (client id, client index)
        self.client_indices: dict[str, int] = {}  # client id → client index, as first bound to a node
        self.client_keys: dict[str, bytes] = {}  # client id → public key of the node first bound to it
        # Every reply enters the server through this gate (the runner's own): decoding, identity, values, bounds.
        self.gate = UpdateGate.from_config(
            args, self.global_state, self.reward_range, control=isinstance(self.aggregator, ScaffoldAggregator),
            num_samples=None if registry is None else registry.num_samples(),
        )
        self._awaiting: set[int] = set()  # nodes sent a train message this round that have not replied
        self._early_drops: dict[str, str] = {}  # clients dropped before training (no answer to IDENTIFY)
        self._round_started = 0.0

    # Running -----------------------------------------------------------------------------------------------

    def run(self, grid: Grid) -> list[RoundRecord]:
        """Run the rounds left of `args.num_rounds` (all, or those after the checkpoint `args.resume_from_checkpoint`
        names) and save the final global adapter in `output_dir` (PEFT layout)."""
        resume_from = prepare_output_dir(self.args)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        remaining = self.args.num_rounds - self.first_round
        if remaining > 0:
            self.start(grid, state_to_array_record(self.global_state), num_rounds=remaining, timeout=self.reply_timeout)
        save_adapter(self.model, self.global_state, self.args.output_dir)
        return self.history

    def summary(self) -> None:
        logger.info(
            "FederatedStrategy: %s, %d clients, rounds %d-%d of %d, output_dir %s",
            type(self.aggregator).__name__, self.args.num_clients, self.first_round, self.args.num_rounds - 1,
            self.args.num_rounds, self.args.output_dir,
        )

    def _round_idx(self, server_round: int) -> int:
        return self.first_round + server_round - 1

    def _fire(self, hook: str, **kwargs) -> None:
        fire_round_callbacks(self.callbacks, hook, self.args, **kwargs)

    # Training ----------------------------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per connected SuperNode that serves a client of the federation, carrying the global
        adapter (kept here as tensors: `arrays` holds the same values) and the round; under SCAFFOLD also c and that
        client's c_i."""
        round_idx = self._round_idx(server_round)
        self._round_started = time.perf_counter()
        self._fire("on_round_begin", round_idx=round_idx)
        self._early_drops = {}
        node_ids = self._identify(grid, self._wait_for_nodes(grid, round_idx))
        if isinstance(self.aggregator, ScaffoldAggregator):
            server_control = self.aggregator.server_control(self.global_state)
            contents = {
                node_id: TrainInstruction(
                    self.global_state, round_idx, self.args.num_clients,
                    (server_control, self.client_control(self.node_clients[node_id][0])),
                ).to_content()
                for node_id in node_ids
            }
        else:
            content = TrainInstruction(self.global_state, round_idx, self.args.num_clients).to_content()
            contents = dict.fromkeys(node_ids, content)
        self._awaiting = set(node_ids)
        return [
            Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=str(round_idx))
            for node_id, content in contents.items()
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Admit the replies, aggregate the accepted updates, record and checkpoint the round."""
        round_idx = self._round_idx(server_round)
        dropped = dict(self._early_drops)
        self.gate.open_round(self.global_state)
        accepted: list[tuple[int, ClientUpdate]] = []
        for reply in replies:
            self._receive(reply, round_idx, accepted, dropped)
        for node_id in sorted(self._awaiting):
            reason = f"no reply within {self.reply_timeout:.0f} s"
            self._drop(round_idx, self._node_label(node_id), "timeout", reason, dropped)
        self._awaiting = set()

        # The runner's order, so that summation order, and with it every bit of the result, is the same.
        updates = [update for _, update in sorted(accepted, key=lambda pair: pair[0])]
        for update in updates:
            if update.control_delta is not None:
                control = self.client_control(update.client_id)
                self.client_controls[update.client_id] = {
                    key: control[key] + delta for key, delta in update.control_delta.items()
                }
            self._fire("on_client_end", round_idx=round_idx, update=update)
        if len(updates) < self.args.min_clients_per_round:
            reasons = "; ".join(f"{client_id}: {reason}" for client_id, reason in dropped.items())
            raise NotEnoughClientsError(
                f"Round {round_idx}: only {len(updates)} clients reported a valid update, fewer than "
                f"min_clients_per_round={self.args.min_clients_per_round}. Dropped: {reasons or 'none'}. The run "
                "stops; its last checkpoint, if any, is intact."
            )

        broadcast_bytes = state_nbytes(self.global_state)
        # The gate checked every value already: the aggregator checks the rest (ids, keys, shapes, result).
        self.global_state = self.aggregator.aggregate(self.global_state, updates, round_idx, check_finite=False)
        record = RoundRecord.from_aggregation(round_idx, self.aggregator, updates, dropped, broadcast_bytes)
        record.wall_time = time.perf_counter() - self._round_started
        self.history.append(record)
        self._fire("on_round_end", record=record)
        self.save_checkpoint(round_idx)  # with round-<t>/ when save_every_round
        metrics = MetricRecord(
            {"mean-reward": sum(record.rewards.values()) / len(updates), "clients-aggregated": len(updates)}
        )
        return state_to_array_record(self.global_state), metrics

    def _receive(
        self, reply: Message, round_idx: int, accepted: list[tuple[int, ClientUpdate]], dropped: dict[str, str]
    ) -> None:
        """Admit one reply, or drop its client with the reason. A reply counts only for the client of the node it
        came from, once, in the round it was asked for; any other reply is logged and ignored."""
        try:
            node_id, group_id = reply.metadata.src_node_id, reply.metadata.group_id
        except Exception as error:  # not a Message: nothing to attribute it to
            logger.warning("Round %d: ignored a reply without metadata (%s).", round_idx, type(error).__name__)
            return
        if node_id not in self._awaiting or group_id != str(round_idx):
            logger.warning(
                "Round %d: ignored a reply from node %s for round %s: no train message of this round awaits it "
                "(late, duplicate or unasked).", round_idx, node_id, bounded_text(group_id, 40),
            )
            return
        self._awaiting.discard(node_id)
        client_id, client_index = self.node_clients[node_id]
        if reply.has_error():
            kind, reason = self._read_failure(reply, client_id)
            self._drop(round_idx, client_id, kind, reason, dropped)
            return

        def decode() -> ClientUpdate:
            update, claimed_index = content_to_update(reply.content)
            if (update.client_id, claimed_index) != (client_id, client_index):
                raise InvalidUpdateError(
                    f"Update of client {client_id!r} rejected: it speaks for client {update.client_id!r} at index "
                    f"{claimed_index}; its node serves {client_id!r} at index {client_index}."
                )
            return update

        try:
            update = self.gate.admit(client_id, decode)
        except InvalidUpdateError as error:
            self._drop(round_idx, client_id, "invalid_update", str(error), dropped)
            return
        accepted.append((client_index, update))

    def client_control(self, client_id: str) -> AdapterState:
        """SCAFFOLD's c_i of a client: zeros until its first accepted update."""
        if client_id not in self.client_controls:
            return zero_control(self.aggregator.server_control(self.global_state))
        return self.client_controls[client_id]

    def _wait_for_nodes(self, grid: Grid, round_idx: int) -> list[int]:
        """The connected SuperNodes, once all `num_clients` are there (with a registry: all registered ones, so that
        other nodes cannot start a round early) or `node_wait_timeout` has passed."""
        deadline = time.monotonic() + self.node_wait_timeout
        while True:
            node_ids = sorted(grid.get_node_ids())
            if self.registry is None:
                ready = len(node_ids)
            else:
                ready = sum(self.registry.client_of(node.public_key) is not None for node in grid.get_nodes())
            if ready >= self.args.num_clients or time.monotonic() >= deadline:
                break
            logger.info("Round %d: %d of %d SuperNodes connected; waiting.", round_idx, ready, self.args.num_clients)
            time.sleep(2.0)
        if ready < self.args.min_clients_per_round:
            raise NotEnoughClientsError(
                f"Round {round_idx}: only {ready} SuperNodes of the federation connected after "
                f"{self.node_wait_timeout:.0f} s, fewer than min_clients_per_round={self.args.min_clients_per_round}."
            )
        return node_ids

    def _identify(self, grid: Grid, node_ids: list[int]) -> list[int]:
        """The connected nodes that serve a client of the federation: by their public key with a registry, else
        after asking the ones not yet known (a new run, a restarted SuperNode) which client they serve. A node that
        is not registered, does not answer, or whose claim is refused (`_bind`), is sent no training message."""
        refused: dict[int, str] = {}
        unknown = [node_id for node_id in node_ids if node_id not in self.node_clients]
        if self.registry is not None:
            self.node_clients = {}
            for node in grid.get_nodes():
                if node.node_id not in node_ids:
                    continue
                registered = self.registry.client_of(node.public_key)
                if registered is None:
                    refused[node.node_id] = "its public key is not registered for this federation"
                else:
                    self.node_clients[node.node_id] = (registered.client_id, registered.index)
        elif unknown:
            keys = {node.node_id: bytes(node.public_key) for node in grid.get_nodes()}
            queries = [Message(RecordDict(), dst_node_id=node_id, message_type=IDENTIFY) for node_id in unknown]
            for reply in grid.send_and_receive(queries, timeout=self.reply_timeout):
                node_id = getattr(getattr(reply, "metadata", None), "src_node_id", None)
                try:
                    if node_id not in unknown or node_id in self.node_clients or node_id in refused:
                        continue  # not asked, or answered twice: the first answer stands
                    if reply.has_error():
                        refused[node_id] = f"did not identify its client ({bounded_text(reply.error.reason, 200)})"
                        continue
                    client_id, client_index = read_client_identity(reply.content)
                    refused_because = self._bind(node_id, client_id, client_index, keys.get(node_id, b""), node_ids)
                except Exception as error:  # a malformed answer costs that node the round, not the server its run
                    refused_because = f"sent an unreadable identity ({type(error).__name__}: {bounded_text(error, 200)})"
                if refused_because:
                    refused[node_id] = refused_because
        for node_id in node_ids:
            if node_id not in self.node_clients:
                reason = refused.get(node_id, "did not identify its client")
                logger.warning("Node %d is sent no training message: %s.", node_id, reason)
                self._early_drops[self._node_label(node_id)] = reason
        return [node_id for node_id in node_ids if node_id in self.node_clients]

    def _bind(self, node_id: int, client_id: str, client_index: int, key: bytes, connected: list[int]) -> str | None:
        """Record that `node_id` (holding public key `key`) serves (`client_id`, `client_index`), or return why it
        may not (trust on first use, without a registry): an index outside the federation, an id bound to another
        index (or an index to another id) earlier in the run, a client another connected node already serves (the
        first node keeps it: a newcomer cannot push it out), or a client first served by a node with another public
        key (a SuperNode restarted with its `--auth-supernode-private-key` keeps its key, and its client)."""
        if not 0 <= client_index < self.args.num_clients:
            return (f"claims client index {client_index}, outside the federation's [0, {self.args.num_clients}) "
                    "(set the SuperNode's partition-id)")
        known_index = self.client_indices.get(client_id)
        known_id = next((known for known, index in self.client_indices.items() if index == client_index), None)
        if known_index not in (None, client_index):
            return f"claims client {client_id!r} at index {client_index}; this run knows it at index {known_index}"
        if known_id not in (None, client_id):
            return f"claims index {client_index} for client {client_id!r}; this run knows {known_id!r} there"
        for other, (other_id, _) in self.node_clients.items():
            if other != node_id and other in connected and other_id == client_id:
                return f"claims client {client_id!r}, which connected node {other} already serves"
        if self.client_keys.setdefault(client_id, key) != key:
            return (f"claims client {client_id!r}, which a node with another public key served first in this run "
                    "(start SuperNodes with --auth-supernode-private-key, or give the strategy a registry)")
        # A node that served the client before and is gone (a restarted SuperNode) hands it over.
        for other in [other for other, (other_id, _) in self.node_clients.items() if other_id == client_id]:
            del self.node_clients[other]
        self.node_clients[node_id] = (client_id, client_index)
        self.client_indices[client_id] = client_index
        return None

    def _drop(self, round_idx: int, client_id: str, kind: str, reason: str, dropped: dict[str, str]) -> None:
        logger.warning("Round %d: client %r dropped (%s): %s", round_idx, client_id, kind, reason)
        dropped[client_id] = reason
        self._fire("on_client_dropped", round_idx=round_idx, client_id=client_id, kind=kind, reason=reason)

    def _node_label(self, node_id: int) -> str:
        """The client id of a node, or its node id when it serves no known client."""
        return self.node_clients[node_id][0] if node_id in self.node_clients else f"node-{node_id}"

    def _read_failure(self, reply: Message, client_id: str) -> tuple[str, str]:
        """(kind, reason) of an error reply from the node of `client_id`: the ClientApp's own report
        (`make_client_app` sends JSON), else Flower's reason (the ClientApp process crashed or could not be loaded).
        The failure is that node's client's, whichever client the report names."""
        flower_reason = f"Flower error {reply.error.code}: {bounded_text(reply.error.reason)}"
        try:
            report = json.loads(reply.error.reason or "")
        except (json.JSONDecodeError, TypeError, RecursionError):
            return "error", flower_reason
        if not isinstance(report, dict) or not isinstance(report.get("reason"), str):
            return "error", flower_reason
        kind = report.get("kind") if report.get("kind") in ("error", "timeout") else "error"
        reason = bounded_text(report["reason"])
        if report.get("client-id") != client_id:
            reason += f" (the report names client {bounded_text(repr(report.get('client-id')), 100)})"
        return kind, reason

    # Evaluation happens outside the federation (see the class docstring) ------------------------------------

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # Checkpoints -------------------------------------------------------------------------------------------

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore the server state of a checkpoint of this federation (same base model, LoRA configuration and
        aggregator, else `CheckpointMismatchError`); the next round run is the one after it."""
        checkpoint = self.restore_checkpoint(path)
        self.first_round = checkpoint.round_idx + 1
        self._fire("on_resume", round_idx=checkpoint.round_idx, history=self.history, evaluations=self.evaluations)
        logger.info("Resumed from %s: continuing with round %d.", path, self.first_round)
        return checkpoint.round_idx
