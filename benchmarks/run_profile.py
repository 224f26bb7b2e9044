"""Peak resident memory and CPU seconds per phase of a whole `trl-federated run`: where the main job's peak is.

    python benchmarks/run_profile.py run --config examples/configs/quickstart.yaml [--key value ...]

It runs the CLI in this process with the runner's and trainer's methods wrapped from here (nothing in the package
changes): model load, evaluation, trainer construction, generation + scoring, loss forward, backward and the
server round; what runs outside them (setup, optimizer steps, checkpoints) is "outside phases". Each phase's peak
is the kernel's high-water mark (VmHWM), reset through /proc/self/clear_refs at every phase boundary, so it is the
phase's own and exact however brief (the step profile's `PhaseMeter` method, over the whole run). A phase nested in
another (evaluation inside the server round) counts for the inner one only. The table goes to stderr at the end
(also after Ctrl-C or `kill`, for the phases run so far). The resets also reset the process's maximum that `getrusage`
and `/usr/bin/time` report: under this script the table's largest peak is the run's, not theirs.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import defaultdict

from harness.timing import read_peak_rss_mib, reset_peak_rss


class NestedPhaseMeter:
    """Calls, peak RSS (MiB) and CPU seconds per phase over a whole run; phases may nest."""

    OUTSIDE = "outside phases"

    def __init__(self):
        self.table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.open: list[str] = []
        self.originals: list[tuple[object, str, object]] = []

    def _close_gap(self) -> None:
        # Attributes the peak since the last boundary to the phase that was running (or to "outside phases").
        row = self.table[self.open[-1] if self.open else self.OUTSIDE]
        row[1] = max(row[1], read_peak_rss_mib())
        reset_peak_rss()

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        self.originals.append((owner, attribute, original))

        def measured(*args, **kwargs):
            self._close_gap()
            self.open.append(name)
            cpu = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                row = self.table[name]
                row[0] += 1
                row[2] += time.process_time() - cpu
                self._close_gap()
                self.open.pop()

        setattr(owner, attribute, measured)

    def restore(self) -> None:
        for owner, attribute, original in reversed(self.originals):
            setattr(owner, attribute, original)

    def report(self) -> str:
        self._close_gap()
        lines = ["| phase | calls | peak RSS (MiB) | CPU s |", "|---|---:|---:|---:|"]
        for name, (calls, peak, cpu) in self.table.items():
            lines.append(f"| {name} | {calls or '-'} | {peak:.0f} | {f'{cpu:.1f}' if calls else '-'} |")
        peak = max(row[1] for row in self.table.values())
        lines.append(f"peak RSS over all phases: {peak:.0f} MiB")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> NestedPhaseMeter:
    from importlib.metadata import entry_points

    import accelerate
    from trl import GRPOTrainer

    import trl_federated.core.server
    import trl_federated.runtime.models

    # The command as a user runs it: the `trl-federated` console script (this checkout's, the harness put it first).
    (command,) = entry_points(group="console_scripts", name="trl-federated")
    run_command = command.load()

    meter = NestedPhaseMeter()
    # imported at call time by the CLI
    meter.wrap(trl_federated.runtime.models, "load_model_and_tokenizer", "model load")
    meter.wrap(trl_federated.core.server, "evaluate_adapter", "evaluation")
    meter.wrap(GRPOTrainer, "__init__", "trainer construction")
    meter.wrap(GRPOTrainer, "_generate_and_score_completions", "generation + scoring")
    meter.wrap(GRPOTrainer, "compute_loss", "loss forward")
    meter.wrap(accelerate.Accelerator, "backward", "backward")
    meter.wrap(trl_federated.core.server.FederatedServer, "end_round", "server round")
    reset_peak_rss()
    start = time.process_time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` also prints the phases run so far
    try:
        code = run_command(sys.argv[1:] if argv is None else argv)
    finally:
        meter.restore()
        print(meter.report(), f"\nwhole run: {time.process_time() - start:.0f} CPU s", file=sys.stderr)
    if code:
        raise SystemExit(code)
    return meter


if __name__ == "__main__":
    main()
