"""What the README, the docs and the Makefile tell a newcomer holds: a README that is a front door (two set-up
commands, then the federated snippet), docs that build strictly with MkDocs, a configuration reference generated
from the code, an install that works off this project's machines, every command shown either run or checked, and no
reference a reader cannot open."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
GETTING_STARTED = (DOCS / "getting-started.md").read_text(encoding="utf-8")
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".toml", ".ipynb", ".txt"}


def reader_facing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
    for folder in ("docs", "examples"):
        files += [path for path in (ROOT / folder).rglob("*") if path.suffix in TEXT_SUFFIXES]
    return files


def test_no_reference_to_an_issue_number_a_reader_cannot_open():
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in reader_facing_files()
        for match in re.finditer(r"\bissues? #?\d+(\.\d+)?", path.read_text(encoding="utf-8"), re.IGNORECASE)
    ]
    assert not found


def test_the_first_screen_has_exactly_the_two_set_up_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL).group(1)
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]


def test_the_docs_install_from_a_clone_and_say_which_torch_build_pip_takes():
    for page in (README, *(path.read_text(encoding="utf-8") for path in PAGES)):
        assert 'pip install "trl-federated' not in page  # the package is not on PyPI
    assert 'pip install -e ".[deepspeed,flower,dp]"' in GETTING_STARTED and ".[deepspeed,vllm,dp]" in GETTING_STARTED
    assert "make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu" in GETTING_STARTED
    assert "the CUDA one, several GB" in " ".join(GETTING_STARTED.split())
    assert "docs/getting-started.md" in README


@pytest.mark.slow  # pip resolves ~230 packages against PyPI: 523 s on one shared core (2026-11-27); needs the network
def test_the_vllm_extra_resolves_with_the_package_to_its_one_vllm_release(tmp_path):
    """`pip install ".[vllm]"` resolves: a dry run of the package's requirements and its `vllm` extra, against PyPI
    alone (`--isolated`: no machine-wide constraints or local indexes), picks a vLLM inside the extra's range. TRL's
    own range (0.22 to 0.31) holds releases that cannot install beside the package's transformers; a new release
    in the extra's range that cannot fails here."""
    import ast
    import socket

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError:
        pytest.skip("PyPI is not reachable")
    values = setup_assignments()
    extras = values["EXTRAS"]
    vllm_extra = next(ast.literal_eval(value) for key, value in zip(extras.keys, extras.values)
                      if ast.literal_eval(key) == "vllm")
    requirements = [*ast.literal_eval(values["INSTALL_REQUIRES"]), *vllm_extra]
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                    "--quiet", "--report", str(report), *requirements], check=True, timeout=1800)
    installed = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                 for item in json.loads(report.read_text(encoding="utf-8"))["install"]}
    (vllm_range,) = [Requirement(text) for text in vllm_extra if Requirement(text).name == "vllm"]
    assert vllm_range.specifier.contains(installed["vllm"]), (vllm_range, installed["vllm"])
    for text in requirements:
        requirement = Requirement(text)
        assert requirement.specifier.contains(installed[canonicalize_name(requirement.name)], prereleases=True), text


def test_install_steps_are_stated_once():
    """The pip install from a clone is on one page; every other page links to it."""
    pages = [path.name for path in PAGES if "pip install \"torch==" in path.read_text(encoding="utf-8")]
    assert pages == ["getting-started.md"] and 'pip install "torch==' not in README


def make_dry_run(*variables: str, target: str = "install") -> list[str]:
    """The pip commands `make TARGET` would run in a fresh venv (`make -n`: nothing runs)."""
    result = subprocess.run(["make", "-n", "-B", target, "VENV=/nonexistent/venv", "PYTHON=python3", *variables],
                            cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in result.stdout.splitlines() if "pip install" in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_takes_torch_from_pips_index_unless_told_another():
    default, package, extras = make_dry_run()
    assert default.endswith('pip install --quiet  "torch==2.13.0"') and "--index-url" not in default  # CI: PyPI only
    assert package.endswith("pip install --quiet -c constraints.txt -e .")
    assert extras.endswith('pip install --quiet -c constraints.txt -e ".[test,flower,deepspeed]"')
    # the demo installs the package alone: no test, Flower or DeepSpeed extras for a CPU run
    assert [line for line in make_dry_run(target="demo") if "pip install" in line][-1].endswith("-e .")
    cpu = make_dry_run("TORCH_INDEX=https://download.pytorch.org/whl/cpu")[0]
    assert cpu.endswith('--index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"')
    assert make_dry_run("TORCH=torch==2.14.0")[0].endswith('"torch==2.14.0"')


# The README is a front door: what it is, the two commands, the federated snippet right after them, the CLI, the
# methods with the current verdict, links. Everything else is a page of docs/.

README_MAX_LINES = 250
FIRST_SCREEN_LINES = 40


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line of the opening fence) of every fenced code block."""
    fences = re.finditer(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", text, re.DOTALL | re.MULTILINE)
    return [(match["lang"], match["body"], text.count("\n", 0, match.start()) + 1) for match in fences]


def test_the_readme_is_a_front_door():
    assert len(README.splitlines()) <= README_MAX_LINES
    blocks = fenced_blocks(README)
    (bash, _, _), (python, snippet, line) = blocks[:2]
    assert (bash, python) == ("bash", "python")  # the two commands, then the snippet a TRL user needs first
    assert line + len(snippet.splitlines()) <= FIRST_SCREEN_LINES
    assert "from trl_federated import FedGRPOConfig, FedGRPOTrainer" in snippet and "trainer.train()" in snippet
    # the snippet is the one the page on federating a TRL script explains, word for word
    assert snippet in (DOCS / "federate-trl.md").read_text(encoding="utf-8")


def test_the_readmes_snippet_runs_as_written_and_quietly(tmp_path, tiny_model_dir):
    """The README's Python block, as its text stands, in a fresh interpreter: the embedded model by name (here the tiny
    model in its place, through the documented cache folder `$TRL_FEDERATED_CACHE`), a plain prompt/solution dataset,
    TRL's reward; it leaves the global adapter, and no notice the reader cannot act on (transformers' rename of
    gradient checkpointing, DeepSpeed's "Setting accelerator to CPU") reaches them."""
    from trl_federated.runtime.models import _CACHED_MODEL_DIRNAME

    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / _CACHED_MODEL_DIRNAME)  # where `ensure_default_model` finds it built
    (_, snippet, _) = fenced_blocks(README)[1]
    env = {**os.environ, "TRL_FEDERATED_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)  # a few minutes quiet, several beside other jobs
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "fgrpo" / "adapter_model.safetensors").is_file()
    assert sorted(path.name for path in (tmp_path / "fgrpo").glob("round-*")) == ["round-0", "round-1"]
    assert "split uniformly across the 3 clients" in result.stderr
    assert "Warning" not in result.stderr and "Setting accelerator" not in result.stderr, result.stderr[-3000:]


def test_the_readme_states_the_verdict_and_links_every_page():
    text = " ".join(README.split())
    # the README reads as the committed report does: its FGRPO and FedAvg gains and their paired difference
    report = json.loads((ROOT / "benchmarks" / "results" / "grid" / "verdict.json").read_text(encoding="utf-8"))
    gains = {row["method"]: row["total_gain"]["mean"] for row in report["methods"]}
    assert "the paper's literal server step, Adam with ε = 1e-8, learned less than FedAvg" in text
    assert f"paper's step {gains['fgrpo-paper']:+.2f}" in text and f"FedAvg {gains['fedavg']:+.2f}" in text
    assert f"FGRPO {gains['fgrpo']:+.2f}" in text
    assert re.search(r"\d+ of \d+ cells", report["status"]).group(0) in text
    # FGRPO − FedAvg seed by seed, with its interval, as the report gives it
    paired = next(row["total"] for row in report["paired"] if row["baseline"] == "fedavg")
    figure = f"FGRPO − FedAvg {paired['mean']:+.2f} points [{paired['low']:+.2f}, {paired['high']:+.2f}] seed by seed"
    assert figure.replace("-", "−") in text  # the report writes ASCII minus signs, the README U+2212
    # the verdict page's status says the same
    verdict_page = " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())
    cells = re.search(r"(\d+) of (\d+) cells", report["status"])
    assert f"{cells.group(1)} of the grid's {cells.group(2)} cells" in verdict_page
    assert f"Reading at {cells.group(0)}" in verdict_page
    assert figure.replace("-", "−") in verdict_page
    # the benchmarks page's grid row says the report's status
    (row,) = [line for line in (DOCS / "benchmarks.md").read_text(encoding="utf-8").splitlines()
              if line.startswith("| grid: FGRPO, FedAvg")]
    assert f"| {report['status']} (" in row, row
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README))
    assert linked == {path.name for path in PAGES} | {"config-reference.md"}


def test_the_readme_and_the_verdict_state_the_premise_grids_result():
    """Both pages read as benchmarks/results/grid-premise/premise.json does: the gate's mean predictiveness of each RPG
    variant, and FGRPO − FedAvg with its interval; a failed gate is said as such."""
    report = json.loads((ROOT / "benchmarks" / "results" / "grid-premise" / "premise.json").read_text(encoding="utf-8"))
    paired = report["comparisons"]["fgrpo"]["endpoints"]["Total"]
    figure = f"FGRPO − FedAvg {paired['mean']:+.2f} [{paired['low']:+.2f}, {paired['high']:+.2f}]".replace("-", "−")
    failed = not any(gate["value"] > 0 for gate in report["gate"].values())
    for text in (" ".join(README.split()), " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())):
        for method in ("fgrpo", "fgrpo-noise-aware"):
            assert f"{report['gate'][method]['value']:+.3f}".replace("-", "−") in text, method
        assert figure in text
        assert ("gate failed" in text) == failed and ("No RPG beats FedAvg" in text) == failed
    # the null-calibrated reading: the paper's gain's z over the pilot's cells, as premise.json gives it
    zs = [cell["shadow_paper_z"] for cell in report["cells"].values()]
    for text in (" ".join(README.split()), " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())):
        assert f"{max(zs):+.2f}" in text and f"{min(zs):+.2f}".replace("-", "−") in text


def test_the_readme_and_the_verdict_state_the_balanced_pilots_result():
    """Both pages read as benchmarks/results/grid-balanced/pilot.json does: its gate's outcome, each cell's total, the
    base model's and the reference policy's."""
    report = json.loads((ROOT / "benchmarks" / "results" / "grid-balanced" / "pilot.json").read_text(encoding="utf-8"))
    totals = [cell["total"] for cell in report["cells"].values()]
    reference = report["references"]["Total"]
    for text in (" ".join(README.split()), " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())):
        assert f"{reference['base']:.2f}%" in text and f"{reference['reference']:.2f}%" in text
        assert all(f"{total['final']:.2f}%" in text for total in totals)
        assert ("pilot passed" in text) == (report["status"] == "PASS")


def test_the_readme_and_the_verdict_state_the_balanced_grids_reading():
    """Both pages read as benchmarks/results/grid-balanced/balanced.json does: its cells, each method's total gain,
    FGRPO − FedAvg with its interval, whether every cell beats the reference policy, the largest |z|, and whether
    any secondary endpoint survives Holm's correction."""
    grid = ROOT / "benchmarks" / "results" / "grid-balanced"
    report = json.loads((grid / "balanced.json").read_text(encoding="utf-8"))
    cells = re.search(r"\d+ of \d+ cells", report["status"]).group(0)
    paired = report["comparisons"]["fgrpo"]["endpoints"]["Total"]
    figure = f"FGRPO − FedAvg {paired['mean']:+.2f} [{paired['low']:+.2f}, {paired['high']:+.2f}]".replace("-", "−")
    gains = {method: report["gains"][method]["Total"]["mean"] for method in ("fgrpo", "fedavg")}
    gains = f"FGRPO {gains['fgrpo']:+.2f} and FedAvg {gains['fedavg']:+.2f}"
    above = all(cell["Total"] > report["references"]["Total"]["reference"] for cell in report["cells"].values())
    largest = max(abs(cell["z"]) for cell in report["cells"].values())
    for text in (" ".join(README.split()), " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())):
        assert cells in text and figure in text and gains in text
        said = "Every cell is above the reference policy" in text or "every cell above the reference policy" in text
        assert said == above
        assert f"|z| ≤ {largest:.2f}" in text
        none_differs = all(row["p_holm"] > 0.05 for name, row in report["comparisons"]["fgrpo"]["endpoints"].items()
                           if name != "Total")  # fmt: skip
        assert ("no secondary endpoint differs after holm's correction" in text.lower()) == none_differs
    (row,) = [line for line in (DOCS / "benchmarks.md").read_text(encoding="utf-8").splitlines()
              if line.startswith("| balanced grid:")]
    assert f"| {report['status']} (" in row, row


def test_the_pages_state_the_balanced_premise_pilots_gate_as_its_report_does():
    """benchmarks/results/grid-premise-balanced/premise-balanced.json's status heads the benchmarks page's row; once the
    gate is decided, README and the verdict say whether the pilot passed, with each RPG variant's mean z and its mean
    accuracy difference from FedAvg."""
    report = json.loads((ROOT / "benchmarks" / "results" / "grid-premise-balanced" / "premise-balanced.json")
                        .read_text(encoding="utf-8"))  # fmt: skip
    (row,) = [line for line in (DOCS / "benchmarks.md").read_text(encoding="utf-8").splitlines()
              if line.startswith("| premise pilot on the balanced benchmark:")]
    assert f"| {report['status']}" in row, row
    if report["status"] == "PENDING":
        return
    for text in (" ".join(README.split()), " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())):
        assert f"balanced premise pilot {'passed' if report['status'] == 'PASS' else 'failed'}" in text
        assert all(f"{gate['mean_z']:+.2f}".replace("-", "−") in text for gate in report["gate"].values())
        # the accuracy difference from FedAvg, paired by seed, as the report gives it
        assert all(f"{paired['mean']:+.2f}".replace("-", "−") in text for paired in report["paired"].values())


def test_the_verdict_says_no_cell_of_the_first_grid_beats_what_no_information_scores():
    """docs/verdict.md's reading of the first benchmark, as benchmarks/results/grid/verdict.json's references and
    per-cell totals give it."""
    report = json.loads((ROOT / "benchmarks" / "results" / "grid" / "verdict.json").read_text(encoding="utf-8"))
    reference = report["references"]["Total"]["reference"]
    text = " ".join((DOCS / "verdict.md").read_text(encoding="utf-8").split())
    finals = [float(line.split(": ")[1].split(" ")[0]) for line in
              (ROOT / "benchmarks" / "results" / "grid" / "verdict.md").read_text(encoding="utf-8").splitlines()
              if line.startswith("- ") and "beat it" in line]  # fmt: skip
    assert len(finals) == 22 and max(finals) < reference
    assert f"scores {reference:.2f}% on the verdict grid's test split" in text
    assert f"none of its {len(finals)} cells beats it** ({min(finals):.2f}-{max(finals):.2f}%" in text


# The site: MkDocs, strict, with the configuration reference generated on every build.


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="MkDocs or mkdocstrings is not installed: pip install -e '.[docs]'")  # fmt: skip
def test_the_docs_build_strictly(tmp_path):
    """`mkdocs build --strict`: every page in the nav, every link and anchor resolves (README.md is the home page)."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "config-reference" / "index.html").exists()
    assert "FedGRPOConfig" in (tmp_path / "site" / "index.html").read_text(encoding="utf-8")


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_generated_from_the_docstring_never_written_twice():
    import dataclasses

    from trl_federated.arguments import BenchmarkArguments
    from trl_federated.config import FedDAPOConfig, FedGRPOConfig, FedGSPOConfig

    generator = load_generator()
    # committed, so that the links to it read on GitHub, and current
    assert (DOCS / generator.PAGE).read_text(encoding="utf-8") == generator.render(), (
        "docs/config-reference.md is not what the code documents: python docs/gen_config_reference.py > "
        "docs/config-reference.md"
    )
    for cls in (FedGRPOConfig, FedDAPOConfig, FedGSPOConfig):
        assert generator.check_documented(cls) == []
    page = generator.render()
    for name in generator.declared_fields(FedGRPOConfig):
        assert f"**`{name}`**" in page, name
    for item in dataclasses.fields(BenchmarkArguments):
        assert f"**`{item.name}`**" in page, item.name
    # one entry's text, as the docstring states it
    (_, entries), *_ = generator.parameters(FedGRPOConfig)
    name, _, description = entries[0]
    assert f"**`{name}`**" in page and description in page


def test_the_generator_refuses_an_undocumented_field():
    from dataclasses import dataclass, field

    from trl_federated.config import FedGRPOConfig

    @dataclass
    class Undocumented(FedGRPOConfig):
        """Parameters:
        > A section

        num_rounds (`int`):
            Rounds.
        """

        extra_knob: int = field(default=1, metadata={"help": "not in the docstring"})

    problems = load_generator().check_documented(Undocumented)
    assert problems == ["Undocumented.extra_knob: declared but not in `Parameters:`"]


# Every command the README and the docs show is run by a test or checked here: its program, its files, and its flags
# against the parser that will read them.

INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
COMMAND_PREFIXES = (
    "trl-federated ", "python ", "flwr ", "make ", "accelerate launch ", "pip install ", "flower-superlink ",
    "flower-supernode ", "OMP_NUM_THREADS=", "FLWR_", "CUDA_VISIBLE_DEVICES=", "bash ", "mkdocs ", "/usr/bin/time ",
)  # fmt: skip
# Programs the docs show whose flags are their own projects' (documented there), with what is checked of them here.
EXTERNAL = {
    "git": "git clone", "cd": "shell", "source": "shell", "mkdir": "shell", "kill": "shell",
    "openssl": "the CA and certificate recipe of Flower's TLS guide", "ssh-keygen": "Flower's SuperNode keys",
    "trl": "TRL's `trl vllm-serve` (needs vLLM, a GPU install)",
}  # fmt: skip
# Placeholders a reader replaces: a config of their own, a script of their own.
PLACEHOLDERS = {"CONFIG.yaml": "examples/configs/quickstart.yaml", "my_grpo_script.py": None}
# The folders the docs make with `trl-federated new-app`, which writes the example app's pyproject.toml into them.
NEW_APPS = {"my-fgrpo-app": "examples/flower"}
# Flower's Simulation Engine options (`--federation-config`), as Flower documents them.
FLOWER_FEDERATION_KEYS = {"num-supernodes", "client-resources-num-cpus", "client-resources-num-gpus",
                          "init-args-num-cpus", "init-args-num-gpus"}  # fmt: skip
# On this CPU-only test machine TrainingArguments refuses bf16 unless told to use the CPU (as tests/test_recipes.py).
CPU = ["--use_cpu", "true", "--bf16", "false"]


def doc_texts() -> dict[str, str]:
    return {"README.md": README, **{f"docs/{path.name}": path.read_text(encoding="utf-8") for path in PAGES}}


def shown_commands(text: str) -> list[str]:
    """The shell commands of `text`: each line of a bash block (continuations joined, comments dropped), and each
    inline code span that starts like a command."""
    commands = []
    for lang, body, _ in fenced_blocks(text):
        if lang in ("bash", "sh", "shell"):
            for line in re.sub(r"\\\n\s*", " ", body).splitlines():
                line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
                commands += [line] if line else []
    prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    for span in INLINE.findall(prose):
        span = " ".join(span.split())
        if span.startswith(COMMAND_PREFIXES):
            commands.append(span)
    return commands


def simple_commands(command: str) -> list[list[str]]:
    """`command` split on `&&` and `;` into argument lists, without environment assignments, `nohup`, `time`,
    redirections, `&` and the brackets around optional flags."""
    result = []
    for part in re.split(r"&&|;", command):
        part = re.sub(r"<[^<>()]*>", "PLACEHOLDER", part)  # <this repository>, <connection>
        part = re.sub(r"\s*(\d?>&?\s*\S+)", "", part).rstrip(" &")
        words = shlex.split(part.replace("[", "").replace("]", "").replace("<(", "("))
        while words and (re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]) or words[0] in ("nohup", "/usr/bin/time")):
            words = words[2:] if words[0] == "/usr/bin/time" and words[1:2] == ["-v"] else words[1:]
        if words:
            result.append(words)
    return result


def flags(words: list[str]) -> list[str]:
    return [word.split("=")[0][2:] for word in words if word.startswith("--")]


def makefile():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w-]+):", text, re.MULTILINE)), set(re.findall(r"^(\w+) \?=", text, re.MULTILINE))


def setup_extras() -> set[str]:
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    return set(re.findall(r'^    "(\w+)": ', text, re.MULTILINE)) | set(re.findall(r'EXTRAS\["(\w+)"\]', text))


def check_run(argv: list[str]) -> list[str]:
    """`trl-federated run` flags parsed as the CLI parses them; a placeholder config stands for a real one."""
    from trl_federated.arguments import parse_run_args
    from trl_federated.arguments.shipped import shipped_file, take_option, with_shipped_config

    argv = with_shipped_config([PLACEHOLDERS.get(word) or word for word in argv])  # a shipped config by its name
    accelerate_config, argv = take_option(argv, "--accelerate_config", ValueError)
    if accelerate_config is not None and not Path(shipped_file(accelerate_config, "accelerate")).is_file():
        return [f"no accelerate config {accelerate_config}"]
    if "--help" in argv:
        return []
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    if config is not None and not (ROOT / config).is_file():
        return [f"no config {config}"]
    try:
        parse_run_args([*argv, *CPU])
    except (Exception, SystemExit) as error:  # argparse exits on an unknown flag or a bad value
        return [f"`trl-federated run {' '.join(argv)}` does not parse: {error!r}"]
    return []


def check_script_flags(script: Path, argv: list[str]) -> list[str]:
    """A script's flags: each one its argparse declares (or the harness it imports, `benchmarks/harness/grid.py`), or,
    for a script that parses `trl-federated run`'s groups or hands them the flags it does not know, a field of them."""
    from trl_federated.arguments import BenchmarkArguments
    from trl_federated.config import CONFIG_CLASSES

    source = script.read_text(encoding="utf-8")
    if "from harness" in source:
        source += "".join(path.read_text(encoding="utf-8") for path in (ROOT / "benchmarks" / "harness").glob("*.py"))
    run_like = re.search(r"TrlParser|parse_run_args|HfArgumentParser|parse_known_args", source)
    import dataclasses

    from trl import ModelConfig

    run_fields = {item.name for cls in (*CONFIG_CLASSES.values(), ModelConfig, BenchmarkArguments)
                  for item in dataclasses.fields(cls)} | {"config"}  # fmt: skip
    return [f"{script.relative_to(ROOT)} has no flag --{flag}" for flag in flags(argv)
            if f'"--{flag}"' not in source and not (run_like and flag in run_fields)]  # fmt: skip


def check_flwr(argv: list[str]) -> list[str]:
    if argv[:1] in (["supernode"], ["stop"], ["ls"]):
        return []  # Flower's own commands: checked against `flwr --help` in test_flower_commands_in_the_docs_exist
    if argv == ["new"]:
        return []  # `flwr new` named in prose, as what `trl-federated new-app` does for this package
    assert argv[0] == "run", argv
    if len(argv) == 1:
        return []  # `flwr run` named in prose
    app = ROOT / NEW_APPS.get(argv[1], argv[1])
    if not (app / "pyproject.toml").is_file():
        return [f"no Flower app at {argv[1]}"]
    keys = tomllib.loads((app / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["flwr"]["app"]["config"]
    problems = []
    for flag, known in (("--run-config", set(keys)), ("--federation-config", FLOWER_FEDERATION_KEYS)):
        if flag in argv:
            for item in argv[argv.index(flag) + 1].split():
                if item.split("=")[0] not in known:
                    problems.append(f"`{flag}` key {item.split('=')[0]} is not one of {argv[1]}'s")
    return problems


def check_command(words: list[str]) -> list[str]:
    program, args = words[0], words[1:]
    if program == "make":
        targets, variables = makefile()
        return [f"make has no {arg}" for arg in args
                if not (arg in targets or ("=" in arg and arg.split("=")[0] in variables))]  # fmt: skip
    if program == "trl-federated":
        if args[:1] == ["run"]:
            return check_run(args[1:])
        if args[:1] == ["compare"]:
            source = (ROOT / "trl_federated" / "reports" / "compare.py").read_text(encoding="utf-8")
            config = args[args.index("--config") + 1] if "--config" in args else "examples/configs/quickstart.yaml"
            return [f"compare has no --{flag}" for flag in flags(args) if f'"--{flag}"' not in source] + (
                [] if (ROOT / config).is_file() else [f"no config {config}"])  # fmt: skip
        if args[:1] == ["new-app"]:
            return [] if args[1:] in (["--help"], *([name] for name in NEW_APPS)) else [f"no new-app {args[1:]}"]
        return [] if args in ([], ["--help"]) else [f"trl-federated has no command {args[0]}"]
    if program == "python":
        if args[:2] == ["-m", "pytest"]:
            return [f"no test file {arg}" for arg in args[2:] if arg.startswith("tests/") and not (ROOT / arg).exists()]
        if args[:2] == ["-m", "trl_federated.cli"]:
            return check_command(["trl-federated", *args[2:]])
        if args[:2] == ["-m", "trl_federated.flower.flwr_run"]:
            return check_flwr(["run", *args[2:]])
        if args[0] == "-m":
            module = ROOT / (args[1].replace(".", "/") + ".py")
            return [] if args[1].startswith("trl_federated.") and module.is_file() else [f"no module {args[1]}"]
        script = ROOT / args[0]
        if not script.is_file():
            return [f"no script {args[0]}"]
        if args[0] == "examples/scripts/fgrpo.py":
            return check_run(args[1:])
        return check_script_flags(script, args[1:])
    if program == "accelerate":
        assert args[0] == "launch", args
        if "--config_file" not in args:
            return []  # `accelerate launch` named in prose
        config = args[args.index("--config_file") + 1]
        problems = [] if (ROOT / config).is_file() else [f"no accelerate config {config}"]
        rest = [arg for arg in args[1:] if arg not in ("--config_file", config)]
        if "--num_processes" in rest:
            del rest[rest.index("--num_processes"):rest.index("--num_processes") + 2]
        if rest[:1] == ["-m"]:
            return problems + check_command(["python", *rest])
        return problems + ([] if not rest or rest[0] in PLACEHOLDERS else check_command(["python", *rest]))
    if program == "flwr":
        return check_flwr(args)
    if program == "pip":
        extras = [extra for arg in args for group in re.findall(r"^\.\[([\w,]+)\]$", arg) for extra in group.split(",")]
        return [f"setup.py has no extra {extra}" for extra in extras if extra not in setup_extras()]
    if program == "bash":
        return [] if (ROOT / args[0]).is_file() else [f"no script {args[0]}"]
    if program == "mkdocs":
        return [] if args[0] in ("serve", "build") else [f"mkdocs has no command {args[0]}"]
    if program in ("flower-superlink", "flower-supernode"):
        return []  # checked against their --help in test_flower_commands_in_the_docs_exist
    if program in EXTERNAL:
        return []
    return [f"a command no test checks: {' '.join(words)}"]


def all_commands() -> list[tuple[str, list[str]]]:
    return [(name, words) for name, text in doc_texts().items() for command in shown_commands(text)
            for words in simple_commands(command)]  # fmt: skip


def test_every_command_in_the_docs_is_checked():
    commands = all_commands()
    assert len(commands) > 50  # the extraction finds the docs' commands, not none
    problems = [f"{name}: {problem}" for name, words in commands for problem in check_command(words)]
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_what_it_should():
    assert check_command(["trl-federated", "run", "--config", "examples/configs/quickstart.yaml", "--num_round", "5"])
    assert check_command(["trl-federated", "run", "--config", "examples/configs/nope.yaml"])
    assert check_command(["python", "benchmarks/verdict.py", "--no_such_flag"])
    assert check_command(["flwr", "run", "examples/flower", "--run-config", "num-round=5"])
    assert check_command(["make", "no-such-target"]) and check_command(["pip", "install", "-e", ".[nope]"])
    assert check_command(["curl", "https://example.org"])
    assert simple_commands("OMP_NUM_THREADS=1 nohup python benchmarks/gate.py --commit > out.log 2>&1 &") == [
        ["python", "benchmarks/gate.py", "--commit"]]  # fmt: skip


@pytest.mark.skipif(shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
                    reason="Flower is not installed: pip install -e '.[flower]'")  # fmt: skip
def test_flower_commands_in_the_docs_exist():
    """The Flower CLI's flags the deployment recipe uses are flags of the installed Flower, and each `--node-config`
    key is one the example's ClientApp (`trl_federated.flower.fgrpo_app`, `trl_federated.flower.apps`) reads."""
    bin_dir = Path(sys.executable).parent
    helps = {}
    sources = [*(ROOT / "examples/flower").rglob("*.py"), *(ROOT / "trl_federated/flower").glob("*app*.py")]
    app_source = "".join(path.read_text(encoding="utf-8") for path in sources)
    problems = []
    for name, words in all_commands():
        program = words[0]
        if program == "flwr" and words[1] == "supernode":
            program, words = "flwr supernode " + words[2], [words[0], *words[1:3], *words[3:]]
        if program == "flwr" and words[1] in ("stop", "ls"):
            program, words = f"flwr {words[1]}", [words[0], *words[2:]]
        if (program not in ("flower-superlink", "flower-supernode", "flwr stop", "flwr ls")
                and not program.startswith("flwr supernode")):
            continue
        if program not in helps:
            result = subprocess.run([str(bin_dir / program.split()[0]), *program.split()[1:], "--help"],
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
            assert result.returncode == 0, (program, result.stderr[-1000:])
            helps[program] = result.stdout + result.stderr
        problems += [f"{name}: {program} has no --{flag}" for flag in flags(words) if f"--{flag}" not in helps[program]]
        if "--node-config" in words:
            for item in words[words.index("--node-config") + 1].split():
                if f'"{item.split("=")[0]}"' not in app_source:
                    problems.append(f"{name}: the example ClientApp reads no node-config key {item.split('=')[0]}")
    assert helps and not problems, problems


def test_every_repository_path_in_the_docs_exists():
    """A file or folder of this repository named in a code span (`benchmarks/verdict.py`) exists: the docs name
    repository files in code spans, not in links that the site could not resolve."""
    missing = []
    for name, text in doc_texts().items():
        for span in INLINE.findall(text):
            if re.fullmatch(r"(benchmarks|examples|trl_federated|tests|docs|\.ci)/[\w./-]*", span) and "*" not in span:
                if not (ROOT / span.rstrip("/")).exists():
                    missing.append(f"{name}: {span}")
    assert not missing, missing


def setup_assignments() -> dict:
    """setup.py's top-level assignments (`INSTALL_REQUIRES`, `DOCS`, `EXTRAS`, ...) as AST nodes, read without
    running it."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    return {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def test_constraints_pin_every_requirement_within_setup_pys_ranges():
    """constraints.txt is the exact set CI installs (`make install` passes it with -c): one version per package,
    every requirement of setup.py that CI installs (the package's and the test, Flower and DeepSpeed extras') pinned
    inside its range; in the environment it
    made, each installed version is the pinned one."""
    import ast
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and canonicalize_name(name) not in pins, line
            pins[canonicalize_name(name)] = version.strip()
    values = setup_assignments()
    requirements = [*ast.literal_eval(values["INSTALL_REQUIRES"]), *ast.literal_eval(values["DOCS"])]
    extras = values["EXTRAS"]
    for key, value in zip(extras.keys, extras.values):
        # the extras `make install` installs (docs and notebooks are within test); a Name is DOCS, counted above
        if ast.literal_eval(key) in ("test", "flower", "deepspeed", "notebooks") and isinstance(value, ast.List):
            requirements += [ast.literal_eval(item) for item in value.elts if not isinstance(item, ast.Starred)]
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins  # the Makefile's TORCH, a build per machine
            continue
        assert name in pins, f"{text} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():  # the environment `make install` made
        for name, version in pins.items():
            assert metadata.version(name) == version, name


def test_the_examples_readmes_links_resolve_to_a_file_and_its_heading():
    # mkdocs checks the docs' links; the examples' READMEs are read on GitHub, outside the site.
    import re

    def anchors(page: Path) -> set[str]:  # GitHub's and mkdocs' heading ids, for the headings these pages use
        headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
        return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}

    for readme in (ROOT / "examples").rglob("README.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "#")):
                continue
            path, _, anchor = target.partition("#")
            page = (readme.parent / path).resolve()
            assert page.exists(), (readme, target)
            assert not anchor or anchor in anchors(page), (readme, target)


# Every relative link reads on GitHub as on the site: its file is in the repository, its anchor a heading of it.


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    headings = re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_of_the_readme_and_the_docs_resolves_in_the_repository():
    broken = []
    for page in [ROOT / "README.md", *PAGES]:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
        text = re.sub(r"`[^`\n]*`", "", text)  # code spans are no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or ROOT not in linked.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
