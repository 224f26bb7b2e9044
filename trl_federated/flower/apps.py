"""Flower `ClientApp` and `ServerApp` factories over `train_local_round` and `FederatedStrategy`."""

from __future__ import annotations

import json
import logging
import os
import reprlib
import sys
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from datasets import Dataset
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler
from flwr.superlink.grid import InMemoryGrid
from peft import PeftConfig, PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import GRPOTrainer

from ..adapters import AdapterState, freeze_lora_a, get_adapter_state, with_federated_adapter
from ..aggregation.privacy import RECORD_EPSILON
from ..config import FedGRPOConfig
from ..core.evaluation import check_eval_reward_funcs, evaluate_adapter
from ..local.client import describe_failure, local_training_args, train_local_round
from ..local.local_trainer import drop_unsupported_speedups, local_trainer
from ..reports.summary import round_label
from ..wire import WireFormat
from .records import (
    CLIENT,
    TrainInstruction,
    array_record_to_state,
    client_identity_record,
    evaluation_to_content,
    state_to_array_record,
    update_to_content,
)
from .run_config import NUM_PARTITIONS, FederationSizeError
from .strategy import FederatedStrategy
from .stream import show_package_logs

logger = logging.getLogger(__name__)

# θ^{[0]} of each model a ClientApp has trained, taken the first time it is seen (before any round touched it): the
# KL reference π_ref when beta != 0. A model `load_site` caches across messages keeps its reference; a model loaded
# afresh per message is θ^{[0]} anyway.
_initial_adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_adapter(model) -> AdapterState | None:
    """π_ref's adapter for `model` (θ^{[0]}, recorded by `_prepare_site_model` when beta != 0), else None. A
    module-level function, so that a `ClientApp` pickles without the weak dictionary: the Simulation Engine's Ray
    backend sends the `ClientApp` to its actors by value."""
    return _initial_adapters.get(model)


# What `load_once` has loaded in this process, by key.
_loaded: dict[Hashable, Any] = {}
T = TypeVar("T")


def load_once(key: Hashable, load: Callable[[], T]) -> T:
    """`load()` the first time this process asks for `key`; the same object every later time.

    For `load_site` to keep its model across messages: a Simulation Engine worker (a Ray actor, one per
    `client-resources` share of the machine) runs message after message, of any client, in one process, and would
    otherwise load the model for each. The key must hold everything that determines the model (path, revision,
    dtype, quantization, the LoRA configuration, the seed its A matrices are drawn with, and `lora_aggregation`,
    since freeze_a freezes A in the model); give a `PeftModel` already wrapped in the federation's adapter
    (`adapters.with_federated_adapter`), since `ClientSite` would wrap a base model again every message. Sharing the
    model between clients is what `FederatedRunner` does too: every message loads the global adapter into it, and a
    client round leaves nothing else behind (the trainer's forward wrappers and its `ref` adapter are undone, see
    `client.train_local_round`). Under Flower's deployment runtime each message has a process of its own, and this
    loads every time.
    """
    if key not in _loaded:
        _loaded[key] = load()
        logger.info("Process %d loaded %s, kept for its later messages.", os.getpid(), reprlib.repr(key))
    return _loaded[key]


@dataclass
class ClientSite:
    """What one data owner trains with; the `load_site(context)` given to `make_client_app` builds it.

    Args:
        model: The base model, or a `PeftModel` with the federation's adapter. A base model is wrapped in
            `peft_config` (default: `default_lora_config`), which must be the server's: the global adapter is loaded
            into it by key and shape. A model kept across messages (`load_once`) must be the `PeftModel`.
        processing_class: Tokenizer or processor, as for `GRPOTrainer`.
        reward_funcs: As for `GRPOTrainer`.
        train_dataset: The site's own training set; it never leaves the site. Under `rpg_signal="held-out"` the
            client round sets its held-out slice aside from it (`data.partition.held_out_split`).
        args: The federation's `FedGRPOConfig` (its GRPO fields configure local training; `seed` must be the
            server's for the run to equal the in-process runner's). `output_dir` is a local scratch folder.
        peft_config: LoRA configuration for a base `model`.
        callbacks, trainer_kwargs: Further `GRPOTrainer` callbacks and arguments.
        eval_dataset: The site's own held-out rows (a `prompt` column and what the rewards read), on which it
            evaluates the global adapter when the server asks (its evaluate round, `fraction_evaluate` > 0); they
            never leave the site, only the accuracy and row count do. None: the site declines such a request.
        eval_reward_funcs: The reward function(s) that score `eval_dataset`, summed with weight 1 each (default:
            `reward_funcs` with `args.reward_weights`, as the server scores its own `eval_dataset`).
    """

    model: PreTrainedModel | PeftModel
    processing_class: PreTrainedTokenizerBase
    reward_funcs: Any
    train_dataset: Dataset
    args: FedGRPOConfig
    peft_config: PeftConfig | None = None
    callbacks: list = field(default_factory=list)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_dataset: Dataset | None = None
    eval_reward_funcs: Any = None


def node_client_identity(context: Context) -> tuple[str, int]:
    """(client id, client index) of a SuperNode from its `--node-config`: `partition-id=<index>` (0 to N-1, the
    index that seeds the client's rounds) and optionally `client-id=<name>`, by default `client_<index>`: the names
    the in-process runner gives a list of client datasets."""
    node_config = context.node_config
    if "partition-id" not in node_config:
        raise ValueError(
            "The SuperNode has no `partition-id` in its node config: start it with "
            "--node-config 'partition-id=<client index, 0 to num_clients-1>' (and optionally client-id=\"<name>\")."
        )
    client_index = int(node_config["partition-id"])
    return str(node_config.get("client-id", f"client_{client_index}")), client_index


def make_client_app(
    load_site: Callable[[Context], ClientSite],
    identify: Callable[[Context], tuple[str, int]] = node_client_identity,
    trainer_class: type[GRPOTrainer] | None = None,
) -> ClientApp:
    """A `ClientApp` that runs one local round of federated GRPO per train message.

    For each train message it calls `load_site(context)` (model, tokenizer, rewards, the site's own data and
    config; under Flower's deployment runtime every message starts a fresh ClientApp process, while a Simulation
    Engine worker runs many: `load_once` keeps its model), trains with
    `client.train_local_round`, the runner's own code, from the received global adapter with the seed of
    (round, client index), and replies with the adapter in the server's wire format, R̄, the sample count and the
    training metrics. A local round that fails replies with an error naming the client, the kind of failure
    ("timeout" past `client_timeout`, else "error") and the reason, which the server logs as a dropped client; so
    does a site config with a vLLM setting that clients cannot use (`FedGRPOConfig.check_vllm`:
    `vllm_mode="colocate"`), before any trainer or engine is built. With `vllm_mode="server"`, give each SuperNode
    its own vLLM server.

    An evaluate message (the server's evaluate round, `fraction_evaluate` > 0) is answered with the accuracy of the
    global adapter it carries on the site's own `eval_dataset` (`evaluation.evaluate_adapter`, as the server
    evaluates its own) and the row count, per label of `partition_column` too; a site without `eval_dataset`, or
    whose evaluation fails, replies with an error the server logs. It also answers the server's identity query
    (which client a node serves) from `identify(context)`, without loading anything. The messages both ways are
    documented in `flower.records`; a stock Flower strategy's train message (`FedAvg`: "arrays" and "server-round")
    is taken too. Each local round is logged on the SuperNode (steps, rows, R̄, loss, seconds).

    `trainer_class`: the trainer that trains each round, a `GRPOTrainer` subclass (TRL's experimental `GMPOTrainer`,
    or your own) or an `RLOOTrainer` one, with `local_trainer.LocalGRPOMixin` mixed in (default: `GRPOTrainer`);
    checked here, before any message. For a trainer outside GRPO's family the site config's GRPO speed-ups
    (`shared_prefix`, `fast_generation`) are turned off with one notice, as `trl-federated run` does.
    """
    trainer_class = local_trainer(trainer_class or GRPOTrainer)
    app = ClientApp()

    def read_instruction(message: Message, context: Context) -> tuple[TrainInstruction, ClientSite]:
        """The server's instruction, checked against the node's federation size, and the node's site, whose config
        has the speed-ups `trainer_class` cannot take turned off with one notice, as `trl-federated run` turns them
        off: a config written for GRPO (the example app's) trains an RLOO site rather than failing its every round."""
        instruction = TrainInstruction.from_content(message.content)
        check_federation_size(context.node_config.get(NUM_PARTITIONS), instruction.num_clients)
        site = load_site(context)
        drop_unsupported_speedups(trainer_class, site.args)
        return instruction, site

    @app.train()
    def train(message: Message, context: Context) -> Message:
        show_package_logs()
        client_id, client_index = identify(context)
        try:
            instruction, site = read_instruction(message, context)
            site.args.check_vllm()  # before the site's model is wrapped or any trainer (or vLLM engine) is built
            model, global_state, wire = _prepare_site_model(site, instruction)
            args = local_training_args(
                site.args, instruction.round_idx, client_index, instruction.num_clients or site.args.num_clients,
                client_id,
            )
            residual = read_wire_residual(context)
            update = train_local_round(
                model, global_state, client_id, site.train_dataset, args, site.reward_funcs,
                site.processing_class, callbacks=site.callbacks, trainer_kwargs=site.trainer_kwargs,
                extras=instruction.extras, reference_state=reference_adapter(model), trainer_class=trainer_class,
                wire=wire, wire_residual=residual,  # the reply in the server's wire format
                evaluate=evaluate_adapter,  # R̄ under rpg_signal "held-out", on the site's own held-out slice
            )
            if residual:
                context.state[WIRE_RESIDUAL] = state_to_array_record(residual)
            if "step_rewards" in update.metrics:
                logger.info(
                    "Round %s, client %r: %d local steps on %d rows, R̄ = %.4f, loss %.4f, %.1f s.",
                    round_label(instruction.round_idx, site.args.num_rounds), client_id,
                    len(update.metrics["step_rewards"]), update.num_samples,
                    update.reward, update.metrics["train_loss"], update.metrics["train_seconds"],
                )
            else:  # record-level DP: what the update carries is released, its step rewards and loss are not
                logger.info(
                    "Round %s, client %r: %d rows, R̃ = %.4f released, record-level ε = %.3f, %.1f s.",
                    round_label(instruction.round_idx, site.args.num_rounds), client_id, update.num_samples,
                    update.reward, update.metrics[RECORD_EPSILON], update.metrics["train_seconds"],
                )
        except Exception as error:  # reported to the server, which drops this client from the round
            return failure_reply(message, client_id, error, "its local round")
        return Message(update_to_content(update, client_index), reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        show_package_logs()
        client_id, client_index = identify(context)
        try:
            instruction, site = read_instruction(message, context)
            if site.eval_dataset is None:
                raise ValueError("this site has no held-out data: give its ClientSite an `eval_dataset`")
            model, global_state, _ = _prepare_site_model(site, instruction)
            if site.eval_reward_funcs is None:
                reward_funcs, reward_weights = site.reward_funcs, site.args.reward_weights
            else:
                reward_funcs, reward_weights = site.eval_reward_funcs, None
            results = evaluate_adapter(
                model, global_state, site.processing_class, site.eval_dataset, site.args,
                check_eval_reward_funcs(reward_funcs), reward_weights,
            )
        except Exception as error:  # reported to the server, which logs it with the round's evaluations
            return failure_reply(message, client_id, error, "its evaluation")
        return Message(evaluation_to_content(results, client_id, client_index), reply_to=message)

    @app.query("identify")
    def identify_client(message: Message, context: Context) -> Message:
        return Message(RecordDict({CLIENT: client_identity_record(*identify(context))}), reply_to=message)

    return app


def failure_reply(message: Message, client_id: str, error: Exception, what: str) -> Message:
    """The error reply to `message` of a client that failed `what` (its local round, its evaluation): JSON naming
    the client, the kind of failure ("timeout" past `client_timeout`, else "error") and the reason, which the server
    logs; the traceback stays in the SuperNode's log."""
    kind, reason = describe_failure(error)
    logger.exception("Client %r failed %s (%s)", client_id, what, kind)
    report = json.dumps({"client-id": client_id, "kind": kind, "reason": reason})
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=report), reply_to=message)


def check_federation_size(federation_size, num_clients: int | None) -> None:
    """Refuse a federation whose number of SuperNodes (`num-partitions`, where known) is not `num_clients`: the
    clients would split the data into other shares than the server weighs, or some would have no client index."""
    if federation_size is not None and num_clients is not None and int(federation_size) != num_clients:
        raise FederationSizeError(
            f"The federation has {int(federation_size)} SuperNodes (num-partitions; in simulation "
            f"`--federation-config num-supernodes=...`), but the server runs num_clients={num_clients}: make them "
            "agree, or leave `num-clients` unset so that it follows the federation."
        )


def simulated_federation_size(grid: Grid, timeout: float = 60.0) -> int | None:
    """The number of SuperNodes of a Simulation Engine run (its `num-supernodes`), None for a deployment, whose
    SuperNodes come and go. The Simulation Engine registers all its SuperNodes at once, just after it starts the
    ServerApp: the count is read once it is non-zero and has held for half a second."""
    if not isinstance(grid, InMemoryGrid):
        return None
    deadline, previous = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        count = len(grid.get_node_ids())
        if count and count == previous:
            return count
        previous = count
        time.sleep(0.5)
    return None


# The node's error-feedback memory under a quantized wire (`WireFormat.encode`), in its `context.state`, which Flower
# keeps for the node across the messages of a run: it never travels, and a restarted SuperNode starts it from zero.
WIRE_RESIDUAL = "wire-residual"


def read_wire_residual(context: Context) -> AdapterState:
    """The node's error-feedback residual (empty before its first quantized reply)."""
    record = context.state.array_records.get(WIRE_RESIDUAL)
    return {} if record is None else array_record_to_state(record)


def _prepare_site_model(site: ClientSite, instruction: TrainInstruction) -> tuple[PeftModel, AdapterState, WireFormat]:
    """The site's `PeftModel` (wrapped in the federation's adapter, LoRA A frozen under freeze_a), the full global
    adapter of the instruction (the frozen A, which does not travel, is the site's own: seeded like the server's),
    and the wire format the reply is encoded in."""
    if instruction.lora_aggregation != site.args.lora_aggregation:
        raise ValueError(
            f"The server federates with lora_aggregation={instruction.lora_aggregation!r}, this site is configured "
            f"with {site.args.lora_aggregation!r}: give the site the server's configuration."
        )
    model = with_federated_adapter(site.model, site.args.seed, site.peft_config)
    if site.args.lora_aggregation == "freeze_a":
        freeze_lora_a(model)
    own = get_adapter_state(model)
    if site.args.beta != 0 and model not in _initial_adapters:
        _initial_adapters[model] = own
    wire = WireFormat.of(instruction.lora_aggregation, instruction.transfer_dtype, own)
    global_state = {key: own[key] for key in wire.frozen_keys} | instruction.global_state
    return model, global_state, wire


def shut_ray_down() -> None:
    """Shut down the Ray cluster a simulation started in this process, if any: registered to run when `flwr stop`
    ends the Simulation Engine's process (this ServerApp's) through Flower's exit handlers, which force the exit 5 s
    later, before Ray's own shutdown at exit. The raylet then died by SIGKILL, and Ray's dashboard and runtime-env
    agents, taking that for a crash, spent a minute reporting it to the dead GCS before they exited (Flower 1.42,
    Ray 2.55); `ray.shutdown` stops the raylet with SIGTERM, and the agents follow it at once. Ray is looked up
    when the handler runs: the Simulation Engine may still be importing it when the ServerApp starts."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    # The Simulation Engine's thread goes on calling Ray until the process exits, and Ray starts a new cluster for a
    # call without one (`RAY_ENABLE_AUTO_CONNECT`, read once at import), which would die by SIGKILL in turn.
    auto_init = sys.modules.get("ray._private.auto_init_hook")
    if auto_init is not None:
        auto_init.enable_auto_connect = False
    ray.shutdown()


def make_server_app(build_strategy: Callable[[Context], FederatedStrategy]) -> ServerApp:
    """A `ServerApp` that runs the federation `build_strategy(context)` describes (model, `FedGRPOConfig`, reward
    functions), resuming from its latest checkpoint when the config asks to (`resume_from_checkpoint`).

    Under the Simulation Engine the ServerApp's `context.node_config` carries `num-partitions`, the number of
    simulated SuperNodes, as every simulated ClientApp's does, so that `build_strategy` can size the federation by
    it (`run_config.federation_arguments`); a strategy whose `num_clients` differs is refused before any round
    (`FederationSizeError`, naming both numbers), and so is `use_vllm`, whose one server cannot serve the concurrent
    simulated clients (`FedGRPOConfig.check_vllm`). A simulation that `flwr stop` ends shuts its Ray cluster down
    before it exits, leaving no Ray process behind (`shut_ray_down`).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        federation_size = simulated_federation_size(grid)
        if federation_size is not None:
            context.node_config[NUM_PARTITIONS] = federation_size
            add_exit_handler(shut_ray_down, run_before_force_exit=True)
        strategy = build_strategy(context)
        check_federation_size(federation_size, strategy.args.num_clients)
        if federation_size is not None:  # simulated ClientApps run in worker processes of their own
            strategy.args.check_vllm(parallel_clients=True)
        strategy.run(grid)

    return app
