"""MkDocs hook: the pages that exist in one place only. The configuration reference is generated from
`FedGRPOConfig` on every build (`docs/gen_config_reference.py`); the home page is the README, its links to `docs/`
pages made relative to the site."""

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
sys.path.insert(0, str(ROOT))

import gen_config_reference  # noqa: E402


def home_page() -> str:
    """README.md with its `docs/...` links relative to the docs folder."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=home_page()))
    files.append(File.generated(config, gen_config_reference.PAGE, content=gen_config_reference.render()))
    return files
