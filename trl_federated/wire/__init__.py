"""The wire: which adapter entries a client's update sends, in which precision (`WireFormat`), and the registry of
the precisions, `FedGRPOConfig.transfer_dtype` (`choices.TRANSFER_DTYPES`): each a codec in a file of its own (`Codec`:
its encoding, decoding and validation), one registration line each.

The in-process runner passes every update through the same encode/decode a network would, so the server aggregates
exactly what it would receive, and the bytes it reports are the bytes that would be sent."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters import AdapterState, is_lora_a
from ..choices import LORA_AGGREGATIONS, TRANSFER_DTYPES, check_choice
from .blockwise import FP4_LEVELS, INT8_LEVELS, NF4_LEVELS, Blockwise
from .cast import Cast
from .codec import ChangeCodec, Codec
from .exact import Exact


def register_wire_format(name: str, codec: Codec) -> None:
    """Make `name` a value of `FedGRPOConfig.transfer_dtype` (`choices.TRANSFER_DTYPES`), sent by `codec`. The command
    line offers it from then on."""
    if not isinstance(codec, Codec):
        raise TypeError(f"`codec` must be a Codec, got {codec!r}.")
    TRANSFER_DTYPES[name] = codec


register_wire_format("float32", Exact())
register_wire_format("bfloat16", Cast(torch.bfloat16, "bfloat16"))
register_wire_format("int8", Blockwise(INT8_LEVELS))
register_wire_format("nf4", Blockwise(NF4_LEVELS))
register_wire_format("fp4", Blockwise(FP4_LEVELS))


@dataclass(frozen=True)
class WireFormat:
    """Encoding of a client → server update.

    Args:
        precision: `FedGRPOConfig.transfer_dtype`, the codec (`choices.TRANSFER_DTYPES`). "float32" sends the client's
            adapter θ_i as is (exact). Any other sends the change θ_i − θ^{[t]} (`ChangeCodec`): "bfloat16" rounds
            each coordinate (at most 2^-8 of it); "int8", "nf4" and "fp4" quantize it blockwise (`blockwise`), with
            error feedback: what a round's rounding left out is added to the client's next change (`encode`).
        frozen_keys: Adapter entries the clients never change (LoRA A under `lora_aggregation="freeze_a"`). They
            are not sent: the server's copy is the clients' copy.
    """

    precision: str = "float32"
    frozen_keys: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, args, global_state: AdapterState) -> WireFormat:
        return cls.of(args.lora_aggregation, args.transfer_dtype, global_state)

    @classmethod
    def of(cls, lora_aggregation: str, transfer_dtype: str, global_state: AdapterState) -> WireFormat:
        """The wire format of `FedGRPOConfig.lora_aggregation` and `transfer_dtype` for an adapter shaped like
        `global_state`; `ValueError` for a choice it does not know."""
        check_choice("lora_aggregation", lora_aggregation, LORA_AGGREGATIONS)
        check_choice("transfer_dtype", transfer_dtype, TRANSFER_DTYPES)
        frozen = (
            frozenset(key for key in global_state if is_lora_a(key)) if lora_aggregation == "freeze_a" else frozenset()
        )
        return cls(precision=transfer_dtype, frozen_keys=frozen)

    @property
    def codec(self) -> Codec:
        return TRANSFER_DTYPES[self.precision]

    def sent(self, state: AdapterState) -> AdapterState:
        """The entries of `state` that travel (the server → client broadcast sends these in float32: it is the
        adapter itself, which no client could round against a copy of its own)."""
        return {key: value for key, value in state.items() if key not in self.frozen_keys}

    def encode(
        self, state: AdapterState, reference: AdapterState, residual: AdapterState | None = None
    ) -> AdapterState:
        """The payload of a client whose round started from `reference` and ended at `state`.

        `residual`: the client's error-feedback memory for a quantized precision, which this call updates: the
        change sent is the round's change plus the residual, and the residual becomes what its quantization left
        out, so that the rounding of one round is sent in the next instead of adding up over rounds."""
        return self.codec.encode(self.sent(state), reference, residual)

    def decode(self, payload: AdapterState, reference: AdapterState) -> AdapterState:
        """The client's full adapter as the server sees it: `reference` where nothing was sent. A payload without
        exactly the entries that travel is a `ValueError`: a missing entry is never filled in from `reference`;
        so is a payload that no encoding gives (the codec's `decode`: quantized codes and scales no `quantize` gives,
        a rounded change in any dtype but the wire's)."""
        sent = self.sent(reference)
        expected = {name for key in sent for name in self.codec.payload_keys(key)}
        if set(payload) != expected:
            missing, extra = sorted(expected - set(payload)), sorted(set(payload) - expected)
            raise ValueError(f"payload keys differ from the adapter's (missing {missing[:3]}, unexpected {extra[:3]})")
        received = self.codec.decode(payload, sent)
        return {key: received.get(key, value) for key, value in reference.items()}


__all__ = ["Blockwise", "Cast", "ChangeCodec", "Codec", "Exact", "WireFormat", "register_wire_format"]
