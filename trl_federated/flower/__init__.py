"""Flower deployment (`pip install trl-federated[flower]`): one data owner per SuperNode, the server on a SuperLink.

`make_client_app` runs the same local round as `FederatedRunner` (`client.train_local_round`) on a site's own
data; `FederatedStrategy` aggregates with the same `Aggregator`s and checkpoints like the runner; `records`
converts between `ClientUpdate`s and Flower records; `run_config` reads a Flower run config as the arguments of
`trl-federated run`. See `examples/flower/` and `docs/flower.md`.
"""

from .apps import (
    ClientSite,
    load_once,
    make_client_app,
    make_server_app,
    node_client_identity,
    simulated_federation_size,
)
from .identity import ClientRegistry, RegisteredClient
from .records import (
    TrainInstruction,
    array_record_to_state,
    content_to_update,
    state_to_array_record,
    update_to_content,
)
from .run_config import FederationSizeError, federation_arguments
from .strategy import FederatedStrategy

__all__ = [
    "ClientRegistry",
    "ClientSite",
    "FederatedStrategy",
    "FederationSizeError",
    "RegisteredClient",
    "TrainInstruction",
    "array_record_to_state",
    "content_to_update",
    "federation_arguments",
    "load_once",
    "make_client_app",
    "make_server_app",
    "node_client_identity",
    "simulated_federation_size",
    "state_to_array_record",
    "update_to_content",
]
