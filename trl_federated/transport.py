"""What a client's update costs on the wire, and how it gets there: which adapter tensors are sent, in which
precision. The in-process runner passes every update through the same encode/decode a network would, so the
server aggregates exactly what it would receive, and the bytes it reports are the bytes that would be sent."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapters import AdapterState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # `FedGRPOConfig.transfer_dtype`
LORA_AGGREGATIONS = ("separate", "freeze_a")  # `FedGRPOConfig.lora_aggregation`: "freeze_a" freezes and never sends A


@dataclass(frozen=True)
class WireFormat:
    """Encoding of a client → server update.

    Args:
        dtype: Precision on the wire. float32 sends the client's adapter θ_i as is (exact). A lower precision sends
            the change θ_i − θ^{[t]} instead: rounding the change errs by at most 2^-8 of each coordinate's change
            (bfloat16), while rounding θ_i itself would err by 2^-8 of the weight, more than a round's change.
        frozen_keys: Adapter entries the clients never change (LoRA A under `lora_aggregation="freeze_a"`). They
            are not sent: the server's copy is the clients' copy.
    """

    dtype: torch.dtype = torch.float32
    frozen_keys: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, args, global_state: AdapterState) -> WireFormat:
        return cls.of(args.lora_aggregation, args.transfer_dtype, global_state)

    @classmethod
    def of(cls, lora_aggregation: str, transfer_dtype: str, global_state: AdapterState) -> WireFormat:
        """The wire format of `FedGRPOConfig.lora_aggregation` and `transfer_dtype` for an adapter shaped like
        `global_state`; `ValueError` for a dtype it does not know."""
        if transfer_dtype not in DTYPES:
            raise ValueError(f"transfer_dtype must be one of {list(DTYPES)}, got {transfer_dtype!r}.")
        frozen = (
            frozenset(key for key in global_state if is_lora_a(key)) if lora_aggregation == "freeze_a" else frozenset()
        )
        return cls(dtype=DTYPES[transfer_dtype], frozen_keys=frozen)

    def sent(self, state: AdapterState) -> AdapterState:
        """The entries of `state` that travel (the server → client broadcast sends these in float32)."""
        return {key: value for key, value in state.items() if key not in self.frozen_keys}

    def encode(self, state: AdapterState, reference: AdapterState) -> AdapterState:
        """The payload of a client whose round started from `reference` and ended at `state`."""
        if self.dtype == torch.float32:
            return self.sent(state)
        return {key: (value.float() - reference[key].float()).to(self.dtype) for key, value in self.sent(state).items()}

    def decode(self, payload: AdapterState, reference: AdapterState) -> AdapterState:
        """The client's full adapter as the server sees it: `reference` where nothing was sent. A payload without
        exactly the entries that travel is a `ValueError`: a missing entry is never filled in from `reference`."""
        expected = set(self.sent(reference))
        if set(payload) != expected:
            missing, extra = sorted(expected - set(payload)), sorted(set(payload) - expected)
            raise ValueError(f"payload keys differ from the adapter's (missing {missing[:3]}, unexpected {extra[:3]})")
        if self.dtype == torch.float32:
            received = payload
        else:
            received = {
                key: (reference[key].float() + value.float()).to(reference[key].dtype) for key, value in payload.items()
            }
        return {key: received.get(key, value) for key, value in reference.items()}


def is_lora_a(key: str) -> bool:
    """Whether a PEFT state-dict key is a LoRA A factor (`...lora_A.weight`, `...lora_embedding_A`)."""
    return ".lora_A." in key or "lora_embedding_A" in key


def freeze_lora_a(model) -> None:
    """FFA-LoRA (`lora_aggregation="freeze_a"`): the A factors keep their seeded initialisation, the same on the
    server and every client; only B trains, and only B travels."""
    for name, param in model.named_parameters():
        if is_lora_a(name):
            param.requires_grad_(False)
