"""Render the bench tables of README.md and docs/bench.md from a results file.

    python bench/render.py RESULTS.json                      # print every section as markdown
    python bench/render.py RESULTS.json --write README.md docs/bench.md
    python bench/render.py RESULTS.json --plots docs/img     # the PNGs again (needs matplotlib)
    python bench/render.py RESULTS.json --write README.md docs/bench.md docs/executor.md --extra

``--write`` replaces, in each file, the text between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` with section NAME rendered from the results (``header``, ``reads``,
``warm``, ``tokens``, ``executor``, ``targets``, ``loops``, ``summary``), and leaves the rest of
the file alone. With ``--extra`` it also renders the regions of the satellite benches
(``kernels``, ``kernelscompile``, ``tokencompute``, ``concurrency``, ``split``, ``rows``,
``pagecache``, ``pagecachelimited``, ``soak``, ``accuracy``, ``accuracydetail``) from their
committed results files under ``docs/results/`` (``bench/report_extra.py``; run from the
repository root, since those files are named relative to it). Figures are never typed into the docs: they come from
the results files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from aioexperts_bench import SECTIONS, load_results, markdown

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import one_line_error  # noqa: E402  (sibling modules of this script)
from report_extra import EXTRA  # noqa: E402

_REGION = re.compile(r"(<!-- bench:(?P<name>[a-z]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.DOTALL)


def render_file(text: str, results: dict, source: str, extra: bool = False) -> tuple[str, list[str]]:
    """``text`` with every marked region rendered; returns the new text and the section names.

    Regions of the satellite benches are left as they are unless ``extra``.
    """
    names: list[str] = []

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name in EXTRA:
            if not extra:
                return m.group(0)
            path, render = EXTRA[name]
            data = json.loads(Path(path).read_text())
            data["_source"] = path
            body, src = render(data), path
        elif name in SECTIONS:
            try:
                body, src = markdown(results, name), source
            except KeyError:  # a file of --mode reads has no tokens or executor section: left as it is
                print(f"{name}: not in {source} (left as it is)", file=sys.stderr)
                return m.group(0)
        else:
            raise SystemExit(f"unknown bench section {name!r}; known: {', '.join([*SECTIONS, *EXTRA])}")
        names.append(name)
        stamp = f"<!-- rendered by bench/render.py from {src}; do not edit by hand -->\n"
        return f"{m.group(1)}{stamp}{body}\n{m.group(4)}"

    return _REGION.sub(replace, text), names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a bench-results.json written by aioexperts-bench")
    parser.add_argument("--write", nargs="+", metavar="FILE", help="files whose marked regions to replace")
    parser.add_argument("--plots", metavar="DIR", help="write the plots of the results file into DIR")
    parser.add_argument(
        "--extra", action="store_true", help="also render the satellite benches' regions from docs/results/*.json"
    )
    args = parser.parse_args(argv)
    try:
        return _render(args)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a results file or doc missing or of another kind
        print(f"{parser.prog}: error: {one_line_error(exc)}", file=sys.stderr)
        return 2


def _render(args: argparse.Namespace) -> int:
    results = load_results(args.results)
    if args.plots:
        from aioexperts_bench import write_plots

        for png in write_plots(results, args.plots):
            print(f"wrote {png}")
        if not args.write:
            return 0
    if not args.write:
        for name in SECTIONS:
            try:
                print(markdown(results, name), end="\n\n")
            except KeyError:
                continue
        return 0
    for path in args.write:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new, names = render_file(text, results, args.results, extra=args.extra)
        if not names:
            print(f"{path}: no <!-- bench:NAME --> regions", file=sys.stderr)
            return 1
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"{path}: rendered {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
