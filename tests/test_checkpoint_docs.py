"""The Python examples of docs/checkpoint.md run as written, in order, in a fresh directory."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoint.md"


def test_docs_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_example"}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"{DOC.name}[python block {index}]", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"python block {index} of {DOC.name} failed:\n{block}") from err
    assert (tmp_path / "runs" / "demo" / "latest").read_text().strip() == "step-3"
