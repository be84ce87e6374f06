"""Every python block of docs/integrations.md runs (in order, one namespace per section)."""
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"


def _sections():
    text = DOC.read_text()
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        if blocks:
            yield section.splitlines()[0], blocks


@pytest.mark.parametrize("title,blocks", list(_sections()), ids=lambda x: str(x)[:12])
def test_doc_examples_run(title, blocks):
    if "Stable-Baselines3" in title:
        pytest.importorskip("stable_baselines3")
    if "TorchRL" in title:
        pytest.importorskip("torchrl")
    ns = {}
    for code in blocks:
        exec(compile(code, f"{DOC.name}: {title}", "exec"), ns)
