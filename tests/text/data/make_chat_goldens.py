"""Render ``tests/text/chat_cases.py`` with transformers into ``chat-template-goldens.json`` (run by hand).

Needs transformers 5.23.0 and jinja2 in the running Python (not a test dependency):
``python tests/text/data/make_chat_goldens.py``. A case whose template raises keeps the error's
message instead of a rendering.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from chat_cases import BOS_TOKEN, CASES, CONVERSATIONS, EOS_TOKEN, TEMPLATES, TOOLS, case_id  # noqa: E402


def main() -> None:
    out: dict[str, object] = {"transformers": transformers.__version__, "cases": {}}
    for case in CASES:
        template, conversation, tools, generation = case
        try:
            rendered, _ = render_jinja_template(
                conversations=[CONVERSATIONS[conversation]],
                tools=TOOLS if tools else None,
                chat_template=TEMPLATES[template],
                add_generation_prompt=generation,
                bos_token=BOS_TOKEN,
                eos_token=EOS_TOKEN,
            )
            entry = {"expected": rendered[0]}
        except Exception as exc:  # the template's own error
            entry = {"error": str(exc)}
        out["cases"][case_id(case)] = entry  # type: ignore[index]
    (HERE / "chat-template-goldens.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
