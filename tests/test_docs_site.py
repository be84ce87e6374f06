"""The docs site (mkdocs.yml) holds together without building it: CI runs `mkdocs build --strict`."""
import re
from pathlib import Path

import rl_triton

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_nav_pages_exist():
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert "index.md" in nav and "dev/kernel-decisions.md" in nav
    for page in nav:
        assert (DOCS / page).is_file(), page


def test_reference_names_public_functions():
    """reference.md renders the top-level names (the modules behind them may move): every op
    of the registry, in its order (`rl_triton._core.op.ops()`), then the public functions not
    declared as ops yet, and nothing else."""
    from rl_triton._core.op import UNDECLARED, ops
    directives = re.findall(r"^::: (\S+)$", (DOCS / "reference.md").read_text(), flags=re.M)
    assert directives == [f"rl_triton.{name}" for name in ops() + list(UNDECLARED)]


def test_user_pages_are_no_session_diary():
    assert (DOCS / "benchmarks.md").stat().st_size < 25_000
    for page in [DOCS / "index.md", DOCS / "benchmarks.md", DOCS / "api.md",
                 DOCS / "integrations.md", DOCS / "trainers.md", ROOT / "README.md"]:
        text = page.read_text()
        assert not re.search(r"\b\w+(th|st|nd|rd) session\b|\bthis session\b", text), page.name


def test_docs_hold_no_measurement_dumps():
    """Pages keep the figures a reader needs and the command that regenerates the raw results;
    the raw results themselves (bench.json and the like) stay out of the docs."""
    dumps = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*")
                   if p.suffix in (".json", ".jsonl", ".csv", ".log"))
    assert not dumps, dumps
