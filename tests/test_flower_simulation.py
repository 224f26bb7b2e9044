"""`flwr run examples/flower` (and on the app `trl-federated new-app` writes) on Flower's Simulation Engine, as
`docs/flower.md`'s quick-try runs it (a managed local SuperLink, which installs the app's dependencies per run as
Flower does by default), on the tiny model: the number of clients follows the simulated SuperNodes, run-config keys
override the app's values on the server and on every client, and a `num-clients` that differs from the federation is
refused before anything trains, in the `flwr run` output and its exit status (through
`trl_federated.flower.flwr_run`). With one CPU per client, two workers train a round's clients at the same time,
each loading the model once, and the federation ends where the sequential in-process runner ends (tests/flower_app,
whose reward gives the tiny model a gradient). Ctrl-C stops the run and leaves no process of it behind."""

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("flwr")

from flwr.clientapp import ClientApp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from test_flower import APP_DIR as LOOPBACK_APP_DIR  # noqa: E402
from test_flower import assert_states_equal, prompt_datasets, runner_result  # noqa: E402
from trl_federated import FedGRPOConfig  # noqa: E402
from trl_federated.arguments import BenchmarkArguments  # noqa: E402
from trl_federated.cli import main as cli_main  # noqa: E402
from trl_federated.data import partition_clients  # noqa: E402
from trl_federated.data.loading import load_benchmark  # noqa: E402
from trl_federated.flower import flwr_run as flwr_run_module  # noqa: E402
from trl_federated.flower import make_client_app  # noqa: E402

ROOT = Path(__file__).parents[1]
APP_DIR = ROOT / "examples" / "flower"
BENCHMARK_SIZE = 40
# The docs' recipe on a 2-core machine: 2 Ray workers (the CPUs Ray is given over the CPUs each client takes), so
# that 2 clients train at the same time; with Flower's default (2 CPUs a client), one worker trains them in turn.
TWO_WORKERS = "client-resources-num-cpus=1 init-args-num-cpus=2"


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def managed_superlinks(flwr_home: Path) -> list[int]:
    """The pids of the local SuperLinks `flwr run` started for `flwr_home` (their command line names its log)."""
    log_file = str(flwr_home / "local-superlink" / "superlink.log")
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and log_file.encode() in command:
            pids.append(int(entry.name))
    return pids


def quick_try_env(flwr_home: Path) -> dict[str, str]:
    """The environment of the docs' quick-try, with its own FLWR_HOME and ports."""
    bin_dir = Path(sys.executable).parent
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(flwr_home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    """`quick_try_env`; the SuperLink that `flwr run` starts (detached, as Flower does) is stopped afterwards, and so is
    every process its runs left (`processes_of`): Ray's dashboard and runtime-env agents leave the SuperLink's process
    group and outlived it by over a minute."""
    flwr_home = tmp_path_factory.mktemp("flwr-home")
    yield quick_try_env(flwr_home)
    for pid in managed_superlinks(flwr_home):
        os.killpg(pid, signal.SIGTERM)  # its own session: the SuperLink and the processes it started
    deadline = time.monotonic() + 10
    while managed_superlinks(flwr_home) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in managed_superlinks(flwr_home):
        os.killpg(pid, signal.SIGKILL)
    stop_processes_of(flwr_home)


def flwr_run(env, cwd, num_supernodes, run_config, resources="", app_dir=APP_DIR):
    """`flwr run <app_dir> --stream` with Flower's default local connection, `resources` added to its federation
    config, through `trl_federated.flower.flwr_run` (whose exit status is the run's); the finished process."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "trl_federated.flower.flwr_run", str(app_dir), "--stream",
         "--federation-config", f"num-supernodes={num_supernodes} {resources}", "--run-config", run_config],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=400,
    )
    print(f"flwr run with {num_supernodes} simulated SuperNodes ({resources or 'default resources'}): "
          f"{time.perf_counter() - started:.1f} s")
    return result


def tiny_run_config(model_dir, output_dir, **extra):
    values = {
        "model-name-or-path": f"'{model_dir}'", "output-dir": f"'{output_dir}'", "num-server-rounds": 1,
        "local-steps": 1, "reward-window": 1, "max-completion-length": 8, "per-device-train-batch-size": 4,
        "benchmark-size": BENCHMARK_SIZE, "dirichlet-alpha": "'inf'", "learning-rate": 0.001, **extra,
    }
    return " ".join(f"{key}={value}" for key, value in values.items())


def events(output_dir, name):
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == name]


def overlap(clients) -> bool:
    """Whether two of these client rounds (metrics.jsonl lines) ran at the same time."""
    spans = [line["metrics"]["wall_clock"] for line in clients]
    return any(a_start < b_end and b_start < a_end for (a_start, a_end), (b_start, b_end) in
               itertools.combinations(spans, 2))


def test_a_client_app_reaches_the_ray_actors():
    """The Simulation Engine's Ray backend sends the ClientApp to its actors by value (cloudpickle)."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    assert isinstance(cloudpickle.loads(cloudpickle.dumps(make_client_app(lambda context: None))), ClientApp)


@pytest.mark.slow  # about a minute on 2 CPU cores: the SuperLink, Ray, and one round of every simulated client
@pytest.mark.parametrize("num_supernodes, app", [(2, "new-app"), (4, "example")])
def test_simulation_has_one_client_per_simulated_supernode(flwr_env, tmp_path, tiny_model_dir, num_supernodes, app):
    """On 2 SuperNodes the app `trl-federated new-app` writes (the example's pyproject.toml in a folder of its own),
    on 4 examples/flower."""
    app_dir = APP_DIR
    if app == "new-app":
        app_dir = tmp_path / "my-app"
        assert cli_main(["new-app", str(app_dir)]) == 0
    output_dir = tmp_path / "outputs"
    result = flwr_run(flwr_env, tmp_path, num_supernodes, tiny_run_config(tiny_model_dir, output_dir), TWO_WORKERS,
                      app_dir=app_dir)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert (output_dir / "adapter_model.safetensors").exists()

    # num-server-rounds=1 overrides the app's 3; every client trained with learning-rate=0.001, not the app's 2e-4.
    assert [line["round_idx"] for line in events(output_dir, "round")] == [0]
    clients = events(output_dir, "client")
    assert [line["client_id"] for line in clients] == [f"client_{index}" for index in range(num_supernodes)]
    assert all(line["metrics"]["learning_rate"] == 0.001 and len(line["metrics"]["step_rewards"]) == 1
               for line in clients)
    # Each client trained on its share of the benchmark split for num_supernodes clients.
    args = FedGRPOConfig(output_dir=str(tmp_path / "unused"), use_cpu=True, bf16=False, num_clients=num_supernodes,
                         seed=0, dirichlet_alpha=float("inf"))
    train, _ = load_benchmark(BenchmarkArguments(benchmark_size=BENCHMARK_SIZE))
    assert [line["num_samples"] for line in clients] == [len(share) for share in partition_clients(train, args)]
    # Two workers: two clients trained at the same time, each worker on the model it loaded for its first client.
    assert overlap(clients)


@pytest.mark.slow  # about 40 s on 2 CPU cores
def test_parallel_clients_load_the_model_once_per_worker_and_end_where_the_runner_ends(
    flwr_env, tmp_path, tiny_model_dir
):
    """tests/flower_app on 2 simulated SuperNodes and 2 workers, 2 rounds of FGRPO: the clients of each round train
    at the same time, each worker loads the model once for the 4 client rounds, and the final global adapter is the
    sequential runner's, bit for bit, whichever worker trained which client in which round."""
    output_dir, loads_file = tmp_path / "flower", tmp_path / "model-loads.txt"
    for index, dataset in enumerate(prompt_datasets()):  # the runner's client datasets, one folder per SuperNode
        dataset.save_to_disk(tmp_path / "data" / f"client_{index}")
    run_config = (f"model-dir='{tiny_model_dir}' output-dir='{output_dir}' aggregation='rpg' num-rounds=2 "
                  f"data-root='{tmp_path / 'data'}' loads-file='{loads_file}'")
    result = flwr_run(flwr_env, tmp_path, 2, run_config, TWO_WORKERS, app_dir=LOOPBACK_APP_DIR)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]

    clients = events(output_dir, "client")
    assert [line["client_id"] for line in clients] == ["client_0", "client_1"] * 2
    assert overlap(clients[:2]) and overlap(clients[2:])
    workers = loads_file.read_text().split()
    assert len(workers) == len(set(workers)) == 2, f"model loads by process: {workers}"

    started = time.perf_counter()
    runner = runner_result(tiny_model_dir, tmp_path / "runner", "rpg")
    print(f"the sequential runner: {time.perf_counter() - started:.1f} s")
    flower_state = load_file(output_dir / "adapter_model.safetensors")
    assert_states_equal({key: flower_state[key] for key in runner.global_state}, runner.global_state)
    assert [line["weights"] for line in events(output_dir, "round")] == [record.weights for record in runner.history]


@pytest.mark.slow
def test_simulation_refuses_num_clients_other_than_its_supernodes(flwr_env, tmp_path, tiny_model_dir):
    output_dir = tmp_path / "outputs"
    result = flwr_run(flwr_env, tmp_path, 2, tiny_run_config(tiny_model_dir, output_dir, **{"num-clients": 3}))
    output = result.stdout + result.stderr
    assert "FederationSizeError: The federation has 2 SuperNodes" in output, output[-5000:]
    assert result.returncode == 1 and "is finished:failed" in result.stderr  # where `flwr run` itself exits 0
    assert "run-config key `num-clients` asks for 3 clients" in output
    assert not (output_dir / "metrics.jsonl").exists()


def flwr_home_of(process: psutil.Process) -> str | None:
    """The FLWR_HOME `process` inherited, read from /proc: psutil's `environ()` stops at the first empty entry, and
    Ray's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) rename themselves by writing NULs over its start."""
    entries = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
    return next((entry.decode()[len("FLWR_HOME="):] for entry in entries if entry.startswith(b"FLWR_HOME=")), None)


def processes_of(flwr_home: Path) -> list[psutil.Process]:
    """Every live process started for `flwr_home`: the local SuperLink and all that its runs started (SuperExec, the
    simulation, Ray's daemons, agents and workers), found by the FLWR_HOME they inherit or the Ray session of such a
    process that their command line names, since Ray's daemons leave the process tree."""
    def alive(process):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE

    processes = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.AccessDenied, psutil.NoSuchProcess, OSError):
            if alive(process):
                processes.append((process, flwr_home_of(process), " ".join(process.cmdline())))
    sessions = {session for _, home, command in processes if home == str(flwr_home)
                for session in re.findall(r"--session-dir=(\S+)", command)}
    return [process for process, home, command in processes
            if home == str(flwr_home) or any(session in command for session in sessions)]


def stop_processes_of(flwr_home: Path, grace: float = 10.0) -> None:
    """SIGTERM every process of `flwr_home` (`processes_of`), SIGKILL those alive after `grace` seconds, and fail
    naming any that is still there: nothing a test started outlives it."""
    processes = processes_of(flwr_home)
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace)
    left = command_lines(processes_of(flwr_home))
    assert not left, "left running:\n" + "\n".join(left)


def command_lines(processes) -> list[str]:
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return sorted(lines)


def is_local_superlink(command_line: str) -> bool:
    """The managed local SuperLink and the SuperExec it keeps, which `flwr run` leaves for later runs."""
    return any(part.endswith(("/flower-superlink", "/flower-superexec")) for part in command_line.split()[:2])


@pytest.mark.slow  # about a minute on 2 CPU cores: the SuperLink, Ray, and the first round's start
def test_ctrl_c_stops_the_run_and_leaves_no_process_of_it(tmp_path_factory, tmp_path, tiny_model_dir):
    """Ctrl-C on `python -m trl_federated.flower.flwr_run ... --stream` mid-round stops the run: the simulation,
    its Ray daemons and its ClientApp actors exit, and only the local SuperLink with its SuperExec stays, as Flower
    keeps it for later runs."""
    flwr_home = tmp_path_factory.mktemp("flwr-home-stopped")
    log_file = tmp_path / "flwr-run.log"
    run_config = tiny_run_config(tiny_model_dir, tmp_path / "outputs", **{"num-server-rounds": 100})
    try:
        with log_file.open("w") as log:
            wrapper = subprocess.Popen(
                [sys.executable, "-m", "trl_federated.flower.flwr_run", str(APP_DIR), "--stream",
                 "--federation-config", f"num-supernodes=2 {TWO_WORKERS}", "--run-config", run_config],
                env=quick_try_env(flwr_home), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal of its own, whose Ctrl-C reaches the whole process group
            )
        deadline = time.monotonic() + 300
        while not ("sent the global adapter" in log_file.read_text()
                   and any("ray::ClientAppActor" in line for line in command_lines(processes_of(flwr_home)))):
            assert wrapper.poll() is None and time.monotonic() < deadline, log_file.read_text()[-5000:]
            time.sleep(1)
        running = command_lines(processes_of(flwr_home))

        os.killpg(wrapper.pid, signal.SIGINT)  # Ctrl-C
        assert wrapper.wait(timeout=120) == 130, log_file.read_text()[-5000:]
        run_id = flwr_run_module.STARTED.search(log_file.read_text()).group(1)
        assert f"Interrupted: run {run_id} stopped." in log_file.read_text()
        # The simulation process ends once Flower's heartbeat tells it the run stopped, and Ray's processes with it:
        # its agents outlived it by a minute when its raylet died by SIGKILL (`apps.shut_ray_down`).
        deadline = time.monotonic() + 120
        while "flwr-simulation" in " ".join(left := command_lines(processes_of(flwr_home))):
            assert time.monotonic() < deadline, "left running:\n" + "\n".join(left)
            time.sleep(1)
        deadline = time.monotonic() + 15
        while not all(map(is_local_superlink, left := command_lines(processes_of(flwr_home)))):
            assert time.monotonic() < deadline, "left running after the simulation:\n" + "\n".join(left)
            time.sleep(1)
        print("running before Ctrl-C:\n" + "\n".join(running) + "\nafter:\n" + "\n".join(left))
        assert len(left) == 2 and len(running) > len(left)
    finally:
        stop_processes_of(flwr_home)
