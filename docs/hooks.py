"""MkDocs hook: the home page, which is the README with its links to `docs/` pages made relative to the site. (The
configuration reference, `docs/config-reference.md`, is generated from `FedGRPOConfig` by `docs/gen_config_reference.py`
and committed, so that it reads on GitHub too; tests/test_docs.py checks it is current.)"""

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def home_page() -> str:
    """README.md with its `docs/...` links relative to the docs folder."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=home_page()))
    return files
