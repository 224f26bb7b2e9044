"""'float32': the client's adapter θ_i as it is, exact."""

from __future__ import annotations

from .codec import Codec


class Exact(Codec):
    """Sends the entries themselves; the payload is what the server aggregates."""

    def encode(self, sent, reference, residual):
        return sent

    def decode(self, payload, sent_reference):
        return payload
