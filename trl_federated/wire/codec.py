"""What a wire codec is (`Codec`): how one precision encodes the entries of a client's update that travel, and how
the server decodes and validates them."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..adapters import AdapterState


class Codec(ABC):
    """One value of `FedGRPOConfig.transfer_dtype`: `encode` turns the entries a client sends into its payload,
    `decode` turns a payload back into those entries, and refuses (`ValueError`) one that no `encode` gives, which a
    client may send. `WireFormat` picks the entries that travel and checks the payload's keys (`payload_keys`)."""

    def payload_keys(self, key: str) -> tuple[str, ...]:
        """The payload's entries that carry the adapter's entry `key`."""
        return (key,)

    @abstractmethod
    def encode(self, sent: AdapterState, reference: AdapterState, residual: AdapterState | None) -> AdapterState:
        """The payload of the entries `sent` of a client whose round started from `reference`; `residual`: its
        error-feedback memory, for a codec that keeps one (see `WireFormat.encode`)."""

    @abstractmethod
    def decode(self, payload: AdapterState, sent_reference: AdapterState) -> AdapterState:
        """The entries of `sent_reference` as the client sent them; `ValueError` for a payload no `encode` gives."""


class ChangeCodec(Codec):
    """A codec that sends each entry's change θ_i − θ^{[t]}: rounding the change errs by a share of each coordinate's
    change, while rounding θ_i itself would err by that share of the weight, more than a round's change."""

    @staticmethod
    def changes(sent: AdapterState, reference: AdapterState) -> AdapterState:
        return {key: value.float() - reference[key].float() for key, value in sent.items()}

    @abstractmethod
    def decode_change(self, payload: AdapterState, key: str, reference: torch.Tensor) -> torch.Tensor:
        """The float32 change of entry `key` (shaped as `reference`); `ValueError` saying what is wrong with it."""

    def decode(self, payload, sent_reference):
        received = {}
        for key, value in sent_reference.items():
            try:
                change = self.decode_change(payload, key, value)
            except ValueError as error:
                raise ValueError(f"payload entry {key!r}: {error}") from None
            received[key] = (value.float() + change).to(value.dtype)
        return received
