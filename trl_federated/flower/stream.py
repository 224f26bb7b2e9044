"""This package's log lines where Flower shows its own: `flwr run --stream`, a SuperLink's or SuperNode's log.

Flower mirrors a ServerApp's or ClientApp's stdout and stderr to the stream, and logs through a console handler
of its own on the `flwr` logger; the `trl_federated` loggers have no handler there, so without this only their
warnings reach stderr (Python's last-resort handler) and every INFO line (the strategy's summary, the wait for
SuperNodes, a resume, each round's R̄, h, ω and traffic, each client's local round) is lost.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "trl_federated"


def show_package_logs(level: int = logging.INFO) -> None:
    """Send the package's log records from `level` up to Flower's console handler, once, unless the application
    configured logging itself (a handler on the package's logger or on the root logger)."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if package.handlers or logging.getLogger().handlers:
        return
    from flwr.common.logger import console_handler

    package.addHandler(console_handler)
    package.setLevel(level)
