"""Blockwise absmax quantization ('int8', 'nf4', 'fp4'): each block of `BLOCK_SIZE` values of the round's change is
divided by its largest magnitude (one float32 scale per block) and each value sent as the index of the nearest of the
format's levels in [-1, 1], with error feedback: what a round's rounding left out is added to the client's next change
(Seide et al. 2014; Karimireddy et al. 2019). A new grid is one `Blockwise(levels)` and one registration line
(`wire.register_wire_format`)."""

from __future__ import annotations

import math

import torch

from ..adapters import is_finite
from .codec import ChangeCodec

# 64 is QLoRA's block: 4.5 bits a value in 4 bits, 8.5 in 8.
BLOCK_SIZE = 64
SCALES = "#scales"  # a quantized entry travels as `key` (its codes) and `key + SCALES` (its blocks' scales)

# 255 evenly spaced levels, ±127/127 (absmax int8; index 255 is no level)
INT8_LEVELS = torch.arange(-127, 128, dtype=torch.float32) / 127
# NormalFloat4, the quantiles of a standard normal (QLoRA, Dettmers et al. 2023; bitsandbytes' table)
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])  # fmt: skip
# FP4 E2M1 (OCP Microscaling): ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} over 6; both zeros kept, so 16 codes
FP4_LEVELS = torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0, 0.5, 1, 1.5, 2, 3, 4, 6]) / 6


def quantize(values: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `values` flattened in blocks of `BLOCK_SIZE`: uint8 codes, one index into `levels` a
    byte, or two a byte (the first in the low nibble) with 16 levels; float32 scales, each its block's absmax."""
    flat, levels = values.detach().float().flatten(), levels.to(values.device)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK_SIZE)).view(-1, BLOCK_SIZE)
    scales = blocks.abs().amax(dim=1)
    normalized = blocks / torch.where(scales > 0, scales, 1).unsqueeze(1)
    # the nearest level: its index is the number of midpoints between levels below the value
    codes = torch.bucketize(normalized.flatten()[: flat.numel()], (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
    if len(levels) == 16:
        codes = torch.nn.functional.pad(codes, (0, codes.numel() % 2)).view(-1, 2)
        codes = codes[:, 0] | (codes[:, 1] << 4)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The float32 values of `shape` that `quantize` encoded as `codes` and `scales`; `ValueError` for codes and
    scales that no `quantize` of `shape` gives (dtype, length, a code past the levels, a negative or non-finite
    scale), which a client may send."""
    numel = math.prod(shape)
    lengths = {"codes": ((numel + 1) // 2 if len(levels) == 16 else numel, torch.uint8),
               "scales": (-(-numel // BLOCK_SIZE), torch.float32)}
    for name, tensor in (("codes", codes), ("scales", scales)):
        length, dtype = lengths[name]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != (length,):
            described = (
                f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            raise ValueError(f"its {name} are {described}, expected {dtype} ({length},)")
    if not is_finite(scales) or (scales < 0).any():
        raise ValueError("its scales hold a negative, NaN or Inf value")
    if len(levels) == 16:
        codes = torch.stack([codes & 15, codes >> 4], dim=1).flatten()[:numel]
    elif codes.max() >= len(levels):
        raise ValueError(f"its codes reach {codes.max().item()}, past the {len(levels)} levels")
    levels = levels.to(codes.device)
    return (levels[codes.long()] * scales.repeat_interleave(BLOCK_SIZE)[:numel]).view(shape)


class Blockwise(ChangeCodec):
    """Sends each entry's change quantized to `levels` (`quantize`), with error feedback in the client's residual."""

    def __init__(self, levels: torch.Tensor):
        self.levels = levels

    def payload_keys(self, key):
        return (key, key + SCALES)

    def encode(self, sent, reference, residual):
        """A client whose adapter did not move sends zeros and keeps its residual: the server then sees it for what it
        is, an idle client (`aggregation.update.is_idle`)."""
        changes = self.changes(sent, reference)
        if residual is not None and any(change.any() for change in changes.values()):
            changes = {key: change + residual[key] if key in residual else change for key, change in changes.items()}
        else:
            residual = None
        payload = {}
        for key, change in changes.items():
            payload[key], payload[key + SCALES] = quantize(change, self.levels)
            if residual is not None:
                residual[key] = change - dequantize(payload[key], payload[key + SCALES], self.levels, change.shape)
        return payload

    def decode_change(self, payload, key, reference):
        return dequantize(payload[key], payload[key + SCALES], self.levels, reference.shape)
