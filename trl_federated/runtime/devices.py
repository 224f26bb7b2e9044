"""What the device a run computes on can do."""

from __future__ import annotations

import torch


def has_native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matrix products natively: a CPU with AVX512-BF16 or AMX tiles whose oneDNN may
    use them (`ONEDNN_MAX_CPU_ISA=AVX2` makes such a CPU answer no, as an AVX2-only one does), a CUDA device that
    supports bf16. Elsewhere bf16 is emulated and slower than float32."""
    if device.type == "cpu":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return native and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return False
