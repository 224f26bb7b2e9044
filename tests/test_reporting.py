"""summary.md numbers rounds as the run's files do: "Round t" is the global adapter `round-<t>/` (0-based t)."""

import re

from trl_federated.core.round_record import RoundRecord
from trl_federated.reports.summary import write_summary


def test_summary_numbers_rounds_as_the_round_folders(tmp_path):
    history = [
        RoundRecord(round_idx=t, rewards={"a": 0.5, "b": 0.25}, weights={"a": 0.5, "b": 0.5},
                    bytes_sent={"a": 10, "b": 10}, bytes_received={"a": 10, "b": 10})
        for t in (0, 1)
    ]  # fmt: skip
    accuracy = {"accuracy": {"Total": 0.5}, "count": {"Total": 4}}
    summary = write_summary(tmp_path / "summary.md", history, {-1: accuracy, 0: accuracy, 1: accuracy}).read_text()
    assert re.findall(r"^\| (Before training|Round \d+) \|", summary, re.MULTILINE) == [
        "Before training", "Round 0", "Round 1"
    ]
    assert re.findall(r"^\| (\d+) \| - \| ([ab]) \|", summary, re.MULTILINE) == [
        ("0", "a"), ("0", "b"), ("1", "a"), ("1", "b")
    ]
    assert "`round-<t>/`" in summary  # the numbering is said where it is read


def test_log_lines_during_the_progress_bar_are_written_above_it_not_glued_onto_it():
    import logging
    import sys

    from tqdm.contrib.logging import _TqdmLoggingHandler

    from trl_federated.reports.summary import RunProgress

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)  # the console handler `logging.basicConfig` installs
    root.addHandler(console)
    try:
        with RunProgress(2, 2, 2, first_round=0, disable=True):
            assert any(isinstance(handler, _TqdmLoggingHandler) for handler in root.handlers)
            assert console not in root.handlers
        assert console in root.handlers
    finally:
        root.removeHandler(console)
