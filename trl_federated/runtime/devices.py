"""What the device a run computes on can do."""

from __future__ import annotations

import torch


def has_native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matrix products natively: a CPU with AVX512-BF16 or AMX tiles, a CUDA device
    that supports bf16. Elsewhere bf16 is emulated and slower than float32."""
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return False
