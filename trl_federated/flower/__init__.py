"""Flower deployment (`pip install trl-federated[flower]`): one data owner per SuperNode, the server on a SuperLink.

`make_client_app` runs the same local round as `FederatedRunner` (`client.train_local_round`) on a site's own
data; `FederatedStrategy` aggregates with the same `Aggregator`s and checkpoints like the runner; `records`
converts between `ClientUpdate`s and Flower records. See `examples/flower/` and the README section "Deploying
across organisations".
"""

from .apps import ClientSite, make_client_app, make_server_app, node_client_identity
from .identity import ClientRegistry, RegisteredClient
from .records import TrainInstruction, array_record_to_state, content_to_update, state_to_array_record, update_to_content
from .strategy import FederatedStrategy

__all__ = [
    "ClientRegistry",
    "ClientSite",
    "FederatedStrategy",
    "RegisteredClient",
    "TrainInstruction",
    "array_record_to_state",
    "content_to_update",
    "make_client_app",
    "make_server_app",
    "node_client_identity",
    "state_to_array_record",
    "update_to_content",
]
