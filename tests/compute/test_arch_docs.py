"""The architecture table of docs/executor.md and the registry (``archs.STATUSES``, ``MODEL_RECORDS``) agree."""

from __future__ import annotations

import re
from pathlib import Path

from aioexperts._format.archs import STATUSES as ARCHITECTURES
from aioexperts._format.hparams import Status

DOC = Path(__file__).resolve().parents[2] / "docs" / "executor.md"
_ROW = re.compile(r"^\| `(?P<arch>[^`]+)`[^|]* \| (?P<status>golden|source|refused) \|")


def _doc_rows() -> dict[str, str]:
    section = DOC.read_text().split("### The MoE architectures of llama.cpp", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m is not None:
            assert m["arch"] not in rows, f"{m['arch']} appears twice in the table"
            rows[m["arch"]] = m["status"]
    return rows


def test_every_arch_has_one_row_with_its_status() -> None:
    rows = _doc_rows()
    assert rows == {arch: status.value for arch, status in ARCHITECTURES.items()}


def test_the_issue_s_architectures_are_in_the_table() -> None:
    required = """qwen2moe qwen3moe qwen3next deepseek2 glm4moe gpt-oss llama olmoe granitemoe dbrx ernie4_5-moe
    hunyuan-moe bailingmoe bailingmoe2 dots1 grok arctic phimoe llama4 smallthinker minimax-m2""".split()
    assert set(required) <= set(_doc_rows())
    golden = {a for a, s in ARCHITECTURES.items() if s is Status.GOLDEN}
    # the families with llama.cpp goldens under ../shared/fixtures (fixtures README)
    assert golden == {"qwen3moe", "qwen2moe", "glm4moe", "llama", "gpt-oss", "deepseek2", "olmoe", "granitemoe"}


def test_the_whole_model_column_is_the_architecture_records() -> None:
    from aioexperts._format.archs import MODEL_RECORDS as RECORDS

    section = DOC.read_text().split("### The MoE architectures of llama.cpp", 1)[1].split("\n## ", 1)[0]
    column = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m is not None:
            column[m["arch"]] = line.rstrip().rstrip("|").rsplit("|", 1)[1].strip()
    assert {a for a, v in column.items() if v == "golden"} == {a for a, r in RECORDS.items() if r.status == "golden"}
    assert set(column.values()) <= {"golden", "refused"}
