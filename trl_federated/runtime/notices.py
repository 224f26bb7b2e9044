"""Notices of the libraries underneath that a user of this package cannot act on, silenced when the package imports
(`silence_upstream_notices`), for the command line and a Python script alike. Each is matched by its own text, so that
every other warning of the same libraries still shows."""

from __future__ import annotations

import logging
import warnings

# transformers 5 renamed gradient checkpointing to activation checkpointing; TRL 1.16's own default
# (`gradient_checkpointing=True`) and its trainers' calls raise the rename notice on every config and trainer, where the
# user has set nothing to rename.
GRADIENT_CHECKPOINTING_RENAME = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"
# DeepSpeed (installed with the `deepspeed` extra, imported by accelerate and transformers) says on every run without a
# GPU that it found none; on a CPU run that is the configuration, not a fault.
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"


class _DropNotice(logging.Filter):
    """Drops the log records whose message starts with `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.text)


def silence_upstream_notices() -> None:
    """Silence `GRADIENT_CHECKPOINTING_RENAME` and `DEEPSPEED_CPU_NOTICE`; called as the package imports (DeepSpeed
    writes to its own logger, "DeepSpeed", which keeps the filter whenever DeepSpeed itself imports)."""
    warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_RENAME, category=FutureWarning)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(item, _DropNotice) for item in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DropNotice(DEEPSPEED_CPU_NOTICE))
