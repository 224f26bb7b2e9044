"""The privacy ledger: the accountant's library (`load_dp_accounting`, Google's `dp-accounting`) and the JSON-lines
ledgers that every release (the server's, `client_level`) and every record-level account (a client's,
`local.record_privacy`) is appended to, flushed to disk, before what it releases leaves (`append_ledger_line`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def load_dp_accounting():
    """The `dp_accounting` modules the accountant needs; `ImportError` naming the extra that installs them."""
    try:
        from dp_accounting import dp_event, privacy_accountant, rdp
    except ImportError as error:
        raise ImportError(
            "Differential privacy (`dp_noise_multiplier`) accounts with Google's `dp-accounting`: "
            "pip install 'trl-federated[dp]'."
        ) from error
    return dp_event, privacy_accountant, rdp


def append_ledger_line(path: Path, entry: dict[str, Any]) -> None:
    """Append `entry` to the JSON-lines ledger at `path`, flushed to disk before it returns. A torn last line (a
    crash while appending: a release that never left) is cut off first, so that the new line does not join it into
    one that no reader parses, which would leave this release and every later one uncounted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as stream:
        stream.seek(0)
        content = stream.read()
        if content and not content.endswith(b"\n"):
            stream.truncate(content.rfind(b"\n") + 1)
        stream.write((json.dumps(entry, sort_keys=True) + "\n").encode("utf-8"))
        stream.flush()
        os.fsync(stream.fileno())
