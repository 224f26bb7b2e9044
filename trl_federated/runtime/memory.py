"""Handing freed heap memory back to the operating system, after every local step, client round and evaluation."""

from __future__ import annotations

import ctypes
import ctypes.util

from transformers import TrainerCallback


def _load_malloc_trim():
    """glibc's `malloc_trim`, or None on another C library."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()


def release_free_memory() -> None:
    """Hand freed heap memory back to the operating system (glibc only); called after every local step, client round
    and evaluation.

    glibc keeps freed chunks below its mmap threshold in the process heap, so after a step's activations, a client's
    KV caches and optimizer state or an evaluation's caches are freed, the resident size stays at their high-water
    mark; trimming lets the next step, client, evaluation or server step start from what is really in use."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class ReleaseFreeMemory(TrainerCallback):
    """`release_free_memory()` after every local step: a step's generation and loss leave a heap fragmented around
    what they freed, and the next step's peak would stand on it."""

    def on_step_end(self, args, state, control, **kwargs):
        release_free_memory()
