"""Which data owner a SuperNode serves, decided by the server: a registry of the federation's clients by SuperNode
public key.

Flower authenticates every SuperNode by an EC key pair: each request is signed, and the SuperLink reports the
public key of every node (`Grid.get_nodes()`). With `--enable-supernode-auth` only keys the coordinator registered
(`flwr supernode register hospital-a.pub`) may connect at all; without it any node may connect, but none can use
another's key. A `ClientRegistry` names, for each client of the federation, the key its SuperNode holds, its index
(its seeds and its place in the aggregation) and optionally its number of training rows: the strategy then maps
nodes to clients from the keys alone, refuses every other node, and never asks a node who it is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization


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
            if client.num_samples is not None and (
                isinstance(client.num_samples, bool) or not isinstance(client.num_samples, int) or client.num_samples < 1
            ):
                raise ValueError(f"Client {client.client_id!r}: num-samples must be a positive integer.")
        self._by_key = {client.public_key: client for client in self.clients}

    @classmethod
    def from_file(cls, path: str | Path) -> ClientRegistry:
        """A registry from a JSON file, clients in index order:

            {"clients": [{"client-id": "hospital-a", "public-key": "keys/hospital-a.pub", "num-samples": 1200}, ...]}

        `public-key` is a key file (the `.pub` registered with the SuperLink; relative to the registry file) or the
        key itself; `num-samples` (optional) is the client's number of training rows, which then replaces its
        self-report in FedAvg's and SCAFFOLD's weights.
        """
        path = Path(path)
        entries = json.loads(path.read_text(encoding="utf-8"))["clients"]
        clients = []
        for index, entry in enumerate(entries):
            key = entry["public-key"]
            if not key.lstrip().startswith(("-----BEGIN", "ecdsa-", "ssh-")):  # a key file, not the key itself
                key_file = path.parent / key
                if not key_file.is_file():
                    raise FileNotFoundError(f"{path}: the public key file {key_file} of {entry['client-id']!r} is missing.")
                key = key_file.read_bytes()
            clients.append(RegisteredClient(str(entry["client-id"]), index, public_key_der(key), entry.get("num-samples")))
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
