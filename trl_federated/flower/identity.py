"""Which data owner a SuperNode serves, decided by the server: a registry of the federation's clients by SuperNode
public key.

Flower authenticates every SuperNode by an EC key pair: each request is signed, and the SuperLink reports the
public key of every node (`Grid.get_nodes()`). With `--enable-supernode-auth` only keys the coordinator registered
(`flwr supernode register hospital-a.pub`) may connect at all; without it any node may connect, but none can use
another's key. A `ClientRegistry` names, for each client of the federation, the key its SuperNode holds, its index
(its seeds and its place in the aggregation) and optionally its number of training rows: the strategy then maps
nodes to clients from the keys alone, refuses every other node, and never asks a node who it is.

A `NodeBinder` keeps, for a run, which connected node serves which client: from the registry, or, without one, from
what each node says when first asked, trusted on first use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization

from ..core.admission import check_client_id

if TYPE_CHECKING:
    from flwr.serverapp import Grid

# A node's claim when asked which client it serves: (client id, client index), or why it made none.
Claim = tuple[str, int] | str


def public_key_der(key: bytes | str) -> bytes:
    """A public key in OpenSSH (`ssh-keygen`'s `.pub`) or PEM form, as DER SubjectPublicKeyInfo bytes: the form in
    which two encodings of one key compare equal."""
    data = key.encode() if isinstance(key, str) else bytes(key)
    try:
        loaded = serialization.load_pem_public_key(data)
    except ValueError:
        loaded = serialization.load_ssh_public_key(data.strip())
    return loaded.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class RegisteredClient:
    """One client of the federation as the coordinator registered it."""

    client_id: str
    index: int
    public_key: bytes  # DER SubjectPublicKeyInfo (`public_key_der`)
    num_samples: int | None = None
    eval_samples: int | None = None  # the rows of its own evaluation split (Flower's evaluate round)


class ClientRegistry:
    """The federation's clients, by the public key of the SuperNode each one runs.

    Args:
        clients: One `RegisteredClient` per client; indices 0 to N-1, ids and keys distinct.
    """

    def __init__(self, clients: Sequence[RegisteredClient]):
        self.clients = list(clients)
        if sorted(client.index for client in self.clients) != list(range(len(self.clients))):
            raise ValueError(f"Registered client indices must be 0 to {len(self.clients) - 1}, each once.")
        for attribute in ("client_id", "public_key"):
            values = [getattr(client, attribute) for client in self.clients]
            if len(set(values)) != len(values):
                raise ValueError(f"Two registered clients share a {attribute.replace('_', ' ')}.")
        for client in self.clients:
            check_client_id(client.client_id)
            for name in ("num_samples", "eval_samples"):
                value = getattr(client, name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"Client {client.client_id!r}: {name.replace('_', '-')} must be a positive "
                                     f"integer, got {value!r}.")
        self._by_key = {client.public_key: client for client in self.clients}

    @classmethod
    def from_file(cls, path: str | Path) -> ClientRegistry:
        """A registry from a JSON file, clients in index order:

            {"clients": [{"client-id": "hospital-a", "public-key": "keys/hospital-a.pub", "num-samples": 1200}, ...]}

        `public-key` is a key file (the `.pub` registered with the SuperLink; relative to the registry file) or the
        key itself; `num-samples` (optional) is the client's number of training rows, which then replaces its
        self-report in FedAvg's and SCAFFOLD's weights; `eval-samples` (optional) the rows of its own evaluation
        split, which then bounds its evaluation replies (`FederatedServer.record_client_evaluation`).
        """
        path = Path(path)
        entries = json.loads(path.read_text(encoding="utf-8"))["clients"]
        clients = []
        for index, entry in enumerate(entries):
            key = entry["public-key"]
            if not key.lstrip().startswith(("-----BEGIN", "ecdsa-", "ssh-")):  # a key file, not the key itself
                key_file = path.parent / key
                if not key_file.is_file():
                    raise FileNotFoundError(
                        f"{path}: the public key file {key_file} of {entry['client-id']!r} is missing."
                    )
                key = key_file.read_bytes()
            clients.append(
                RegisteredClient(str(entry["client-id"]), index, public_key_der(key), entry.get("num-samples"),
                                 entry.get("eval-samples"))
            )
        return cls(clients)

    def __len__(self) -> int:
        return len(self.clients)

    def client_of(self, public_key: bytes) -> RegisteredClient | None:
        """The client whose SuperNode holds `public_key` (as `NodeInfo.public_key` gives it), or None."""
        try:
            return self._by_key.get(public_key_der(public_key))
        except (ValueError, TypeError):  # no key, or not one
            return None

    def num_samples(self) -> dict[str, int]:
        """The registered sample counts, by client id."""
        return {client.client_id: client.num_samples for client in self.clients if client.num_samples is not None}

    def eval_samples(self) -> dict[str, int]:
        """The registered sizes of the clients' evaluation splits, by client id."""
        return {client.client_id: client.eval_samples for client in self.clients if client.eval_samples is not None}


class NodeBinder:
    """Which connected SuperNode serves which client of the federation, for a run: the server's call, made before any
    training message is sent. It reads the grid's nodes and their public keys, and never sends a message itself.

    With a `registry`, a node serves the client its public key is registered for, and every node whose key is not
    registered is refused. Without one, a node is asked once which client it serves (its SuperNode's
    `--node-config`) and trusted on first use: a claim outside the federation's `num_clients`, or of a client or
    index another connected node already serves, is refused (`_bind_claim`). Clients are known by their stable id,
    never by Flower's node id, which changes when a SuperNode restarts.

    Args:
        num_clients: The federation's number of clients N (indices 0 to N-1).
        registry: The federation's clients by SuperNode public key; without it, nodes declare their client.
    """

    def __init__(self, num_clients: int, registry: ClientRegistry | None = None):
        if registry is not None and len(registry) != num_clients:
            raise ValueError(f"The registry holds {len(registry)} clients, `num_clients` is {num_clients}.")
        self.num_clients = num_clients
        self.registry = registry
        self._clients: dict[int, tuple[str, int]] = {}  # Flower node id → (client id, client index)
        self._indices: dict[str, int] = {}  # client id → client index, as first bound to a node
        self._keys: dict[str, bytes] = {}  # client id → public key of the node first bound to it

    def bind(
        self, grid: Grid, node_ids: list[int], ask: Callable[[list[int]], Iterable[tuple[int, Claim]]]
    ) -> dict[int, str]:
        """Bind each of the connected `node_ids` to the client it serves, and return why each other one serves none
        (it is sent no training message), in the order of `node_ids`.

        With a registry, by the nodes' public keys alone. Without one, the nodes not bound yet (a new run, a restarted
        SuperNode) are asked: `ask(those node ids)` sends the question (the strategy's IDENTIFY query) and yields, per
        answer, the node and its `Claim`. A node's first answer stands; a node that does not answer is refused.
        """
        refused: dict[int, str] = {}
        if self.registry is not None:
            self._clients = {}
            for node in grid.get_nodes():
                if node.node_id not in node_ids:
                    continue
                registered = self.registry.client_of(node.public_key)
                if registered is None:
                    refused[node.node_id] = "its public key is not registered for this federation"
                else:
                    self._clients[node.node_id] = (registered.client_id, registered.index)
        else:
            unknown = [node_id for node_id in node_ids if node_id not in self._clients]
            if unknown:
                keys = {node.node_id: bytes(node.public_key) for node in grid.get_nodes()}
                for node_id, claim in ask(unknown):
                    if node_id in self._clients or node_id in refused:
                        continue  # answered twice: the first answer stands
                    if isinstance(claim, str):  # no claim, and why
                        refused[node_id] = claim
                    elif reason := self._bind_claim(node_id, *claim, keys.get(node_id, b""), node_ids):
                        refused[node_id] = reason
        return {
            node_id: refused.get(node_id, "did not identify its client")
            for node_id in node_ids if node_id not in self._clients
        }  # fmt: skip

    def client_of(self, node_id: int) -> tuple[str, int]:
        """(client id, client index) of a node `bind` bound."""
        return self._clients[node_id]

    def bound_client(self, node_id: int) -> tuple[str, int] | None:
        """(client id, client index) of a node `bind` bound, None for any other node."""
        return self._clients.get(node_id)

    def _bind_claim(
        self, node_id: int, client_id: str, client_index: int, key: bytes, connected: list[int]
    ) -> str | None:
        """Bind `node_id` (holding public key `key`) to (`client_id`, `client_index`), or return why it may not (trust
        on first use, without a registry): an index outside the federation, an id bound to another index (or an index
        to another id) earlier in the run, a client another connected node already serves (the first node keeps it: a
        newcomer cannot push it out), or a client first served by a node with another public key (a SuperNode
        restarted with its `--auth-supernode-private-key` keeps its key, and its client)."""
        if not 0 <= client_index < self.num_clients:
            return (f"claims client index {client_index}, outside the federation's [0, {self.num_clients}) "
                    "(set the SuperNode's partition-id)")
        known_index = self._indices.get(client_id)
        known_id = next((known for known, index in self._indices.items() if index == client_index), None)
        if known_index not in (None, client_index):
            return f"claims client {client_id!r} at index {client_index}; this run knows it at index {known_index}"
        if known_id not in (None, client_id):
            return f"claims index {client_index} for client {client_id!r}; this run knows {known_id!r} there"
        for other, (other_id, _) in self._clients.items():
            if other != node_id and other in connected and other_id == client_id:
                return f"claims client {client_id!r}, which connected node {other} already serves"
        if self._keys.setdefault(client_id, key) != key:
            return (f"claims client {client_id!r}, which a node with another public key served first in this run "
                    "(start SuperNodes with --auth-supernode-private-key, or give the strategy a registry)")
        # A node that served the client before and is gone (a restarted SuperNode) hands it over.
        for other in [other for other, (other_id, _) in self._clients.items() if other_id == client_id]:
            del self._clients[other]
        self._clients[node_id] = (client_id, client_index)
        self._indices[client_id] = client_index
        return None
