"""The Python examples of docs/adapters.md, as printed, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def docs_examples(title: str) -> list[str]:
    """The ```python blocks of the section ``## title`` of docs/adapters.md (its subsections included)."""
    text = (ROOT / "docs" / "adapters.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
