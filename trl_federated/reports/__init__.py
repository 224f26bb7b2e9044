"""What a person reads: the round's log lines and the server-step advice (`round_log`), summary.md and the plots
(`summary`), the model card and the Hub (`hub`), and the comparison grid (`compare`). They hang on the server core's
events (`core.callbacks.RoundCallback`); the drivers attach them (`server_reports`)."""

from __future__ import annotations


def server_reports(output_dir, report_header: str | None = None, dataset_name: str | None = None) -> list:
    """The reports a driver attaches to its `FederatedServer`: the round's lines in the log (`RoundLog`) and the model
    card (`ModelCardReport`, naming `dataset_name`); with a `report_header` (may be empty) also summary.md and the
    plots, rewritten after every round (`ReportCallback`). A driver with a header has the server write result.json."""
    from .hub import ModelCardReport
    from .round_log import RoundLog
    from .summary import ReportCallback

    reports = [] if report_header is None else [ReportCallback(output_dir, header=report_header)]
    return [*reports, RoundLog(), ModelCardReport(dataset_name)]
