"""A plain dtype ('bfloat16'): the round's change, rounded to it (at most 2^-8 of each coordinate's change in
bfloat16, half the bytes of float32)."""

from __future__ import annotations

import torch

from .codec import ChangeCodec


class Cast(ChangeCodec):
    """Sends each entry's change in `dtype`."""

    def __init__(self, dtype: torch.dtype, name: str):
        self.dtype, self.name = dtype, name  # its value of `transfer_dtype`, for the messages

    def encode(self, sent, reference, residual):
        return {key: change.to(self.dtype) for key, change in self.changes(sent, reference).items()}

    def decode_change(self, payload, key, reference):
        if tuple(payload[key].shape) != tuple(reference.shape):  # a smaller change would broadcast
            raise ValueError(f"shape {tuple(payload[key].shape)}, expected {tuple(reference.shape)}")
        # the wire's dtype only: `.float()` would read an int64 or complex payload as some change
        if payload[key].dtype != self.dtype:
            raise ValueError(f"dtype {payload[key].dtype}, expected {self.dtype} (transfer_dtype={self.name!r})")
        return payload[key].float()
