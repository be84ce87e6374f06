"""Every python block of the docs runs (in order, one namespace per section)."""
import re
from pathlib import Path

import pytest

DOCS = [Path(__file__).resolve().parent.parent / "docs" / name
        for name in ("integrations.md", "api.md", "llm.md")]


def _sections():
    for doc in DOCS:
        for section in re.split(r"^## ", doc.read_text(), flags=re.M)[1:]:
            blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
            if blocks:
                yield doc.name, section.splitlines()[0], blocks


@pytest.mark.parametrize("doc,title,blocks", list(_sections()),
                         ids=lambda x: str(x)[:16])
def test_doc_examples_run(doc, title, blocks):
    if "Stable-Baselines3" in title:
        pytest.importorskip("stable_baselines3")
    if "TorchRL" in title:
        pytest.importorskip("torchrl")
    if title == "Drop-ins":  # verl's, OpenRLHF's and TRL's modules, imported as the LLM tests do
        from rl_triton.testing import import_frameworks, import_trl
        try:
            import_frameworks()
            import_trl()
        except ImportError as e:
            pytest.skip(str(e))
    ns = {}
    for code in blocks:
        exec(compile(code, f"{doc}: {title}", "exec"), ns)
