"""Plain-text tables for the command-line tools that print without ``rich``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ("text_table",)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[bool] = ()) -> str:
    """Columns padded to their widest cell, a rule under the headers, no trailing newline.

    Args:
        headers: column titles.
        rows: cells (``str()`` of each is printed).
        right: per column, True to right-align (numbers); missing entries mean left-aligned.
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    align = [bool(right[i]) if i < len(right) else False for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if a else v.ljust(w) for v, w, a in zip(values, widths, align, strict=True)
        ).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
