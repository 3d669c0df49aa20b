"""build_layout and ExpertLayout.locate: the fixtures' banks, byte runs checked against gguf.GGUFReader, the
merged gate_up form, and every rule of docs/notes/FORMATS.md sections 1-2 broken on purpose (each a LayoutError)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import format_testkit as kit
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from aioexperts import write_miss_tier
from aioexperts._errors import InvalidRequestError, LayoutError
from aioexperts._format.layout import ExpertLayout, build_layout
from aioexperts._format.model import open_model
from aioexperts.testing import SyntheticSpec, write_synthetic_model

Q = GGMLQuantizationType


def _expert_bytes(t: GGMLQuantizationType, ne0: int, ne1: int) -> int:
    block, size = GGML_QUANT_SIZES[t]
    return ne0 // block * size * ne1


def _check_against_reader(path: Path, layout: ExpertLayout) -> int:
    """Each expert's runs are ``[data_offset + e*B, +B)`` of its bank's tensors, with the reader's bytes."""
    ref = kit.reader_tensors(path)
    checked = 0
    with open(path, "rb", buffering=0) as f:
        for loc in layout:
            moe = layout.layer(loc.layer)
            bank = moe.banks[loc.bank]
            assert bank.first_expert <= loc.expert < bank.first_expert + bank.n_experts
            assert loc.local_id == loc.expert - bank.first_expert
            e = loc.local_id
            for proj, seg in zip(("gate", "up", "down"), loc.segments, strict=True):
                sfx = f"_tier{bank.index}" if bank.index else ""
                t = ref[f"blk.{loc.layer}.ffn_{proj}_exps{sfx}.weight"]
                ne0, ne1, ne2 = (int(d) for d in t.shape)
                assert ne2 == bank.n_experts
                b = _expert_bytes(t.tensor_type, ne0, ne1)
                assert (seg.offset, seg.n_bytes, seg.ggml_type, seg.shard) == (
                    t.data_offset + e * b,
                    b,
                    t.tensor_type,
                    0,
                )
                assert seg.end == seg.offset + b
                assert seg.shape == (
                    ne1,
                    ne0,
                )  # numpy (rows, cols): gate/up (n_ff, n_embd), down (n_embd, n_ff_down)
                data = kit.reader_tensor_bytes(t)
                assert os.pread(f.fileno(), seg.n_bytes, seg.offset) == data[e * b : (e + 1) * b]
            assert loc.n_bytes == sum(s.n_bytes for s in loc.segments)
            checked += 1
    return checked


# --------------------------------------------------------------------------------------------------
# the fixtures


@pytest.mark.parametrize("name", kit.FIXTURE_NAMES or ["<no fixtures>"])
def test_fixture_layout_matches_gguf_reader_bytes(name: str) -> None:
    path = kit.fixture_path(name)
    model = open_model(path)
    layout = build_layout(model)
    stem = Path(name).name
    # (MoE layers, top-k, experts, expert width): the fixtures' READMEs
    if stem.startswith("deepseek4"):
        expected_layers, k, n_expert, n_ff = [0, 1, 2, 3], 3, 8, 128
    elif stem.startswith("qwen35moe"):
        expected_layers, k, n_expert, n_ff = [0, 1, 2, 3], 4, 16, 64
    elif stem.startswith(("glm4moe", "deepseek2")):
        expected_layers, k, n_expert, n_ff = [1, 2], 2, 8, 256
    else:
        expected_layers, k, n_expert, n_ff = [0, 1, 2], 2, 8, 256
    assert list(layout.layers) == expected_layers
    assert layout.n_expert_used == k
    assert layout.n_embd == 256
    assert layout.n_experts_total == n_expert * len(expected_layers)
    for moe in layout.layers.values():
        assert moe.n_experts == n_expert
        assert moe.router.name == f"blk.{moe.index}.ffn_gate_inp.weight"
        assert moe.router.dims == (256, n_expert)
        for bank in moe.banks:
            assert (bank.n_embd, bank.n_ff_exp, bank.n_ff_down, bank.merged) == (256, n_ff, n_ff, False)
    assert _check_against_reader(path, layout) == n_expert * len(expected_layers)
    assert layout.max_expert_bytes == max(loc.n_bytes for loc in layout)


def test_mixed_fixture_banks() -> None:
    layout = build_layout(open_model(kit.fixture_path("qwen3moe-mixed.gguf")))
    for li, moe in layout.layers.items():
        assert moe.mixed_tier
        assert [(b.index, b.first_expert, b.n_experts) for b in moe.banks] == [
            (0, 0, 3),
            (1, 3, 2),
            (2, 5, 2),
            (3, 7, 1),
        ]
        types = [(b.gate.ggml_type, b.up.ggml_type, b.down.ggml_type) for b in moe.banks]
        assert types[0] == (Q.Q8_0, Q.Q8_0, Q.Q8_0)
        assert types[1][:2] == (Q.Q4_K, Q.Q4_K)
        assert types[1][2] in (Q.Q4_K, Q.Q6_K)
        assert types[2] == (Q.Q2_K, Q.Q2_K, Q.Q3_K)
        assert types[3] == (Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_XS)
        assert moe.banks[1].down.ggml_type == (Q.Q6_K if li == 2 else Q.Q4_K)
        for g in range(8):
            loc = layout.locate(li, g)
            bank = moe.bank_of(g)
            assert loc.bank == bank.index
            assert loc.expert == g
            assert loc.gate.ggml_type == bank.gate.ggml_type
        assert [layout.locate(li, g).bank for g in range(8)] == [0, 0, 0, 1, 1, 2, 2, 3]
        assert [layout.locate(li, g).local_id for g in range(8)] == [0, 1, 2, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("name", ["qwen3moe-q4_k_m.gguf", "qwen2moe-f32.gguf", "glm4moe-f32.gguf"])
def test_single_bank_fixtures_are_not_mixed(name: str) -> None:
    layout = build_layout(open_model(kit.fixture_path(name)))
    for moe in layout.layers.values():
        assert not moe.mixed_tier
        assert len(moe.banks) == 1
        assert moe.banks[0].first_expert == 0
        assert moe.banks[0].n_experts == 8


def test_glm4moe_first_moe_layer_is_1() -> None:
    layout = build_layout(open_model(kit.fixture_path("glm4moe-q4_k_m.gguf")))
    assert min(layout.layers) == 1
    with pytest.raises(InvalidRequestError, match=r"no MoE layer 0; MoE layers are 1\.\.2"):
        layout.locate(0, 0)


# --------------------------------------------------------------------------------------------------
# locate: bad requests


@pytest.fixture(scope="module")
def small_layout(tmp_path_factory: pytest.TempPathFactory) -> ExpertLayout:
    path = write_synthetic_model(tmp_path_factory.mktemp("layout") / "s.gguf", kit.SMALL.with_(leading_dense=1))[0]
    return build_layout(open_model(path))


@pytest.mark.parametrize("layer", [0, 3, -1, 99, None, "1", (1,)])
def test_locate_missing_layer(small_layout: ExpertLayout, layer: object) -> None:
    assert list(small_layout.layers) == [1, 2]
    with pytest.raises(InvalidRequestError, match=rf"no MoE layer {re.escape(repr(layer))}; MoE layers are 1\.\.2"):
        small_layout.locate(layer, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("expert", [8, 9, 1 << 40, -1, -8])
def test_locate_expert_out_of_range(small_layout: ExpertLayout, expert: int) -> None:
    with pytest.raises(InvalidRequestError, match=rf"layer 1 has experts 0\.\.7; expert {expert} does not exist"):
        small_layout.locate(1, expert)
    with pytest.raises(InvalidRequestError):
        small_layout.layer(2).locate(expert)


def test_locate_accepts_numpy_ints(small_layout: ExpertLayout) -> None:
    assert small_layout.locate(np.int64(1), np.int32(7)) == small_layout.locate(1, 7)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        small_layout.locate(1, np.int64(8))  # type: ignore[arg-type]


def test_iteration_order(small_layout: ExpertLayout) -> None:
    assert [(loc.layer, loc.expert) for loc in small_layout] == [(li, e) for li in (1, 2) for e in range(8)]
    assert "layers=1..2" in repr(small_layout)


# --------------------------------------------------------------------------------------------------
# synthetic models: merged gate_up, tiers, padding


def test_merged_gate_up(tmp_path: Path) -> None:
    spec = kit.SMALL.with_(merged_gate_up=True)
    path = write_synthetic_model(tmp_path / "m.gguf", spec)[0]
    layout = build_layout(open_model(path))
    ref = kit.reader_tensors(path)
    for loc in layout:
        bank = layout.layer(loc.layer).banks[0]
        assert bank.merged
        assert bank.gate is bank.up
        assert bank.n_ff_exp == spec.n_ff_exp
        t = ref[f"blk.{loc.layer}.ffn_gate_up_exps.weight"]
        assert [int(d) for d in t.shape] == [spec.n_embd, 2 * spec.n_ff_exp, spec.n_expert]
        half = _expert_bytes(t.tensor_type, spec.n_embd, spec.n_ff_exp)
        run = t.data_offset + loc.expert * 2 * half
        assert (loc.gate.offset, loc.gate.n_bytes) == (run, half)
        assert (loc.up.offset, loc.up.n_bytes) == (run + half, half)
        assert loc.gate.shape == loc.up.shape == (spec.n_ff_exp, spec.n_embd)
        data = kit.reader_tensor_bytes(t)
        expert_run = data[loc.expert * 2 * half : (loc.expert + 1) * 2 * half]
        assert kit.pread(path, loc.gate.offset, half) == expert_run[:half]  # gate rows first
        assert kit.pread(path, loc.up.offset, half) == expert_run[half:]  # then up rows
        down = ref[f"blk.{loc.layer}.ffn_down_exps.weight"]
        db = _expert_bytes(down.tensor_type, spec.n_ff_exp, spec.n_embd)
        assert (
            kit.pread(path, loc.down.offset, db)
            == kit.reader_tensor_bytes(down)[loc.expert * db : (loc.expert + 1) * db]
        )


def test_synthetic_tiers_and_types(tmp_path: Path) -> None:
    spec = kit.SMALL.with_(
        tiers=((2, Q.Q8_0), (2, Q.Q2_K), (1, Q.IQ4_XS)), expert_type=Q.Q4_K, down_type=Q.Q6_K, leading_dense=2
    )
    path = write_synthetic_model(tmp_path / "t.gguf", spec)[0]
    layout = build_layout(open_model(path))
    assert list(layout.layers) == [2, 3]
    for moe in layout.layers.values():
        assert moe.mixed_tier
        assert [(b.first_expert, b.n_experts) for b in moe.banks] == [(0, 3), (3, 2), (5, 2), (7, 1)]
        assert [(b.gate.ggml_type, b.down.ggml_type) for b in moe.banks] == [
            (Q.Q4_K, Q.Q6_K),
            (Q.Q8_0, Q.Q8_0),
            (Q.Q2_K, Q.Q2_K),
            (Q.IQ4_XS, Q.IQ4_XS),
        ]
    assert _check_against_reader(path, layout) == 16


def _write(tmp_path: Path, layers: list[dict], **kv_args: object) -> Path:
    tensors = [spec for layer in layers for spec in kit.as_specs(layer)]
    return kit.write_gguf(tmp_path / "l.gguf", tensors, kv=kit.moe_kv(**kv_args))  # type: ignore[arg-type]


def _layout(tmp_path: Path, layers: list[dict], **kv_args: object) -> ExpertLayout:
    return build_layout(open_model(_write(tmp_path, layers, **kv_args)))


def test_hand_written_valid_layer(tmp_path: Path) -> None:
    """The control: the unbroken version of every layer the rule tests below break builds fine."""
    layout = _layout(tmp_path, [kit.moe_layer(0), kit.moe_layer(1, banks=((3, Q.F32), (5, Q.F16)))])
    assert not layout.layer(0).mixed_tier
    assert layout.layer(1).mixed_tier
    assert layout.locate(1, 4).bank == 1
    assert layout.locate(1, 4).local_id == 1


def test_down_wider_than_n_ff_is_padding(tmp_path: Path) -> None:
    layout = _layout(tmp_path, [kit.moe_layer(0, n_ff_down=64)])
    bank = layout.layer(0).banks[0]
    assert (bank.n_ff_exp, bank.n_ff_down) == (32, 64)
    loc = layout.locate(0, 3)
    assert loc.down.shape == (32, 64)
    assert loc.down.n_bytes == 64 * 4 * 32
    assert loc.gate.shape == loc.up.shape == (32, 32)


def test_pruned_layer_is_mixed_tier(tmp_path: Path) -> None:
    """Fewer router outputs than expert_count: a pruned (mixed-tier) layer."""
    layout = _layout(tmp_path, [kit.moe_layer(0, banks=((6, Q.F32),))], n_expert=8)
    assert layout.layer(0).mixed_tier
    assert layout.layer(0).n_experts == 6
    with pytest.raises(InvalidRequestError, match="expert 6 does not exist"):
        layout.locate(0, 6)


# --------------------------------------------------------------------------------------------------
# rule violations


def _rename(layer: dict, old: str, new: str) -> dict:
    return {(new if k == old else k): v for k, v in layer.items()}


def _drop(layer: dict, *names: str) -> dict:
    return {k: v for k, v in layer.items() if k not in names}


def _tier_gap() -> list[dict]:
    layer = kit.moe_layer(0, banks=((4, Q.F32), (2, Q.F32), (2, Q.F32)))
    for proj in ("gate", "up", "down"):
        layer = _rename(layer, f"blk.0.ffn_{proj}_exps_tier1.weight", f"blk.0.ffn_{proj}_exps_tier3.weight")
    return [layer]


def _tiers_without_base() -> list[dict]:
    layer = kit.moe_layer(0, banks=((4, Q.F32), (4, Q.F32)))
    return [_drop(layer, *(f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")))]


def _tier4() -> list[dict]:
    layer = kit.moe_layer(0, banks=((4, Q.F32), (4, Q.F32)))
    for proj in ("gate", "up", "down"):
        layer = _rename(layer, f"blk.0.ffn_{proj}_exps_tier1.weight", f"blk.0.ffn_{proj}_exps_tier4.weight")
    return [layer]


def _with(layer: dict, name: str, dims: list[int], t: GGMLQuantizationType = Q.F32) -> dict:
    out = dict(layer)
    out[name] = (dims, t)
    return out


RULES: dict[str, tuple[object, dict, str]] = {
    "tier gap (tier3 without tier1..2)": (
        _tier_gap,
        {},
        r"layer 0: banks \[0, 2, 3\] are not consecutive from 0",
    ),
    "tiers without a base bank": (
        _tiers_without_base,
        {},
        r"layer 0: banks \[1\] are not consecutive from 0",
    ),
    "tier 4": (_tier4, {}, r"tier 4 is out of range \(1\.\.3\)"),
    "router outputs != sum of banks": (
        lambda: [kit.moe_layer(0, banks=((3, Q.F32), (4, Q.F32)), router_outputs=8)],
        {},
        r"layer 0: banks hold 7 experts, the router has 8 outputs",
    ),
    "router outputs > sum of banks (single bank)": (
        lambda: [kit.moe_layer(0, banks=((6, Q.F32),), router_outputs=8)],
        {},
        r"banks hold 6 experts, the router has 8 outputs",
    ),
    "n_expert_used > experts in layer": (
        lambda: [kit.moe_layer(0, banks=((2, Q.F32), (2, Q.F32)))],
        {"n_used": 6},
        r"expert_used_count \(6\) <= experts in layer \(4\) <= expert_count \(8\)",
    ),
    "experts in layer > expert_count": (
        lambda: [kit.moe_layer(0, banks=((8, Q.F32),))],
        {"n_expert": 4},
        r"expert_used_count \(2\) <= experts in layer \(8\) <= expert_count \(4\)",
    ),
    "down narrower than n_ff": (
        lambda: [kit.moe_layer(0, n_ff_down=16)],
        {},
        r"layer 0 bank 0: down width 16 is smaller than n_ff_exp=32",
    ),
    "down narrower than n_ff in a tier": (
        lambda: [
            _with(
                kit.moe_layer(0, banks=((4, Q.F32), (4, Q.F32))),
                "blk.0.ffn_down_exps_tier1.weight",
                [16, 32, 4],
            )
        ],
        {},
        r"layer 0 bank 1: down width 16 is smaller than n_ff_exp=32",
    ),
    "gate/up n_ff mismatch": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_up_exps.weight", [32, 64, 8])],
        {"n_ff": None},
        r"layer 0 bank 0: gate dims \[32, 32, 8\] and up dims \[32, 64, 8\] differ",
    ),
    "gate/up n_embd mismatch": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_up_exps.weight", [64, 32, 8])],
        {},
        r"gate dims \[32, 32, 8\] and up dims \[64, 32, 8\] differ",
    ),
    "gate/up/down stack different counts": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_up_exps.weight", [32, 32, 7])],
        {},
        r"layer 0 bank 0: gate/up/down stack 8/7/8 experts",
    ),
    "bank missing its down tensor": (
        lambda: [_drop(kit.moe_layer(0, banks=((4, Q.F32), (4, Q.F32))), "blk.0.ffn_down_exps_tier1.weight")],
        {},
        r"layer 0 bank 1: ffn_down_exps tensor is missing",
    ),
    "bank missing its up tensor": (
        lambda: [_drop(kit.moe_layer(0), "blk.0.ffn_up_exps.weight")],
        {},
        r"layer 0 bank 0: needs ffn_gate_exps and ffn_up_exps \(or ffn_gate_up_exps\)",
    ),
    "merged and separate gate/up": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_gate_up_exps.weight", [32, 64, 8])],
        {},
        r"has both ffn_gate_up_exps and separate gate/up tensors",
    ),
    "merged gate_up with odd ne1": (
        lambda: [_with(kit.moe_layer(0, merged=True), "blk.0.ffn_gate_up_exps.weight", [32, 63, 8])],
        {},
        r"blk\.0\.ffn_gate_up_exps\.weight: ne1=63 is odd, expected 2\*n_ff",
    ),
    "expert tensors without a router": (
        lambda: [kit.moe_layer(0), _drop(kit.moe_layer(1), "blk.1.ffn_gate_inp.weight")],
        {},
        r"layer 1 has expert tensors but no router blk\.1\.ffn_gate_inp\.weight",
    ),
    "router without expert tensors": (
        lambda: [kit.moe_layer(0), {"blk.1.ffn_gate_inp.weight": ([32, 8], Q.F32)}],
        {},
        r"layer 1 has a router but no expert tensors",
    ),
    "router with the wrong n_embd": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_gate_inp.weight", [64, 8])],
        {},
        r"layer 0: router dims \[64, 8\], expected \[32, n_experts\]",
    ),
    "router with 3 dims": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_gate_inp.weight", [32, 8, 1])],
        {},
        r"router dims \[32, 8, 1\]",
    ),
    "expert tensor not stacked": (
        lambda: [_with(kit.moe_layer(0, banks=((1, Q.F32),)), "blk.0.ffn_gate_exps.weight", [32, 32])],
        {"n_used": 1},
        r"blk\.0\.ffn_gate_exps\.weight: dims \[32, 32\], expected 3 \(stacked experts\)",
    ),
    "gate with the wrong n_embd": (
        lambda: [
            _with(
                _with(kit.moe_layer(0), "blk.0.ffn_gate_exps.weight", [64, 32, 8]),
                "blk.0.ffn_up_exps.weight",
                [64, 32, 8],
            )
        ],
        {},
        r"gate ne0=64, down ne1=32, expected n_embd=32",
    ),
    "down with the wrong n_embd": (
        lambda: [_with(kit.moe_layer(0), "blk.0.ffn_down_exps.weight", [32, 64, 8])],
        {},
        r"gate ne0=32, down ne1=64, expected n_embd=32",
    ),
    "tier with another n_ff": (
        lambda: [
            {
                **kit.moe_layer(0, banks=((4, Q.F32),)),
                **{k: v for k, v in kit.moe_layer(0, n_ff=64, banks=((4, Q.F32), (4, Q.F32))).items() if "tier1" in k},
                "blk.0.ffn_gate_inp.weight": ([32, 8], Q.F32),
            }
        ],
        {},
        r"layer 0: bank 1 has n_ff_exp=64, bank 0 has 32",
    ),
    "expert_feed_forward_length disagrees": (
        lambda: [kit.moe_layer(0)],
        {"n_ff": 48},
        r"layer 0: experts have n_ff_exp=32, expert_feed_forward_length=48",
    ),
    "no MoE layers": (
        lambda: [{"token_embd.weight": ([32, 8], Q.F32)}],
        {},
        r"no MoE layers",
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layout_rule_violation(tmp_path: Path, rule: str) -> None:
    make, kv_args, message = RULES[rule]
    path = _write(tmp_path, make(), **kv_args)  # type: ignore[operator]
    model = open_model(path)  # the file itself is a valid GGUF
    with pytest.raises(LayoutError, match=message):
        build_layout(model)


@pytest.mark.parametrize("key", ["expert_used_count", "embedding_length"])  # expert_count: a dense model, below
def test_missing_metadata(tmp_path: Path, key: str) -> None:
    kv = kit.moe_kv()
    del kv[f"qwen3moe.{key}"]
    path = kit.write_gguf(tmp_path / "l.gguf", kit.as_specs(kit.moe_layer(0)), kv=kv)
    with pytest.raises(LayoutError, match=rf"metadata qwen3moe\.{key} is missing or not a positive int"):
        build_layout(open_model(path))


@pytest.mark.parametrize(
    ("value", "vtype"),
    [
        (0, GGUFValueType.UINT32),
        (-2, GGUFValueType.INT32),
        (8.0, GGUFValueType.FLOAT32),
        ("8", GGUFValueType.STRING),
        (True, GGUFValueType.BOOL),
    ],
)
def test_metadata_not_a_positive_int(tmp_path: Path, value: object, vtype: GGUFValueType) -> None:
    kv = kit.moe_kv()
    kv["qwen3moe.expert_count"] = (value, vtype)
    path = kit.write_gguf(tmp_path / "l.gguf", kit.as_specs(kit.moe_layer(0)), kv=kv)
    with pytest.raises(LayoutError, match=r"qwen3moe\.expert_count is missing or not a positive int"):
        build_layout(open_model(path))


def test_a_dense_model_or_a_miss_tier_sidecar_is_said_to_be_one(tmp_path: Path) -> None:
    """Without ``expert_count`` the file is not an MoE model: a dense llama was "llama.expert_count is
    missing or not a positive int", a sidecar "aioexperts-miss-tier.expert_count is missing ..."."""
    kv = {k: v for k, v in kit.moe_kv("llama").items() if not k.endswith(".expert_count")}
    dense = kit.write_gguf(tmp_path / "dense.gguf", kit.as_specs(kit.moe_layer(0)), arch="llama", kv=kv)
    with pytest.raises(LayoutError) as dense_error:
        build_layout(open_model(dense))
    assert str(dense_error.value) == (
        f"{dense} is not a MoE model (no llama.expert_count): aioexperts streams the experts of MoE models"
    )
    model = tmp_path / "m.gguf"
    write_synthetic_model(model, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    sidecar = write_miss_tier(model, tmp_path / "m.tier.gguf", "Q2_K")
    with pytest.raises(LayoutError) as sidecar_error:
        build_layout(open_model(sidecar))
    assert str(sidecar_error.value) == f"{sidecar} is a miss-tier sidecar of m.gguf, not a model: pass the model"


@pytest.mark.parametrize(
    "name",
    [
        "blk." + "1" * 5000 + ".ffn_gate_exps.weight",
        "blk." + "1" * 5000 + ".ffn_gate_inp.weight",
        "blk.0.ffn_gate_exps_tier" + "1" * 5000 + ".weight",
    ],
    ids=["layer", "router", "tier"],
)
def test_absurd_layer_number_in_a_tensor_name(tmp_path: Path, name: str) -> None:
    layer = kit.moe_layer(0)
    layer[name] = ([32, 32, 8], Q.F32) if "exps" in name else ([32, 8], Q.F32)
    model = open_model(_write(tmp_path, [layer]))
    with pytest.raises(LayoutError):
        build_layout(model)


def test_non_canonical_layer_number_does_not_shadow_a_tensor(tmp_path: Path) -> None:
    layer = kit.moe_layer(1)
    layer["blk.01.ffn_down_exps.weight"] = ([32, 32, 8], Q.F32)  # written after the real one
    path = _write(tmp_path, [layer])
    model = open_model(path)
    try:
        layout = build_layout(model)
    except LayoutError:
        return  # refusing the ambiguity is fine
    assert layout.layer(1).banks[0].down.name == "blk.1.ffn_down_exps.weight"


def test_expert_tensors_past_block_count_are_a_layout_error(tmp_path: Path) -> None:
    """A ``block_count`` below the blocks the tensors use was a ``ConfigError`` at load ("layer 1 has
    no routed experts") naming neither the file nor the key."""
    path = write_synthetic_model(
        tmp_path / "m.gguf", SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2)
    )[0]
    model = open_model(path)
    key = f"{model.architecture}.block_count"
    assert model.metadata[key] == 2 and len(build_layout(model).layers) == 2
    kit.patch_u32(path, kit.kv_value_offset(path, key), 1)
    with pytest.raises(LayoutError, match=rf"tensors of block 1, but {re.escape(key)}=1 \(blocks 0\.\.0\)"):
        build_layout(open_model(path))
    kit.patch_u32(path, kit.kv_value_offset(path, key), 0)  # zero: no blocks at all, not "unknown"
    with pytest.raises(LayoutError, match=rf"tensors of block 0, but {re.escape(key)}=0 \(no blocks\)"):
        build_layout(open_model(path))
