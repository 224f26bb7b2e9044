"""The tensor layer: the federation's PEFT adapter and the arithmetic on its state, at the bottom of the package.

Wrapping a model in the adapter, moving its state in and out (only ever through PEFT's own
`get_peft_model_state_dict` / `set_peft_model_state_dict`) and writing it; `AdapterState` and the arithmetic on it
(sizes, norms, distances, finiteness, the key-and-shape check); and the wire (`WireFormat`: which adapter tensors a
client's update sends, in which precision). Everything above imports these from here: nothing low imports the
aggregation package."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import (
    LoraConfig,
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from safetensors.torch import save_file
from transformers import PreTrainedModel, set_seed

from .choices import LORA_AGGREGATIONS, TRANSFER_DTYPES, check_choice

logger = logging.getLogger(__name__)

AdapterState = dict[str, torch.Tensor]
"""An adapter's tensors, keyed as `peft.get_peft_model_state_dict` keys them (or a state shaped like one)."""


# PEFT's adapter folder layout (what `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` reads).
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


class InvalidUpdateError(ValueError):
    """A client's update that the server must not aggregate; the message names the client and the fault."""


def default_lora_config() -> LoraConfig:
    """LoRA on every linear projection of the decoder, as the paper does (it uses r=32, α=128 on 3B+ models)."""
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def with_federated_adapter(model: PreTrainedModel | PeftModel, seed: int, peft_config: PeftConfig | None = None):
    """`model` wrapped in the LoRA adapter the federation trains (`peft_config`, default `default_lora_config`);
    a `PeftModel` is returned as it is.

    LoRA draws its A matrices from the global RNG: it is seeded with `seed` first, as `Trainer` does before
    `model_init`, so that the initial global adapter, and with it the whole run, follows from the seed alone,
    in whichever process (runner, Flower ServerApp) builds it.
    """
    if isinstance(model, PeftModel):
        if peft_config is not None:
            raise ValueError("`model` is already a PeftModel: pass its adapter configuration, not `peft_config`.")
        return model
    set_seed(seed)
    return get_peft_model(model, peft_config or default_lora_config())


def get_adapter_state(model: PeftModel) -> AdapterState:
    """A detached CPU copy of the active adapter (PEFT strips the adapter name from the keys).

    PEFT hands back views of the live parameters; the copy is what lets the model go on training while the
    server holds one client's update.
    """
    return {key: value.detach().to("cpu", copy=True) for key, value in get_peft_model_state_dict(model).items()}


def set_adapter_state(model: PeftModel, state: AdapterState, adapter_name: str = "default") -> None:
    """Load `state` into the model's adapter `adapter_name`; a key the adapter lacks is an error, not a silent
    skip."""
    result = set_peft_model_state_dict(model, state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise KeyError(f"Adapter state has keys the model's adapter lacks: {sorted(result.unexpected_keys)[:5]}")


def save_adapter(model: PeftModel, state: AdapterState, path: str | Path) -> Path:
    """Load `state` into `model` and write it in the standard PEFT layout (`write_adapter`)."""
    set_adapter_state(model, state)
    return write_adapter(state, model.peft_config[model.active_adapter], path)


def write_adapter(state: AdapterState, adapter_config: PeftConfig, path: str | Path) -> Path:
    """Write `state` as a PEFT adapter folder (`adapter_model.safetensors`, `adapter_config.json`), its values as they
    are: `PeftModel.save_pretrained` would write the module's, which an engine such as DeepSpeed bf16 keeps rounded."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    save_file(tensors, path / ADAPTER_FILE, metadata={"format": "pt"})
    adapter_config.save_pretrained(str(path))
    return path


# State arithmetic: sizes, norms, distances, finiteness ----------------------------------------------------------


def state_nbytes(state: AdapterState) -> int:
    """Bytes of tensor data in `state`: what one transfer of it costs on the wire."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def check_state(
    state: Any, reference: dict[str, torch.Tensor], name: str, check_finite: bool = True, same_dtype: bool = False
) -> None:
    """Raise `ValueError` unless `state` has exactly `reference`'s keys and shapes and floating-point values (with
    `same_dtype`, `reference`'s dtypes), finite (unless `check_finite=False`)."""
    if not isinstance(state, dict) or set(state) != set(reference):
        keys = set(state) if isinstance(state, dict) else set()
        raise ValueError(f"{name} must have the global adapter's keys (missing {sorted(set(reference) - keys)[:3]}, "
                         f"unexpected {sorted(map(str, keys - set(reference)))[:3]}).")
    for key, expected in reference.items():
        tensor = state[key]
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.shape != expected.shape
            or not (tensor.dtype == expected.dtype if same_dtype else tensor.is_floating_point())
        ):
            described = (
                f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            dtype = expected.dtype if same_dtype else "floating point"
            raise ValueError(f"{name}[{key!r}] is {described}, expected {dtype} {tuple(expected.shape)}.")
        if check_finite and not is_finite(tensor):
            raise ValueError(f"{name}[{key!r}] holds NaN or Inf.")


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite, in one pass that allocates nothing: NaN propagates into the minimum
    and maximum, and ±Inf shows there (7x faster than `torch.isfinite(tensor).all()` on an adapter)."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    if tensor.is_complex():
        return bool(torch.isfinite(tensor).all())
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def non_finite_entries(tree: Any, name: str) -> list[str]:
    """The paths in `tree` (nested dicts of tensors and numbers) of the tensors and floats that are not finite."""
    if isinstance(tree, torch.Tensor):
        return [] if is_finite(tree) else [name]
    if isinstance(tree, float):
        return [] if math.isfinite(tree) else [name]
    if isinstance(tree, dict):
        return [path for key, value in tree.items() for path in non_finite_entries(value, f"{name}[{key!r}]")]
    return []


def state_distance(state: AdapterState, reference: AdapterState) -> float:
    """‖state − reference‖₂ over all entries (keys of `reference`)."""
    return math.sqrt(sum(tensor_norm(state[key].float() - value.float()) ** 2 for key, value in reference.items()))


def state_size(state: AdapterState) -> int:
    """d, the number of coordinates of `state`: the dimension that norm bounds and DP's noise scale with (√d)."""
    return sum(tensor.numel() for tensor in state.values())


def state_norm(state: AdapterState) -> float:
    """‖state‖₂ over all entries."""
    return math.sqrt(sum(tensor_norm(value.float()) ** 2 for value in state.values()))


def scaled_update(state: AdapterState, reference: AdapterState, scale: float) -> AdapterState:
    """The adapter θ + scale · (state − θ), θ = `reference`, in `reference`'s dtypes (computed in float64): a client's
    update scaled, as bounding or clipping its norm scales it."""
    return {
        key: (value.double() + scale * (state[key].double() - value.double())).to(value.dtype)
        for key, value in reference.items()
    }


def norm_scale(norm: float, bound: float, norm_action: str, measured: str, bound_name: str, client_id: str) -> float:
    """The factor that brings a client's `measured` quantity (its norm `norm`) within `bound`: 1 when it is within;
    over it, `ValueError` naming both with `norm_action="reject"`, else (`"clip"`) `bound / norm`, logged."""
    if norm <= bound:
        return 1.0
    if norm_action == "reject":
        raise ValueError(f"{measured} = {norm:.4g} exceeds {bound_name} ({bound:.4g})")
    logger.warning("Client %r: %s = %.4g clipped to %.4g.", client_id, measured, norm, bound)
    return bound / norm


def tensor_norm(tensor: torch.Tensor) -> float:
    """The 2-norm of a float32 tensor, recomputed in float64 where float32 overflows (finite values around 1e20
    and up, a poisoned update's): then it is its true, large value, never Inf."""
    norm = torch.linalg.vector_norm(tensor).item()
    return norm if math.isfinite(norm) else torch.linalg.vector_norm(tensor.double()).item()


# The wire: which adapter tensors a client sends, in which precision ---------------------------------------------
# The in-process runner passes every update through the same encode/decode a network would, so the server aggregates
# exactly what it would receive, and the bytes it reports are the bytes that would be sent.

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the precisions sent in a plain dtype
# Blockwise absmax quantization (`FedGRPOConfig.transfer_dtype` "int8", "nf4", "fp4"): each block of BLOCK_SIZE values
# is divided by its largest magnitude (one float32 scale per block) and each value sent as the index of the nearest of
# the format's levels in [-1, 1]. 64 is QLoRA's block: 4.5 bits a value in 4 bits, 8.5 in 8.
BLOCK_SIZE = 64
QUANTIZED_LEVELS = {
    # 255 evenly spaced levels, ±127/127 (absmax int8; index 255 is no level)
    "int8": torch.arange(-127, 128, dtype=torch.float32) / 127,
    # NormalFloat4, the quantiles of a standard normal (QLoRA, Dettmers et al. 2023; bitsandbytes' table)
    "nf4": torch.tensor([
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ]),
    # FP4 E2M1 (OCP Microscaling): ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} over 6; both zeros kept, so 16 codes
    "fp4": torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0, 0.5, 1, 1.5, 2, 3, 4, 6]) / 6,
}
SCALES = "#scales"  # a quantized entry travels as `key` (its codes) and `key + SCALES` (its blocks' scales)


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


@dataclass(frozen=True)
class WireFormat:
    """Encoding of a client → server update.

    Args:
        precision: `FedGRPOConfig.transfer_dtype`. "float32" sends the client's adapter θ_i as is (exact). Any other
            sends the change θ_i − θ^{[t]}: rounding the change errs by a share of each coordinate's change, while
            rounding θ_i itself would err by that share of the weight, more than a round's change. "bfloat16" rounds
            each coordinate (at most 2^-8 of it); "int8", "nf4" and "fp4" quantize it blockwise (`quantize`), with
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
        out, so that the rounding of one round is sent in the next instead of adding up over rounds (Seide et al.
        2014; Karimireddy et al. 2019). A client whose adapter did not move sends zeros and keeps its residual: the
        server then sees it for what it is, an idle client (`aggregation.base.is_idle`)."""
        sent = self.sent(state)
        if self.precision == "float32":
            return sent
        changes = {key: value.float() - reference[key].float() for key, value in sent.items()}
        if self.precision not in QUANTIZED_LEVELS:
            return {key: change.to(DTYPES[self.precision]) for key, change in changes.items()}
        if residual is not None and any(change.any() for change in changes.values()):
            changes = {key: change + residual[key] if key in residual else change for key, change in changes.items()}
        else:
            residual = None
        levels, payload = QUANTIZED_LEVELS[self.precision], {}
        for key, change in changes.items():
            payload[key], payload[key + SCALES] = quantize(change, levels)
            if residual is not None:
                residual[key] = change - dequantize(payload[key], payload[key + SCALES], levels, change.shape)
        return payload

    def decode(self, payload: AdapterState, reference: AdapterState) -> AdapterState:
        """The client's full adapter as the server sees it: `reference` where nothing was sent. A payload without
        exactly the entries that travel is a `ValueError`: a missing entry is never filled in from `reference`;
        so are quantized codes and scales that no encoding gives (`dequantize`), and a rounded change in any dtype but
        the wire's."""
        sent = self.sent(reference)
        levels = QUANTIZED_LEVELS.get(self.precision)
        expected = set(sent) if levels is None else {name for key in sent for name in (key, key + SCALES)}
        if set(payload) != expected:
            missing, extra = sorted(expected - set(payload)), sorted(set(payload) - expected)
            raise ValueError(f"payload keys differ from the adapter's (missing {missing[:3]}, unexpected {extra[:3]})")
        if self.precision == "float32":
            received = payload
        else:
            received = {}
            for key, value in sent.items():
                if levels is None:
                    if tuple(payload[key].shape) != tuple(value.shape):  # a smaller change would broadcast
                        raise ValueError(f"payload entry {key!r}: shape {tuple(payload[key].shape)}, expected "
                                         f"{tuple(value.shape)}")
                    # the wire's dtype only: `.float()` would read an int64 or complex payload as some change
                    if payload[key].dtype != DTYPES[self.precision]:
                        raise ValueError(f"payload entry {key!r}: dtype {payload[key].dtype}, expected "
                                         f"{DTYPES[self.precision]} (transfer_dtype={self.precision!r})")
                    change = payload[key].float()
                else:
                    try:
                        change = dequantize(payload[key], payload[key + SCALES], levels, value.shape)
                    except ValueError as error:
                        raise ValueError(f"payload entry {key!r}: {error}") from None
                received[key] = (value.float() + change).to(value.dtype)
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
