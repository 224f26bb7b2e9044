"""What the README, the docs and the Makefile tell a newcomer holds: two set-up commands, an install that works off
this project's machines, and no reference a reader cannot open."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
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


def test_the_readme_installs_from_a_clone_and_says_which_torch_build_pip_takes():
    assert 'pip install "trl-federated' not in README  # the package is not on PyPI
    assert 'pip install -e ".[deepspeed,flower]"' in README and ".[deepspeed,flower,vllm]" in README
    assert "make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu" in README
    assert "the CUDA one, several GB" in " ".join(README.split())


def make_dry_run(*variables: str) -> list[str]:
    """The pip commands `make install` would run in a fresh venv (`make -n`: nothing runs)."""
    result = subprocess.run(["make", "-n", "-B", "install", "VENV=/nonexistent/venv", "PYTHON=python3", *variables],
                            cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in result.stdout.splitlines() if "pip install" in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_takes_torch_from_pips_index_unless_told_another():
    default, package = make_dry_run()
    assert default.endswith('pip install --quiet  "torch==2.13.0"') and "--index-url" not in default  # CI: PyPI only
    assert package.endswith('pip install --quiet -e ".[test,flower,deepspeed]"')
    cpu = make_dry_run("TORCH_INDEX=https://download.pytorch.org/whl/cpu")[0]
    assert cpu.endswith('--index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"')
    assert make_dry_run("TORCH=torch==2.14.0")[0].endswith('"torch==2.14.0"')
