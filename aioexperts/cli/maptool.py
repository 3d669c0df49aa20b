"""``aioexperts-map``: a model's expert layout, and its ``WEEPF001`` expert map.

Subcommands:

- ``layout MODEL``: every MoE layer with its banks (ggml types, experts, bytes per expert), the
  total expert bytes and the expert bytes one token reads at top-k: a ``gguf-dump`` for experts;
- ``write MODEL [-o MAP] [--force]``: write the ``WEEPF001`` map that llama.cpp's prefetch patch reads
  (``docs/notes/FORMATS.md`` section 3). It never writes over the model (compared by device and
  inode, whatever the path), and replaces an existing file only if it is a map, or with ``--force``;
- ``check MODEL MAP``: whether the map still describes the model (exit status 0), or why not (1).

Errors are printed as one line on stderr with exit status 2; a closed pipe on stdout
(``aioexperts-map layout --json | head``) ends it quietly with status 141.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import (
    AioExpertsError,
    ConfigError,
    ExpertLayout,
    GGUFModel,
    StaleMapError,
    build_layout,
    check_map_matches_layout,
    open_model,
    read_expert_map,
    write_expert_map,
)
from .. import _json as strict_json  # the one strict JSON writer (an import-rule exception)
from ..traces import format_bytes
from ._common import (
    INTERRUPTED_STATUS,
    USAGE_STATUS,
    HelpFormatter,
    OneLineParser,
    add_version,
    error_text,
    file_starts_with,
    input_file,
    model_file,
    plural,
    refuse_to_overwrite,
    stdout_closed,
)
from ._texttable import text_table

__all__ = ("LayoutSummary", "main", "summarize_layout")

#: The first bytes of a WEEPF001 map (the format's name is its magic): ``write`` replaces such a file.
MAP_MAGIC = b"WEEPF001"


@dataclass(frozen=True, slots=True)
class BankSummary:
    """One bank of one MoE layer.

    Attributes:
        layer: block index.
        bank: 0 for ``ffn_*_exps``, 1..3 for ``_tier1..3``.
        first_expert, n_experts: the bank's global expert ids ``[first, first + n)``.
        types: ggml type names of gate, up and down.
        merged: gate and up are one ``ffn_gate_up_exps`` tensor.
        n_ff_exp, n_ff_down: expert width, and the down projection's (wider when padded).
        expert_bytes: bytes of one expert (gate + up + down).
    """

    layer: int
    bank: int
    first_expert: int
    n_experts: int
    types: tuple[str, str, str]
    merged: bool
    n_ff_exp: int
    n_ff_down: int
    expert_bytes: int


@dataclass(frozen=True, slots=True)
class LayoutSummary:
    """What :func:`summarize_layout` reports.

    Attributes:
        path: the model.
        architecture: ``general.architecture``.
        n_embd, n_expert_used: hidden size and top-k.
        banks: every bank of every MoE layer, in layer order.
        expert_bytes_total: bytes of every routed expert of the model.
        token_bytes_min, token_bytes_max: expert bytes one token reads through all MoE layers
            at top-k when it picks the smallest (largest) experts of each layer (equal unless the
            layers are mixed-tier).
    """

    path: str
    architecture: str
    n_embd: int
    n_expert_used: int
    banks: tuple[BankSummary, ...]
    expert_bytes_total: int
    token_bytes_min: int
    token_bytes_max: int

    @property
    def n_layers(self) -> int:
        """MoE layers."""
        return len({b.layer for b in self.banks})


def summarize_layout(model: GGUFModel, layout: ExpertLayout) -> LayoutSummary:
    """The expert layout of ``model`` as a :class:`LayoutSummary`."""
    banks = []
    token_min = token_max = 0
    k = layout.n_expert_used
    for index, moe in layout.layers.items():
        sizes = []
        for bank in moe.banks:
            expert_bytes = bank.gate_bytes + bank.up_bytes + bank.down_bytes
            types = (bank.gate.ggml_type.name, bank.up.ggml_type.name, bank.down.ggml_type.name)
            banks.append(
                BankSummary(
                    index,
                    bank.index,
                    bank.first_expert,
                    bank.n_experts,
                    types,
                    bank.merged,
                    bank.n_ff_exp,
                    bank.n_ff_down,
                    expert_bytes,
                )
            )
            sizes.extend([expert_bytes] * bank.n_experts)
        sizes.sort()
        token_min += sum(sizes[:k])
        token_max += sum(sizes[-k:])
    total = sum(b.expert_bytes * b.n_experts for b in banks)
    return LayoutSummary(model.path, model.architecture, layout.n_embd, k, tuple(banks), total, token_min, token_max)


def _print_layout(summary: LayoutSummary) -> None:
    rows = [
        (
            b.layer,
            b.bank,
            f"{b.first_expert}..{b.first_expert + b.n_experts - 1}",
            "/".join(b.types) + (" (merged gate_up)" if b.merged else ""),
            b.n_ff_exp if b.n_ff_down == b.n_ff_exp else f"{b.n_ff_exp} (down {b.n_ff_down})",
            b.expert_bytes,
            format_bytes(b.expert_bytes * b.n_experts),
        )
        for b in summary.banks
    ]
    print(f"{summary.path}: {summary.architecture}, n_embd {summary.n_embd}, top-{summary.n_expert_used}")
    print(
        text_table(
            ("layer", "bank", "experts", "gate/up/down", "n_ff_exp", "bytes/expert", "bank bytes"),
            rows,
            right=(True, True, False, False, True, True, True),
        )
    )
    per_token = format_bytes(summary.token_bytes_max)
    if summary.token_bytes_min != summary.token_bytes_max:
        per_token = f"{format_bytes(summary.token_bytes_min)} to {per_token}"
    print(
        f"{plural(summary.n_layers, 'MoE layer')}, {format_bytes(summary.expert_bytes_total)} of routed experts "
        f"({summary.expert_bytes_total} bytes); one token reads {per_token} of experts at top-{summary.n_expert_used}"
    )


def _layout_json(summary: LayoutSummary) -> dict[str, Any]:
    return {
        "path": summary.path,
        "architecture": summary.architecture,
        "n_embd": summary.n_embd,
        "n_expert_used": summary.n_expert_used,
        "units": {"bytes": "bytes"},
        "expert_bytes_total": summary.expert_bytes_total,
        "token_bytes_min": summary.token_bytes_min,
        "token_bytes_max": summary.token_bytes_max,
        "banks": [
            {
                "layer": b.layer,
                "bank": b.bank,
                "first_expert": b.first_expert,
                "n_experts": b.n_experts,
                "types": list(b.types),
                "merged": b.merged,
                "n_ff_exp": b.n_ff_exp,
                "n_ff_down": b.n_ff_down,
                "expert_bytes": b.expert_bytes,
            }
            for b in summary.banks
        ],
    }


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="aioexperts-map",
        description="Inspect a MoE GGUF's expert layout and write or check its WEEPF001 expert map.",
        formatter_class=HelpFormatter,
    )
    add_version(parser, "aioexperts-map")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layout", help="print the expert layout", formatter_class=HelpFormatter)
    p.add_argument("model", help="a .gguf file or any shard of a split set")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("write", help="write the WEEPF001 map", formatter_class=HelpFormatter)
    p.add_argument("model", help="a single-file .gguf")
    p.add_argument("-o", "--output", help="the map file (default: MODEL with the suffix .weepf)")
    p.add_argument("--force", action="store_true", help="replace an existing file that is not a WEEPF001 map")
    p = sub.add_parser("check", help="check a map against a model", formatter_class=HelpFormatter)
    p.add_argument("model", help="a single-file .gguf")
    p.add_argument("map", help="the WEEPF001 map file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``aioexperts-map``; returns the exit status (0 ok, 1 stale map, 2 error)."""
    args = _parser().parse_args(argv)
    try:
        model = open_model(model_file(args.model))
        layout = build_layout(model)
        if args.command == "layout":
            summary = summarize_layout(model, layout)
            if args.json:
                print(strict_json.dumps(_layout_json(summary), indent=2))
            else:
                _print_layout(summary)
        elif args.command == "write":
            output = os.path.expanduser(args.output) if args.output else os.path.splitext(model.path)[0] + ".weepf"
            refuse_to_overwrite(
                output,
                [s.path for s in model.shards],
                ours=file_starts_with(MAP_MAGIC),
                force=args.force,
                what="the map",
            )
            write_expert_map(model, layout, output)
            print(
                f"wrote {output}: {plural(len(layout.layers), 'MoE layer')}, {plural(layout.n_experts_total, 'expert')}"
            )
        else:
            if len(model.shards) != 1:
                raise ConfigError(f"WEEPF001 maps describe one file; {model.path} is a split set")
            emap = read_expert_map(input_file(args.map, "map file"), model.shards[0])
            check_map_matches_layout(emap, layout, args.map)
            print(f"{args.map}: up to date for {model.path}")
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except StaleMapError as exc:
        print(f"aioexperts-map: stale: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `aioexperts-... | head`: the reader has what it wanted
        return stdout_closed()
    except (AioExpertsError, OSError) as exc:
        print(f"aioexperts-map: error: {error_text(exc)}", file=sys.stderr)
        return USAGE_STATUS
    except KeyboardInterrupt:
        print("aioexperts-map: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
