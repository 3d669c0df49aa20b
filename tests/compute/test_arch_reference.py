"""Every architecture the table in docs/executor.md marks implemented, against an independent reference.

For each arch a small F32 model is written byte by byte (``gguf_bytes``), opened with
``aioexperts.open`` and run through ``moe_result`` (metadata -> hparams -> layout -> resident
tensors -> routing -> experts). The expected output comes from :func:`reference`, a float64 transcription
of llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp) and of each arch's call site, whose arguments are
written out per case below from the arch's ``src/models/*.cpp`` graph and its hparams loader. The
reference imports nothing from aioexperts. Metadata keys that an arch's loader does not read (a weight
scale for llama, dbrx, grok...) are put in the files on purpose: the reference ignores them as llama.cpp
does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf_bytes as gb
import numpy as np
import pytest
from gguf import GGUFValueType
from moe_session import moe_session

from aioexperts._format.archs import STATUSES as ARCHITECTURES
from aioexperts._format.hparams import Status

T = GGUFValueType
N_EMBD, N_FF, N_EXPERT, K, N_TOKENS = 32, 16, 8, 2, 5
WEIGHTS_SUM_MIN = 6.103515625e-5  # llama-graph.cpp: clamp of the weight sum, smallest normal f16


@dataclass(frozen=True)
class Case:
    """One arch's MoE block as llama.cpp builds it (the arguments of its build_moe_ffn call).

    gating: "softmax" | "sigmoid" | "softmax_weight"; norm: norm_w; scale: w_scale as the loader leaves
    it (0 when the loader never reads expert_weights_scale); act: "silu" | "swiglu_oai" | "gelu";
    shared: "none" | "ungated" | "sigmoid"; groups: (n_expert_groups, n_group_used) or None.
    """

    arch: str
    source: str
    gating: str
    norm: bool
    scale: float = 0.0
    act: str = "silu"
    probs_bias: bool = False  # exp_probs_b passed to build_moe_ffn
    router_bias: bool = False
    expert_biases: bool = False
    shared: str = "none"
    n_ff_shexp: int = 0
    groups: tuple[int, int] | None = None
    select_on_logits: bool = False  # llama4: selection_probs = logits
    weight_before_ffn: bool = False  # llama4
    expert_width_key: str = "expert_feed_forward_length"  # which key sizes the experts
    moe_blocks: tuple[int, ...] = (0, 1)
    block_count: int = 2
    kv: dict[str, object] = field(default_factory=dict)  # extra {arch}.<key>: value (u32 or f32)


CASES = [
    Case("qwen2moe", "qwen2moe.cpp: SOFTMAX, norm_w=false, shared * sigmoid(gate_inp_shexp)", "softmax", False,
         shared="sigmoid", n_ff_shexp=24, kv={"expert_shared_feed_forward_length": 24}),
    Case("qwen3moe", "qwen3moe.cpp: SOFTMAX, norm_w=true", "softmax", True, kv={"expert_weights_scale": 3.0}),
    Case("qwen3vlmoe", "qwen3vl-moe.cpp: SOFTMAX, norm_w=true, w_scale 0", "softmax", True),
    Case("qwen3next", "qwen3next.cpp build_layer_ffn: SOFTMAX, norm_w=true, sigmoid-gated shared", "softmax", True,
         shared="sigmoid", n_ff_shexp=24, kv={"expert_shared_feed_forward_length": 24}),
    Case("llama", "llama.cpp MoE branch: SOFTMAX, norm_w=true, scale key not read", "softmax", True,
         expert_width_key="feed_forward_length", kv={"expert_weights_scale": 2.0}),
    Case("granitemoe", "granite.cpp build_layer_ffn: SOFTMAX, norm_w=true, w_scale 0", "softmax", True,
         expert_width_key="feed_forward_length"),
    Case("granitemoe", "granite.cpp: Granite MoE Shared (ungated shared expert)", "softmax", True,
         expert_width_key="feed_forward_length", shared="ungated", n_ff_shexp=24,
         kv={"expert_shared_feed_forward_length": 24}),
    Case("granite", "granite.cpp build_layer_ffn (granite with experts)", "softmax", True,
         expert_width_key="feed_forward_length"),
    Case("olmoe", "olmoe.cpp: SOFTMAX, norm_w=false", "softmax", False, expert_width_key="feed_forward_length"),
    Case("deepseek", "deepseek.cpp: SOFTMAX, norm_w=false, scale_w=false, dense lead, shared", "softmax", False,
         shared="ungated", n_ff_shexp=2 * N_FF, moe_blocks=(1, 2), block_count=3,
         kv={"leading_dense_block_count": 1, "expert_shared_count": 2, "expert_weights_scale": 2.5}),
    Case("deepseek2", "deepseek2.cpp + loader: gating/norm/scale keys, exp_probs_b, groups", "sigmoid", True, 2.5,
         probs_bias=True, groups=(4, 2), shared="ungated", n_ff_shexp=N_FF, moe_blocks=(1, 2), block_count=3,
         kv={"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_gating_func": 2,
             "expert_weights_norm": 1, "expert_weights_scale": 2.5, "expert_group_count": 4,
             "expert_group_used_count": 2}),
    Case("deepseek2", "deepseek2 loader: no expert_gating_func -> SOFTMAX (V2/V2.5)", "softmax", False, 1.0,
         shared="ungated", n_ff_shexp=N_FF, kv={"expert_shared_count": 1, "expert_weights_scale": 1.0}),
    Case("glm4moe", "glm4-moe.cpp: no gating key -> SIGMOID, norm/scale keys, exp_probs_b, groups", "sigmoid", True,
         2.5, probs_bias=True, groups=(4, 2), shared="ungated", n_ff_shexp=N_FF, moe_blocks=(1, 2), block_count=3,
         kv={"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_norm": 1,
             "expert_weights_scale": 2.5, "expert_group_count": 4, "expert_group_used_count": 2}),
    Case("gpt-oss", "openai-moe-iswa.cpp: SOFTMAX_WEIGHT, swiglu_oai, router and expert biases", "softmax_weight",
         False, act="swiglu_oai", router_bias=True, expert_biases=True),
    Case("dbrx", "dbrx.cpp: SOFTMAX, norm_w=true, scale key not read", "softmax", True,
         expert_width_key="feed_forward_length", kv={"expert_weights_scale": 4.0}),
    Case("phimoe", "phi3.cpp MoE branch: SOFTMAX, norm_w=true", "softmax", True,
         expert_width_key="feed_forward_length"),
    Case("ernie4_5-moe", "ernie4-5-moe.cpp: SOFTMAX, norm_w=true, exp_probs_b, every 2nd block, shared", "softmax",
         True, probs_bias=True, shared="ungated", n_ff_shexp=24, moe_blocks=(1, 3), block_count=4,
         kv={"interleave_moe_layer_step": 2, "leading_dense_block_count": 0, "expert_shared_feed_forward_length": 24}),
    Case("hunyuan-moe", "hunyuan-moe.cpp: SOFTMAX, norm_w=true, shared mlp of width key-or-n_ff", "softmax", True,
         expert_width_key="feed_forward_length", shared="ungated", n_ff_shexp=N_FF,
         kv={"expert_feed_forward_length": 99}),
    Case("bailingmoe", "bailingmoe.cpp: SOFTMAX, norm key, scale key, shared count x n_ff_exp", "softmax", True, 2.0,
         shared="ungated", n_ff_shexp=N_FF,
         kv={"expert_shared_count": 1, "expert_weights_norm": 1, "expert_weights_scale": 2.0}),
    Case("bailingmoe2", "bailingmoe2.cpp: gating/norm/scale keys, exp_probs_b, groups, dense lead, NextN",
         "sigmoid", True, 2.5, probs_bias=True, groups=(4, 2), shared="ungated", n_ff_shexp=2 * 12,
         moe_blocks=(1, 2, 3), block_count=4,
         kv={"leading_dense_block_count": 1, "expert_shared_count": 2, "expert_shared_feed_forward_length": 12,
             "expert_gating_func": 2, "expert_weights_norm": 1, "expert_weights_scale": 2.5,
             "expert_group_count": 4, "expert_group_used_count": 2, "nextn_predict_layers": 1}),
    Case("dots1", "dots1.cpp: gating/norm/scale keys, exp_probs_b, dense lead, shared", "sigmoid", True, 2.5,
         probs_bias=True, shared="ungated", n_ff_shexp=N_FF, moe_blocks=(1, 2), block_count=3,
         kv={"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_gating_func": 2,
             "expert_weights_norm": 1, "expert_weights_scale": 2.5}),
    Case("grok", "grok.cpp: SOFTMAX, norm_w=true, LLM_FFN_GELU, scale key not read", "softmax", True, act="gelu",
         kv={"expert_weights_scale": 2.0}),
    Case("minimax-m2", "minimax-m2.cpp: gating key, norm_w=true, exp_probs_b, scale key not read", "sigmoid", True,
         probs_bias=True, kv={"expert_gating_func": 2, "expert_weights_scale": 3.0}),
    Case("llama4", "llama-iswa.cpp + build_moe_ffn LLM_ARCH_LLAMA4: top-k on logits, weight_before_ffn",
         "sigmoid", False, select_on_logits=True, weight_before_ffn=True, shared="ungated", n_ff_shexp=N_FF,
         moe_blocks=(1, 3), block_count=4, kv={"interleave_moe_layer_step": 2}),
]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the independent float64 reference (llama-graph.cpp build_moe_ffn and build_ffn, transcribed)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _act(case: Case, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    if case.act == "silu":  # ggml_swiglu_split
        return g * _sigmoid(g) * u
    if case.act == "gelu":  # ggml_geglu_split, tanh approximation
        return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * g * (1.0 + 0.044715 * g * g))) * u
    # ggml_swiglu_oai: alpha 1.702, limit 7
    g = np.minimum(g, 7.0)
    u = np.clip(u, -7.0, 7.0)
    return g * _sigmoid(1.702 * g) * (u + 1.0)


def reference(case: Case, x: np.ndarray, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float64 build_moe_ffn (+ the shared expert as each graph adds it) for one block."""
    logits = x @ w["router"].T
    if case.router_bias:
        logits = logits + w["router_bias"]
    probs = {"softmax": _softmax, "sigmoid": _sigmoid, "softmax_weight": lambda v: v}[case.gating](logits)
    selection = probs + w["probs_bias"] if case.probs_bias else probs
    if case.select_on_logits:
        selection = logits
    if case.groups is not None:
        n_groups, n_used = case.groups
        grouped = selection.reshape(len(x), n_groups, -1)
        group_scores = np.sort(grouped, axis=2)[:, :, ::-1][:, :, :2].sum(axis=2)
        keep = np.argsort(-group_scores, axis=1, kind="stable")[:, :n_used]
        mask = np.full(grouped.shape, -np.inf)
        for t in range(len(x)):
            mask[t, keep[t]] = grouped[t, keep[t]]
        selection = mask.reshape(len(x), -1)
    ids = np.argsort(-selection, axis=1, kind="stable")[:, :K]
    weights = np.take_along_axis(probs, ids, axis=1)
    if case.gating == "softmax_weight":
        weights = _softmax(weights)
    if case.norm:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), WEIGHTS_SUM_MIN)
    if case.scale not in (0.0, 1.0):
        weights = weights * case.scale
    moe = np.zeros_like(x)
    for t in range(len(x)):
        for slot in range(K):
            e = ids[t, slot]
            xe = x[t] * weights[t, slot] if case.weight_before_ffn else x[t]
            g = w["gate"][e] @ xe
            u = w["up"][e] @ xe
            if case.expert_biases:
                g, u = g + w["gate_b"][e], u + w["up_b"][e]
            y = w["down"][e] @ _act(case, g, u)
            if case.expert_biases:
                y = y + w["down_b"][e]
            moe[t] += y if case.weight_before_ffn else weights[t, slot] * y
    out = {"ids": ids, "weights": weights, "moe_out": moe, "ffn_out": moe}
    if case.shared != "none":  # build_ffn(..., LLM_FFN_SILU, LLM_FFN_PAR)
        h = x @ w["sh_gate"].T
        s = (h * _sigmoid(h) * (x @ w["sh_up"].T)) @ w["sh_down"].T
        if case.shared == "sigmoid":
            s = s * _sigmoid(x @ w["sh_gate_inp"])[:, None]
        out["shared_out"] = s
        out["ffn_out"] = moe + s
    return out


# --------------------------------------------------------------------------------------------------
# the files


def _write(case: Case, path: Path, seed: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    f = gb.GGUFBytes().add("general.architecture", T.STRING, case.arch)
    base = {"block_count": case.block_count, "embedding_length": N_EMBD, "expert_count": N_EXPERT,
            "expert_used_count": K, case.expert_width_key: N_FF}  # fmt: skip
    for key, value in {**base, **case.kv}.items():
        if isinstance(value, float):
            f.add(f"{case.arch}.{key}", T.FLOAT32, value)
        else:
            f.add(f"{case.arch}.{key}", T.UINT32, value)
    weights: dict[int, dict[str, np.ndarray]] = {}

    def tensor(name: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        f.tensors.append(gb.Tensor(name, list(reversed(shape)), data=a.tobytes()))
        return a.astype(np.float64)

    for b in case.moe_blocks:
        p = f"blk.{b}."
        w = {
            "router": tensor(p + "ffn_gate_inp.weight", (N_EXPERT, N_EMBD), 0.5),
            "gate": tensor(p + "ffn_gate_exps.weight", (N_EXPERT, N_FF, N_EMBD), 0.4 if case.act == "silu" else 1.0),
            "up": tensor(p + "ffn_up_exps.weight", (N_EXPERT, N_FF, N_EMBD), 0.4 if case.act == "silu" else 1.5),
            "down": tensor(p + "ffn_down_exps.weight", (N_EXPERT, N_EMBD, N_FF), 0.3),
        }
        if case.router_bias:
            w["router_bias"] = tensor(p + "ffn_gate_inp.bias", (N_EXPERT,), 0.5)
        if case.probs_bias:
            w["probs_bias"] = tensor(p + "exp_probs_b.bias", (N_EXPERT,), 0.3)
        if case.expert_biases:
            w["gate_b"] = tensor(p + "ffn_gate_exps.bias", (N_EXPERT, N_FF), 0.5)
            w["up_b"] = tensor(p + "ffn_up_exps.bias", (N_EXPERT, N_FF), 0.5)
            w["down_b"] = tensor(p + "ffn_down_exps.bias", (N_EXPERT, N_EMBD), 0.5)
        if case.shared != "none":
            w["sh_gate"] = tensor(p + "ffn_gate_shexp.weight", (case.n_ff_shexp, N_EMBD), 0.3)
            w["sh_up"] = tensor(p + "ffn_up_shexp.weight", (case.n_ff_shexp, N_EMBD), 0.3)
            w["sh_down"] = tensor(p + "ffn_down_shexp.weight", (N_EMBD, case.n_ff_shexp), 0.3)
        if case.shared == "sigmoid":
            w["sh_gate_inp"] = tensor(p + "ffn_gate_inp_shexp.weight", (N_EMBD,), 0.5)
        weights[b] = w
    path.write_bytes(f.build())
    return weights


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.mark.anyio
@pytest.mark.parametrize("case", CASES, ids=[f"{c.arch}-{i}" for i, c in enumerate(CASES)])
async def test_arch_matches_the_float64_reference(tmp_path: Path, case: Case, anyio_backend: object) -> None:
    path = tmp_path / f"{case.arch}.gguf"
    weights = _write(case, path, seed=len(case.arch))
    x = np.random.default_rng(11).standard_normal((N_TOKENS, N_EMBD)).astype(np.float32)
    nextn = int(case.kv.get("nextn_predict_layers", 0))  # type: ignore[call-overload]
    run_blocks = [b for b in case.moe_blocks if b < case.block_count - nextn]
    async with moe_session(path, slots=N_EXPERT) as session:
        assert list(session.layout.layers) == run_blocks
        assert session.hparams.status in (Status.GOLDEN, Status.SOURCE)
        for block in run_blocks:
            want = reference(case, x.astype(np.float64), weights[block])
            got = await session.moe_result(block, x)
            np.testing.assert_array_equal(got.ids, want["ids"], err_msg=f"block {block}: {case.source}")
            np.testing.assert_allclose(got.weights, want["weights"], rtol=2e-5, atol=1e-6)
            assert _rel(got.moe_out, want["moe_out"]) < 1e-5
            assert _rel(got.ffn_out, want["ffn_out"]) < 1e-5
            if case.shared == "none":
                assert got.shared_out is None
            else:
                assert got.shared_out is not None
                assert _rel(got.shared_out, want["shared_out"]) < 1e-5


def test_every_implemented_arch_has_a_reference_case() -> None:
    from test_arch_reference_v4 import ARCHS as V4_ARCHS  # deepseek4, qwen35moe: their own file

    implemented = {a for a, status in ARCHITECTURES.items() if status in (Status.GOLDEN, Status.SOURCE)}
    assert implemented == {c.arch for c in CASES} | set(V4_ARCHS)
