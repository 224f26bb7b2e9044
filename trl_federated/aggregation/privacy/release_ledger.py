"""The DP release ledger (`dp-releases.jsonl`, `privacy.ClientLevelPrivacy.release_log`) as the server reads it back:
every release in its place or an error naming the file, and what a release the checkpoint cannot vouch for costs.

A run resumed from a checkpoint counts the releases the file holds, so a file that lost or changed lines would report
less ε, and give the next release an ordinal, and so noise, already used. The checkpoint carries the releases up to
itself, which the file must start with (`privacy.ClientLevelPrivacy.load_state_dict` checks it); a line that does not
read as the release of its place is a `DamagedLedgerError`, except a torn last line (a crash while appending: a
release that never left); and a release logged after the checkpoint is charged as `costlier_event`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# The noise multipliers of a round's release (`privacy.ClientLevelPrivacy.round_event`); Δ's is always there.
NOISE_MULTIPLIERS = ("noise_multiplier", "reward_noise_multiplier", "clipped_count_noise_multiplier")


class DamagedLedgerError(ValueError):
    """A DP release ledger that cannot be trusted to count every release: a damaged line that is not the last, or a
    start that differs from the releases of the checkpoint being resumed."""


def valid_event(event: Any) -> bool:
    """Whether `event` reads as a round's release: noise multipliers finite and > 0 (or None where the mechanism is
    absent; Δ's always present), a sample of 1 to N clients."""
    if not isinstance(event, dict):
        return False
    multipliers = [event.get(name) for name in NOISE_MULTIPLIERS]
    sizes = [event.get("sample_size"), event.get("num_clients")]
    return (multipliers[0] is not None
            and all(value is None or (type(value) in (int, float) and math.isfinite(value) and value > 0)
                    for value in multipliers)
            and all(type(value) is int for value in sizes) and 1 <= sizes[0] <= sizes[1])


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The events the ledger at `path` holds, in order; [] for no file. A torn last line is not counted; any other
    line that is not a release in its place (`{"release": i, "event": {...}}`, i its ordinal) is a
    `DamagedLedgerError` naming the file: reading on past it would count fewer releases than were made."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    torn_last = lines[-1] != b""  # a last line without its newline: the append never finished
    lines = lines if torn_last else lines[:-1]
    events = []
    for number, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line)
            valid = isinstance(entry, dict) and entry.get("release") == len(events) and valid_event(entry.get("event"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            valid = False
        if valid:
            events.append(entry["event"])
        elif not (torn_last and number == len(lines)):
            raise DamagedLedgerError(
                f"The DP release ledger {path} is damaged at line {number} (not release {len(events)} as written): "
                "the releases after it cannot be counted, nor their noise told apart. Restore the file from a copy; "
                "a run cannot resume on it."
            )
    return events


def add_run(runs: list[tuple[dict[str, Any], int]], event: dict[str, Any]) -> None:
    """Append `event` to a ledger kept as runs of identical events, [(event, count)]."""
    if runs and runs[-1][0] == event:
        runs[-1] = (event, runs[-1][1] + 1)
    else:
        runs.append((event, 1))


def costlier_event(logged: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """An event that costs at least what `logged` and `current` each do: the smaller of each noise multiplier (None, a
    mechanism the event lacks, counts as the other's), the larger sample of the smaller population. A release the
    ledger holds beyond the checkpoint is charged so, since nothing vouches for its logged σ."""
    event = dict(current)
    for name in NOISE_MULTIPLIERS:
        values = [value for value in (logged.get(name), current.get(name)) if isinstance(value, (int, float))]
        if values:
            event[name] = min(values)
    for name, pick in (("sample_size", max), ("num_clients", min)):
        values = [value for value in (logged.get(name), current.get(name)) if isinstance(value, int)]
        event[name] = pick(values) if values else current[name]
    event["sample_size"] = min(event["sample_size"], event["num_clients"])
    return event
