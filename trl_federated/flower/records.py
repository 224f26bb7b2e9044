"""The message contract between the Flower `ServerApp` (`FederatedStrategy`) and the `ClientApp`s
(`make_client_app`), as Flower records, and the conversions both sides use.

Server → client, a "train" message (`TrainInstruction`):
    "arrays"          ArrayRecord   the global adapter θ^{[t]}, keyed as `get_peft_model_state_dict` keys it; under
                                    `lora_aggregation="freeze_a"` without the LoRA A factors, which never change
                                    (the client keeps its own, seeded like the server's)
    "config"          ConfigRecord  "round-idx" (0-based t), "server-round" (t + 1, Flower's convention),
                                    "num-clients" (N), from which the client takes its seed as the runner does;
                                    "lora-aggregation" and "transfer-dtype", the wire format of the reply; and any
                                    entry of the `train_config` given to `FederatedStrategy.start`
    "extra/<name>"    ArrayRecord   one per extra the aggregation sends this client (`Aggregator.client_extras`;
                                    SCAFFOLD: "extra/server_control" c, "extra/client_control" its c_i), which the
                                    client trains with as the `aggregation` of its own `FedGRPOConfig` says
                                    (`Aggregator.client_hook`)

Client → server, the reply:
    "arrays"          ArrayRecord   the client's update as the wire format encodes it (`wire.WireFormat`):
                                    θ_i^{[t]} in float32, or θ_i^{[t]} − θ^{[t]} in bfloat16, or quantized blockwise
                                    (int8, nf4, fp4: per entry its uint8 codes, and its float32 block scales under
                                    "<key>#scales"); without A under freeze_a
    "metrics"         MetricRecord  "num-examples" (D_i), "reward" (R̄_i^{[t]}) and the update's other metrics
                                    ("step_rewards", "train_loss", "train_seconds", "wall_clock", TRL's
                                    per-step means), of which the server keeps only finite numbers and those two
                                    lists, bounded (`admission.bound_metrics`)
    "client"          ConfigRecord  "client-id" and "client-index", the data owner the reply claims to speak for
                                    (checked against the server's own map of nodes to clients, never trusted)
    "extra/<name>"    ArrayRecord   one per extra the client sends back (`ClientUpdate.extras`; SCAFFOLD:
                                    "extra/control_delta" Δc_i)
or an error reply: `Error.reason` is JSON {"client-id", "kind" ("error" or "timeout"), "reason"} when the local
round failed; any other error (a crashed ClientApp, a node the SuperLink reports unavailable) is Flower's own.

Server → client, an "evaluate" message (`fraction_evaluate` > 0, after each round): a train message's "arrays" and
"config" (`TrainInstruction`, "round-idx" the round that made the adapter), without extras. The reply:
    "metrics"         MetricRecord  "num-examples" (rows of the client's held-out data) and "accuracy" (their mean
                                    reward), Flower's names, so that a stock strategy weighs it; per label of
                                    `partition_column`, "accuracy/<label>" and "count/<label>"
    "client"          ConfigRecord  as in the train reply
or an error reply, as for training.

Server → client, a "query.identify" message (empty): the reply's "client" ConfigRecord names the client the node
serves (its `--node-config` `partition-id`, `client-id`). A strategy with a `ClientRegistry` never sends it.

Interoperability: the ClientApp also takes a stock Flower strategy's train message (`FedAvg`: "arrays" and a
"config" with only "server-round"): it then reads N from its own `FedGRPOConfig` and replies in float32 with one
ArrayRecord and one MetricRecord weighted by "num-examples", as `FedAvg` expects (an aggregation with extras, such
as SCAFFOLD, needs this strategy). `FederatedStrategy` needs the reply records above from its ClientApps.

Tensors go through NumPy's `.npy` format (Flower's `Array`), bit for bit; bfloat16, which NumPy lacks, travels as
its int16 bit pattern under the dtype name "bfloat16".

Whatever arrives is read as untrusted: an array is decoded only after its `.npy` header has been parsed and checked
against the bytes that came (version, a plain numeric dtype, C order, exactly shape × itemsize bytes of data), so
a malformed or oversized record costs no allocation beyond what was received and raises `ValueError` naming the
entry; the metadata of a reply must have the documented types. `admission.UpdateGate` turns any such error into
the client's `InvalidUpdateError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from io import BytesIO

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..adapters import AdapterState, InvalidUpdateError
from ..aggregation import ClientUpdate
from ..core.admission import MAX_CLIENT_ID_LENGTH, bounded_text, check_client_id
from ..core.evaluation import TOTAL

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
CLIENT = "client"
EXTRA = "extra/"  # the prefix of the ArrayRecord of each extra, both ways
# MetricRecord keys of the update itself; every other metric is the update's `metrics`.
NUM_EXAMPLES = "num-examples"  # Flower's usual name for the data volume
REWARD = "reward"
# MetricRecord keys of an evaluation reply besides NUM_EXAMPLES: the mean reward of all rows, and per label.
ACCURACY = "accuracy"
LABEL_ACCURACY, LABEL_COUNT = "accuracy/", "count/"
# Labels an evaluation reply may carry (`partition_column` values: the paper's have 3 and 4).
MAX_EVALUATION_LABELS, MAX_LABEL_LENGTH = 64, 100


def state_to_array_record(state: AdapterState) -> ArrayRecord:
    """An adapter state (or an extra shaped like it, such as a SCAFFOLD control variate) as an `ArrayRecord`,
    exactly."""
    return ArrayRecord({key: _tensor_to_array(tensor) for key, tensor in state.items()})


def array_record_to_state(record: ArrayRecord) -> AdapterState:
    """The tensors of an `ArrayRecord` written by `state_to_array_record`, with their dtypes; `ValueError`, naming
    the entry, for anything else."""
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"expected an ArrayRecord, got {type(record).__name__}")
    state = {}
    for key, array in record.items():
        try:
            state[key] = _array_to_tensor(array)
        except Exception as error:  # numpy's and torch's own errors, whatever their type
            raise ValueError(
                f"array {bounded_text(repr(key), 100)} cannot be decoded: {bounded_text(error, 200)}"
            ) from error
    return state


def _tensor_to_array(tensor: torch.Tensor) -> Array:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype != torch.bfloat16:
        return Array(tensor.numpy())
    bits = Array(tensor.view(torch.int16).numpy())
    return Array(dtype="bfloat16", shape=bits.shape, stype=bits.stype, data=bits.data)


# What an array may hold: the numeric dtypes torch shares with NumPy (bfloat16 travels as int16).
_NUMERIC_KINDS = "fiub"
_NPY_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _array_to_tensor(array: Array) -> torch.Tensor:
    """Decode one `.npy` array without trusting it: the header is parsed and checked first, then the data is copied
    out of the received bytes (never a larger buffer than those)."""
    if not isinstance(array, Array) or array.stype != "numpy.ndarray" or not isinstance(array.data, bytes):
        raise ValueError("not a NumPy-serialised Flower Array")
    stream = BytesIO(array.data)
    version = np.lib.format.read_magic(stream)
    if version not in _NPY_READERS:
        raise ValueError(f".npy format version {version} is not accepted")
    shape, fortran_order, dtype = _NPY_READERS[version](stream)
    if dtype.hasobject or dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"dtype {dtype} is not a plain numeric dtype")
    if fortran_order:
        raise ValueError("Fortran-ordered data is not accepted")
    count = math.prod(shape)
    expected, received = count * dtype.itemsize, len(array.data) - stream.tell()
    if received != expected:
        raise ValueError(f"header declares shape {shape} of {dtype} ({expected} bytes), but {received} bytes follow")
    declared = tuple(array.shape) if isinstance(array.shape, (list, tuple)) else array.shape
    if declared != tuple(shape):
        raise ValueError(f"record declares shape {declared}, its data has shape {tuple(shape)}")
    is_bfloat16 = array.dtype == "bfloat16"
    if str(dtype) != ("int16" if is_bfloat16 else array.dtype):
        raise ValueError(f"record declares dtype {bounded_text(repr(array.dtype), 40)}, its data holds {dtype}")
    values = np.frombuffer(array.data, dtype=dtype, count=count, offset=stream.tell()).reshape(shape)
    # A native-order, writable copy: torch may share its memory.
    tensor = torch.from_numpy(values.astype(dtype.newbyteorder("="), copy=True))
    return tensor.view(torch.bfloat16) if is_bfloat16 else tensor


@dataclass
class TrainInstruction:
    """What the server asks of a client in one round (the content of a train message)."""

    global_state: AdapterState  # the entries the wire format sends (all but LoRA A under freeze_a)
    round_idx: int
    num_clients: int | None = None  # None: a stock strategy's message, which does not say
    extras: dict[str, AdapterState] = field(default_factory=dict)  # `Aggregator.client_extras`
    lora_aggregation: str = "separate"
    transfer_dtype: str = "float32"

    def to_content(self, config: dict | None = None) -> RecordDict:
        """The message content, with `config`'s entries (a strategy's `train_config`) in its config record."""
        entries = {
            **(config or {}),
            "round-idx": self.round_idx,
            "server-round": self.round_idx + 1,
            "lora-aggregation": self.lora_aggregation,
            "transfer-dtype": self.transfer_dtype,
        }
        if self.num_clients is not None:
            entries["num-clients"] = self.num_clients
        content = RecordDict({ARRAYS: state_to_array_record(self.global_state), CONFIG: ConfigRecord(entries)})
        add_extras(content, self.extras)
        return content

    @classmethod
    def from_content(cls, content: RecordDict) -> TrainInstruction:
        """The instruction of a train message: this strategy's, or a stock Flower strategy's ("arrays" and a
        "config" with Flower's 1-based "server-round"); `ValueError`, naming the record or key, for anything else."""
        if ARRAYS not in content.array_records:
            raise ValueError(f"The train message has no {ARRAYS!r} ArrayRecord (the global adapter); it has "
                             f"{sorted(content.array_records)}.")
        config = content.config_records.get(CONFIG, ConfigRecord())
        if "round-idx" in config:
            round_idx = int(config["round-idx"])
        elif "server-round" in config:
            round_idx = int(config["server-round"]) - 1
        else:
            raise ValueError(f"The train message's {CONFIG!r} ConfigRecord names no round: it needs 'round-idx' "
                             "(0-based) or Flower's 'server-round' (1-based).")
        return cls(
            global_state=array_record_to_state(content[ARRAYS]),
            round_idx=round_idx,
            num_clients=int(config["num-clients"]) if "num-clients" in config else None,
            extras=read_extras(content),
            lora_aggregation=str(config.get("lora-aggregation", "separate")),
            transfer_dtype=str(config.get("transfer-dtype", "float32")),
        )


def add_extras(content: RecordDict, extras: dict[str, AdapterState]) -> None:
    """Put each extra into `content` as the ArrayRecord "extra/<name>"."""
    for name, extra in extras.items():
        content[EXTRA + name] = state_to_array_record(extra)


def read_extras(content: RecordDict) -> dict[str, AdapterState]:
    """The extras in `content`, by name (`add_extras`)."""
    return {
        key.removeprefix(EXTRA): array_record_to_state(record)
        for key, record in content.array_records.items()
        if key.startswith(EXTRA)
    }


def client_identity_record(client_id: str, client_index: int) -> ConfigRecord:
    return ConfigRecord({"client-id": client_id, "client-index": client_index})


def read_client_identity(content: RecordDict) -> tuple[str, int]:
    """(client id, client index) a reply claims; `InvalidUpdateError` unless it names one: a `client-id` that can
    name a client (`admission.check_client_id`: 1 to 256 characters, safe as a path component) and an integer
    `client-index`. What it claims is checked against the server's own map of nodes to clients (`FederatedStrategy`),
    never taken on trust."""
    record = content.config_records.get(CLIENT)
    client_id = None if record is None else record.get("client-id")
    client_index = None if record is None else record.get("client-index")
    try:
        check_client_id(client_id)
    except ValueError as error:
        fault = str(error)
    else:
        fault = None if isinstance(client_index, int) and not isinstance(client_index, bool) else "no int client-index"
    if fault is not None:
        raise InvalidUpdateError(f"The reply names no client: it needs a {CLIENT!r} ConfigRecord with 'client-id' "
                                 f"(a str of 1 to {MAX_CLIENT_ID_LENGTH} characters, safe as a path component) and "
                                 f"'client-index' (int); {fault}.")
    return client_id, client_index


def update_to_content(update: ClientUpdate, client_index: int) -> RecordDict:
    """A client's `ClientUpdate` as the content of its reply."""
    reserved = {NUM_EXAMPLES, REWARD} & set(update.metrics)
    if reserved:
        raise ValueError(f"Update metrics must not use the reserved names {sorted(reserved)}.")
    content = RecordDict(
        {
            ARRAYS: state_to_array_record(update.state),
            METRICS: MetricRecord({NUM_EXAMPLES: update.num_samples, REWARD: float(update.reward), **update.metrics}),
            CLIENT: client_identity_record(update.client_id, client_index),
        }
    )
    add_extras(content, update.extras)
    return content


def content_to_update(content: RecordDict) -> tuple[ClientUpdate, int]:
    """The `ClientUpdate` and client index a reply carries; `InvalidUpdateError`, naming everything a reply lacks,
    for one that is not an update: a FlowerTune-style ClientApp's reply ("arrays" and "metrics" with "num-examples"
    alone) is told to add the "client" record and R̄ (the values themselves are checked by `admission.UpdateGate`)."""
    missing = [name for name, records in ((ARRAYS, content.array_records), (METRICS, content.metric_records))
               if name not in records]
    metrics = content.metric_records.get(METRICS, {})
    missing += [f"{METRICS}[{key!r}]" for key in (NUM_EXAMPLES, REWARD) if key not in metrics]
    if CLIENT not in content.config_records:
        missing.append(f"a {CLIENT!r} ConfigRecord ('client-id', 'client-index')")
        raise InvalidUpdateError(
            f"The reply is no FederatedStrategy update: it lacks {', '.join(missing)}. A stock or FlowerTune-style "
            f"ClientApp replies with {ARRAYS!r} and {METRICS!r} only: add {METRICS}[{REWARD!r}] (R̄, the client's "
            f"mean reward over its last `reward_window` local steps) and the {CLIENT!r} record naming the client "
            "(`records.update_to_content` writes them all), or build the ClientApp with "
            "`trl_federated.flower.make_client_app`."
        )
    client_id, client_index = read_client_identity(content)
    if missing:
        raise InvalidUpdateError(f"Update of client {client_id!r} rejected: its reply lacks {', '.join(missing)}.")
    update = ClientUpdate(
        client_id=client_id,
        state=array_record_to_state(content[ARRAYS]),
        num_samples=metrics[NUM_EXAMPLES],
        reward=metrics[REWARD],
        metrics={key: value for key, value in metrics.items() if key not in (NUM_EXAMPLES, REWARD)},
        extras=read_extras(content),
    )
    return update, client_index


def evaluation_to_content(results: dict, client_id: str, client_index: int) -> RecordDict:
    """A client's evaluation of the global adapter on its own held-out data (`evaluation.evaluate_accuracy`'s
    "accuracy" and "count" per label) as the content of its reply to an evaluate message."""
    accuracy, count = results["accuracy"], results["count"]
    metrics = {NUM_EXAMPLES: count[TOTAL], ACCURACY: float(accuracy[TOTAL])}
    for label in accuracy:
        if label != TOTAL:
            metrics[LABEL_ACCURACY + label] = float(accuracy[label])
            metrics[LABEL_COUNT + label] = count[label]
    return RecordDict({METRICS: MetricRecord(metrics), CLIENT: client_identity_record(client_id, client_index)})


def content_to_evaluation(content: RecordDict) -> dict[str, dict[str, float | int]]:
    """The evaluation an evaluate reply carries, as `evaluation.evaluate_accuracy` gives it ("accuracy" and "count"
    per label, "Total" for all rows); `ValueError`, naming the fault, unless every accuracy is a finite number with
    a positive integer row count, at most `MAX_EVALUATION_LABELS` labels (no more than a MetricRecord of that many
    entries allocates), none of them counting more rows than the whole."""
    metrics = content.metric_records.get(METRICS)
    if metrics is None or NUM_EXAMPLES not in metrics or ACCURACY not in metrics:
        raise ValueError(f"the reply has no {METRICS!r} MetricRecord with {NUM_EXAMPLES!r} and {ACCURACY!r}")
    pairs = {TOTAL: (metrics[ACCURACY], metrics[NUM_EXAMPLES])}
    for key in metrics:
        if key.startswith(LABEL_ACCURACY):
            label = key.removeprefix(LABEL_ACCURACY)
            if label in pairs or len(label) > MAX_LABEL_LENGTH:
                raise ValueError(f"its label {bounded_text(repr(label), 100)} is {TOTAL!r} (all rows) or longer than "
                                 f"{MAX_LABEL_LENGTH} characters")
            pairs[label] = (metrics[key], metrics.get(LABEL_COUNT + label))
    if len(pairs) > MAX_EVALUATION_LABELS + 1:
        raise ValueError(f"the reply has {len(pairs) - 1} labels, more than {MAX_EVALUATION_LABELS}")
    for label, (accuracy, count) in pairs.items():
        if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy):
            raise ValueError(f"its accuracy of {label!r} is no finite number: {bounded_text(repr(accuracy), 40)}")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= pairs[TOTAL][1]:
            raise ValueError(f"its row count of {label!r} is no positive integer up to {NUM_EXAMPLES}: "
                             f"{bounded_text(repr(count), 40)}")
    return {
        "accuracy": {label: float(accuracy) for label, (accuracy, _) in pairs.items()},
        "count": {label: count for label, (_, count) in pairs.items()},
    }
