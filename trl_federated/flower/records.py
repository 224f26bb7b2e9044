"""What travels between the Flower `ServerApp` and `ClientApp`s, as Flower records.

Server → client (a train message):
    "arrays"          ArrayRecord   the global adapter θ^{[t]}, keyed as `get_peft_model_state_dict` keys it
    "config"          ConfigRecord  "round-idx" (0-based t) and "num-clients" (N), from which the client takes its
                                    seed, as the runner does
    "server-control"  ArrayRecord   SCAFFOLD only: c
    "client-control"  ArrayRecord   SCAFFOLD only: this client's c_i (the server keeps it, see `FederatedStrategy`)

Client → server (the reply):
    "arrays"          ArrayRecord   the client's adapter θ_i^{[t]}
    "metrics"         MetricRecord  "num-examples" (D_i), "reward" (R̄_i^{[t]}) and the update's other metrics
    "client"          ConfigRecord  "client-id" and "client-index", the stable identity of the data owner
    "control-delta"   ArrayRecord   SCAFFOLD only: Δc_i

Tensors go through NumPy's `.npy` format (Flower's `Array`), bit for bit; bfloat16, which NumPy lacks, travels as
its int16 bit pattern under the dtype name "bfloat16".
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..adapters import AdapterState, InvalidUpdateError
from ..aggregation import ClientUpdate

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
CLIENT = "client"
SERVER_CONTROL = "server-control"
CLIENT_CONTROL = "client-control"
CONTROL_DELTA = "control-delta"
# MetricRecord keys of the update itself; every other metric is the update's `metrics`.
NUM_EXAMPLES = "num-examples"  # Flower's usual name for the data volume
REWARD = "reward"


def state_to_array_record(state: AdapterState) -> ArrayRecord:
    """An adapter state (or a SCAFFOLD control variate) as an `ArrayRecord`, exactly."""
    return ArrayRecord({key: _tensor_to_array(tensor) for key, tensor in state.items()})


def array_record_to_state(record: ArrayRecord) -> AdapterState:
    """The tensors of an `ArrayRecord` written by `state_to_array_record`, with their dtypes."""
    return {key: _array_to_tensor(array) for key, array in record.items()}


def _tensor_to_array(tensor: torch.Tensor) -> Array:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype != torch.bfloat16:
        return Array(tensor.numpy())
    bits = Array(tensor.view(torch.int16).numpy())
    return Array(dtype="bfloat16", shape=bits.shape, stype=bits.stype, data=bits.data)


def _array_to_tensor(array: Array) -> torch.Tensor:
    values = np.load(BytesIO(array.data), allow_pickle=False)  # a writable array: torch may share its memory
    tensor = torch.from_numpy(values)
    return tensor.view(torch.bfloat16) if array.dtype == "bfloat16" else tensor


@dataclass
class TrainInstruction:
    """What the server asks of a client in one round (the content of a train message)."""

    global_state: AdapterState
    round_idx: int
    num_clients: int
    scaffold_controls: tuple[AdapterState, AdapterState] | None = None  # (c, c_i)

    def to_content(self) -> RecordDict:
        content = RecordDict(
            {
                ARRAYS: state_to_array_record(self.global_state),
                CONFIG: ConfigRecord({"round-idx": self.round_idx, "num-clients": self.num_clients}),
            }
        )
        if self.scaffold_controls is not None:
            server_control, client_control = self.scaffold_controls
            content[SERVER_CONTROL] = state_to_array_record(server_control)
            content[CLIENT_CONTROL] = state_to_array_record(client_control)
        return content

    @classmethod
    def from_content(cls, content: RecordDict) -> TrainInstruction:
        config = content[CONFIG]
        scaffold_controls = None
        if SERVER_CONTROL in content:
            scaffold_controls = (
                array_record_to_state(content[SERVER_CONTROL]),
                array_record_to_state(content[CLIENT_CONTROL]),
            )
        return cls(
            global_state=array_record_to_state(content[ARRAYS]),
            round_idx=int(config["round-idx"]),
            num_clients=int(config["num-clients"]),
            scaffold_controls=scaffold_controls,
        )


def client_identity_record(client_id: str, client_index: int) -> ConfigRecord:
    return ConfigRecord({"client-id": client_id, "client-index": client_index})


def read_client_identity(content: RecordDict) -> tuple[str, int]:
    """(client id, client index) from a reply; `InvalidUpdateError` if it names none."""
    record = content.config_records.get(CLIENT)
    if record is None or not isinstance(record.get("client-id"), str) or not isinstance(record.get("client-index"), int):
        raise InvalidUpdateError(f"The reply names no client: it needs a {CLIENT!r} ConfigRecord with 'client-id' "
                                 "(str) and 'client-index' (int).")
    return record["client-id"], record["client-index"]


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
    if update.control_delta is not None:
        content[CONTROL_DELTA] = state_to_array_record(update.control_delta)
    return content


def content_to_update(content: RecordDict) -> tuple[ClientUpdate, int]:
    """The `ClientUpdate` and client index a reply carries; `InvalidUpdateError`, naming what is missing, for a
    reply that is not one (the values themselves are checked by `adapters.validate_update`)."""
    client_id, client_index = read_client_identity(content)
    missing = [name for name, records in ((ARRAYS, content.array_records), (METRICS, content.metric_records))
               if name not in records]
    metrics = content.metric_records.get(METRICS, {})
    missing += [f"{METRICS}[{key!r}]" for key in (NUM_EXAMPLES, REWARD) if key not in metrics]
    if missing:
        raise InvalidUpdateError(f"Update of client {client_id!r} rejected: its reply lacks {', '.join(missing)}.")
    control_delta = content.array_records.get(CONTROL_DELTA)
    update = ClientUpdate(
        client_id=client_id,
        state=array_record_to_state(content[ARRAYS]),
        num_samples=metrics[NUM_EXAMPLES],
        reward=metrics[REWARD],
        metrics={key: value for key, value in metrics.items() if key not in (NUM_EXAMPLES, REWARD)},
        control_delta=None if control_delta is None else array_record_to_state(control_delta),
    )
    return update, client_index
