"""DeepSeek-V4 (``deepseek4``) and Qwen3.5-MoE (``qwen35moe``) MoE blocks against a float64 reference.

Each file is written byte by byte (``gguf_bytes``) with the architecture's tensor names, shapes and keys
(llama.cpp ``src/models/deepseek4.cpp`` / ``qwen35moe.cpp`` ``load_arch_hparams`` and
``load_arch_tensors``) and random weights, opened with ``aioexperts.open`` and run through the runner.
The expected output is :func:`reference_deepseek4` / :func:`reference_qwen35moe`, float64 transcriptions of
each graph's MoE block (``build_moe_ffn`` and ``build_ffn`` of src/llama-graph.cpp with the arguments of
the arch's call sites); routed experts of a quantized file are dequantized by gguf-py. Nothing here
imports the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import gguf_bytes as gb
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from moe_session import moe_session

import aioexperts
import aioexperts.predictors
from aioexperts._format.hparams import GatingFunc, Status
from aioexperts.testing._blocks import draw_blocks

Q = GGMLQuantizationType
T = GGUFValueType
K, N_EXPERT, N_TOKENS, N_VOCAB = 2, 8, 6, 40
WEIGHTS_SUM_MIN = 6.103515625e-5  # llama-graph.cpp build_moe_ffn: clamp of the weight sum
QUANT_TOLERANCE = 4e-2  # relative L2, as for llama.cpp's quantized goldens (tests/conftest.py)

#: The archs this file covers (test_arch_reference.py checks every implemented arch has a reference).
ARCHS = ("deepseek4", "qwen35moe")


@dataclass(frozen=True)
class Geometry:
    n_embd: int
    widths: tuple[int, ...]  # expert_feed_forward_length per block (deepseek4: a per-block array)
    expert_type: GGMLQuantizationType


_F16_SCALES = {Q.Q2_K: (80, 82), Q.Q4_K: (0, 2)}  # ggml-common.h block_q2_K / block_q4_K: d, dmin

F32_GEOMETRY = Geometry(32, (16, 24, 16, 16), Q.F32)
QUANT_GEOMETRIES = [Geometry(256, (256, 512, 256, 256), t) for t in (Q.Q2_K, Q.Q4_K, Q.Q8_0, Q.MXFP4)]


# --------------------------------------------------------------------------------------------------
# float64 references (llama.cpp's graphs, transcribed)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """``ggml_swiglu_split``, or ``ggml_swiglu_clamp`` when ``limit > 1e-6`` (deepseek4)."""
    if limit > 1e-6:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return g * _sigmoid(g) * u


def _weights(probs: np.ndarray, ids: np.ndarray, norm: bool, scale: float) -> np.ndarray:
    w = np.take_along_axis(probs, ids, axis=1)
    if norm:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), WEIGHTS_SUM_MIN)
    if scale not in (0.0, 1.0):
        w = w * scale
    return w


def _routed(x: np.ndarray, w: dict[str, np.ndarray], ids: np.ndarray, weights: np.ndarray, limit: float,
            scales: bool = False) -> np.ndarray:  # fmt: skip
    moe = np.zeros_like(x)
    for t in range(len(x)):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            g, u = w["gate"][e] @ x[t], w["up"][e] @ x[t]
            if scales:  # build_lora_mm_id: the per-expert scale multiplies the product
                g, u = g * w["gate_s"][e], u * w["up_s"][e]
            y = w["down"][e] @ _swiglu(g, u, limit)
            if scales:
                y = y * w["down_s"][e]
            moe[t] += weights[t, slot] * y
    return moe


def reference_deepseek4(x: np.ndarray, w: dict[str, np.ndarray], block: int, meta: dict, token_ids: np.ndarray) -> dict:
    """deepseek4.cpp: build_moe_ffn(SILU, norm_w key, w_scale key, sqrtsoftplus, selected_experts = tid2eid rows
    in the first hash_layer_count blocks with exp_probs_b = nullptr) + build_ffn(shared, SILU, PAR)."""
    logits = x @ w["router"].T
    softplus = np.where(logits > 20.0, logits, np.log(1.0 + np.exp(np.minimum(logits, 20.0))))  # op_softplus
    probs = np.sqrt(softplus)
    if block < meta["hash_layer_count"]:
        ids = w["tid2eid"][token_ids]
    else:
        ids = np.argsort(-(probs + w["probs_bias"]), axis=1, kind="stable")[:, :K]
    weights = _weights(probs, ids, meta["expert_weights_norm"], meta["expert_weights_scale"])
    moe = _routed(x, w, ids, weights, meta["swiglu_clamp_exp"][block])
    h, u = x @ w["sh_gate"].T, x @ w["sh_up"].T
    shared = _swiglu(h, u, meta["swiglu_clamp_shexp"][block]) @ w["sh_down"].T
    return {"ids": ids, "weights": weights, "moe_out": moe, "shared_out": shared, "ffn_out": moe + shared}


def reference_qwen35moe(x: np.ndarray, w: dict[str, np.ndarray], block: int, meta: dict, token_ids: np.ndarray) -> dict:
    """qwen35moe.cpp build_layer_ffn: build_moe_ffn(SILU, norm_w=true, SOFTMAX, *_exps_s scales) + build_ffn
    (shared, *_shexp_s scales) * sigmoid(ffn_gate_inp_shexp . x)."""
    probs = _softmax(x @ w["router"].T)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :K]
    weights = _weights(probs, ids, True, 0.0)
    moe = _routed(x, w, ids, weights, 0.0, scales=True)
    h, u = (x @ w["sh_gate"].T) * w["sh_gate_s"], (x @ w["sh_up"].T) * w["sh_up_s"]
    shared = (_swiglu(h, u, 0.0) @ w["sh_down"].T) * w["sh_down_s"]
    shared = shared * _sigmoid(x @ w["sh_gate_inp"])[:, None]
    return {"ids": ids, "weights": weights, "moe_out": moe, "shared_out": shared, "ffn_out": moe + shared}


REFERENCES = {"deepseek4": reference_deepseek4, "qwen35moe": reference_qwen35moe}


# --------------------------------------------------------------------------------------------------
# the files


def _u32s(values: list[int]) -> gb.Arr:
    return gb.Arr(T.UINT32, values)


def write_model(
    arch: str,
    path: Path,
    geo: Geometry,
    seed: int,
    *,
    vision_bias: bool = False,
    table_fault: str = "",
    merged_gate_up: bool = False,
) -> tuple[dict[int, dict[str, np.ndarray]], dict]:
    """Write a 4-block model of ``arch`` (deepseek4: block 3 is a NextN block); returns the float64
    weights of the MoE blocks and the metadata the reference reads."""
    rng = np.random.default_rng(seed)
    n_embd, blocks = geo.n_embd, len(geo.widths)
    f = gb.GGUFBytes().add("general.architecture", T.STRING, arch)
    f.add(f"{arch}.block_count", T.UINT32, blocks).add(f"{arch}.embedding_length", T.UINT32, n_embd)
    f.add(f"{arch}.expert_count", T.UINT32, N_EXPERT).add(f"{arch}.expert_used_count", T.UINT32, K)
    meta: dict = {}
    if arch == "deepseek4":
        meta = {"hash_layer_count": 2, "expert_weights_norm": True, "expert_weights_scale": 1.5,
                "swiglu_clamp_exp": [1.5, 2.0, 0.0, 1.0], "swiglu_clamp_shexp": [0.0, 1.25, 1.75, 1.0]}  # fmt: skip
        f.add("deepseek4.expert_feed_forward_length", T.ARRAY, _u32s(list(geo.widths)))
        f.add("deepseek4.expert_shared_count", T.UINT32, 1)
        f.add("deepseek4.expert_weights_scale", T.FLOAT32, meta["expert_weights_scale"])
        f.add("deepseek4.expert_weights_norm", T.BOOL, True)
        f.add("deepseek4.expert_gating_func", T.UINT32, 4)  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
        f.add("deepseek4.hash_layer_count", T.UINT32, meta["hash_layer_count"])
        f.add("deepseek4.nextn_predict_layers", T.UINT32, 1)
        f.add("deepseek4.swiglu_clamp_exp", T.ARRAY, gb.Arr(T.FLOAT32, meta["swiglu_clamp_exp"]))
        f.add("deepseek4.swiglu_clamp_shexp", T.ARRAY, gb.Arr(T.FLOAT32, meta["swiglu_clamp_shexp"]))
        f.add("deepseek4.hyper_connection_count", T.UINT32, 4)  # not MoE: read by the attention only
        moe_blocks = list(range(blocks - 1))  # the last block is the MTP block: left out
    else:
        f.add("qwen35moe.expert_feed_forward_length", T.UINT32, geo.widths[0])
        f.add("qwen35moe.expert_shared_feed_forward_length", T.UINT32, 2 * geo.widths[0])
        f.add("qwen35moe.full_attention_interval", T.UINT32, 4)
        moe_blocks = list(range(blocks))
    weights: dict[int, dict[str, np.ndarray]] = {}

    def f32(name: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        f.tensors.append(gb.Tensor(name, list(reversed(shape)), data=a.tobytes()))
        return a.astype(np.float64)

    def experts(name: str, shape: tuple[int, int, int], scale: float) -> np.ndarray:
        if geo.expert_type == Q.F32:
            return f32(name, shape, scale)
        block, size = gguf.GGML_QUANT_SIZES[geo.expert_type]
        n_blocks = int(np.prod(shape)) // block
        raw = draw_blocks(rng, geo.expert_type, n_blocks, scale)
        if raw is None:  # K-quants: random bytes with the f16 super-block scales set (d, dmin)
            raw = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), np.uint8).reshape(n_blocks, size)
            for offset in _F16_SCALES[geo.expert_type]:
                d = (rng.uniform(0.5, 1.5, n_blocks) * scale / 8).astype(np.float16)
                raw[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
        data = np.ascontiguousarray(raw).tobytes()
        f.tensors.append(gb.Tensor(name, list(reversed(shape)), geo.expert_type, data))
        row_bytes = shape[2] // block * size
        values = gguf.quants.dequantize(np.frombuffer(data, np.uint8).reshape(-1, row_bytes), geo.expert_type)
        return values.reshape(shape).astype(np.float64)

    for b in range(blocks):
        # qwen35moe.cpp creates every block n_ff_exp() (block 0's width) wide
        p, n_ff = f"blk.{b}.", geo.widths[b] if arch == "deepseek4" else geo.widths[0]
        amp = 0.4 if geo.expert_type == Q.F32 else n_embd**-0.5 * 2
        w = {
            "router": f32(p + "ffn_gate_inp.weight", (N_EXPERT, n_embd), 0.5 if n_embd == 32 else 0.1),
            "gate": experts(p + "ffn_gate_exps.weight", (N_EXPERT, n_ff, n_embd), amp),
            "up": experts(p + "ffn_up_exps.weight", (N_EXPERT, n_ff, n_embd), amp),
            "down": experts(p + "ffn_down_exps.weight", (N_EXPERT, n_embd, n_ff), amp / 2),
        }
        if merged_gate_up:  # one ffn_gate_up_exps bank {n_embd, 2 n_ff, n_expert}: gate rows, then up rows
            merged = np.concatenate([w["gate"], w["up"]], axis=1).astype(np.float32)
            names = (p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight")
            f.tensors = [t for t in f.tensors if t.name not in names]
            f.tensors.append(
                gb.Tensor(p + "ffn_gate_up_exps.weight", list(reversed(merged.shape)), data=merged.tobytes())
            )
        if arch == "deepseek4":
            n_sh = n_ff  # n_ff_exp * expert_shared_count
            if b < meta["hash_layer_count"]:  # {n_expert_used, n_vocab} I32: K distinct experts per token id
                table = np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(N_VOCAB)]).astype(np.int32)
                if table_fault == "id out of range" and b == 1:
                    table[N_VOCAB // 2, 1] = N_EXPERT
                if table_fault != "no table" or b != 1:
                    f.tensors.append(gb.Tensor(p + "ffn_gate_tid2eid.weight", [K, N_VOCAB], Q.I32, table.tobytes()))
                w["tid2eid"] = table
            else:
                w["probs_bias"] = f32(p + "exp_probs_b.bias", (N_EXPERT,), 0.3)
            if vision_bias:  # DeepSeek-V4 vision: the routing bias of image tokens
                f32(p + "exp_probs_b_vl.bias", (N_EXPERT,), 0.3)
        else:
            n_sh = 2 * n_ff
            w["sh_gate_inp"] = f32(p + "ffn_gate_inp_shexp.weight", (n_embd,), 0.5 if n_embd == 32 else 0.1)
            for proj in ("gate", "up", "down"):  # the optional scales qwen35moe applies
                per_expert = rng.uniform(0.5, 1.5, N_EXPERT).astype(np.float32)
                f.tensors.append(gb.Tensor(p + f"ffn_{proj}_exps.scale", [N_EXPERT], data=per_expert.tobytes()))
                w[f"{proj}_s"] = per_expert.astype(np.float64)
                value = np.float32(rng.uniform(0.5, 1.5))
                f.tensors.append(gb.Tensor(p + f"ffn_{proj}_shexp.scale", [1], data=value.tobytes()))
                w[f"sh_{proj}_s"] = np.float64(value)
        sh_amp = 0.3 if n_embd == 32 else n_embd**-0.5
        w["sh_gate"] = f32(p + "ffn_gate_shexp.weight", (n_sh, n_embd), sh_amp)
        w["sh_up"] = f32(p + "ffn_up_shexp.weight", (n_sh, n_embd), sh_amp)
        w["sh_down"] = f32(p + "ffn_down_shexp.weight", (n_embd, n_sh), sh_amp)
        if b in moe_blocks:
            weights[b] = w
    path.write_bytes(f.build())
    return weights, meta


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def _inputs(n_embd: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N_TOKENS, n_embd)).astype(np.float32)
    return x, np.array([0, 5, 5, 17, 39, 22], dtype=np.int32)  # a repeated id, the last id of the vocabulary


# --------------------------------------------------------------------------------------------------
# the tests

MEASURED: dict[str, float] = {}  # arch-type -> max rel L2 error seen (printed by -s for the report)

CASES = [pytest.param(a, F32_GEOMETRY, id=f"{a}-F32") for a in ARCHS] + [
    pytest.param(a, g, id=f"{a}-{g.expert_type.name}") for a in ARCHS for g in QUANT_GEOMETRIES
]


@pytest.mark.anyio
@pytest.mark.parametrize(("arch", "geo"), CASES)
async def test_moe_block_matches_the_float64_reference(tmp_path: Path, arch: str, geo: Geometry,
                                                       anyio_backend: object) -> None:  # fmt: skip
    path = tmp_path / f"{arch}.gguf"
    weights, meta = write_model(arch, path, geo, seed=len(arch) + int(geo.expert_type))
    x, token_ids = _inputs(geo.n_embd)
    tol = 1e-5 if geo.expert_type == Q.F32 else QUANT_TOLERANCE
    worst = 0.0
    async with moe_session(path, slots=N_EXPERT) as session:
        assert list(session.layout.layers) == sorted(weights)  # deepseek4's NextN block is left out
        assert session.hparams.status == Status.SOURCE
        for block, w in weights.items():
            want = REFERENCES[arch](x.astype(np.float64), w, block, meta, token_ids)
            got = await session.moe_result(block, x, token_ids=token_ids)
            np.testing.assert_array_equal(got.ids, want["ids"], err_msg=f"{arch} block {block}")
            if "tid2eid" in w:  # hash routing: the ids are the table's rows, in slot order
                np.testing.assert_array_equal(got.ids, w["tid2eid"][token_ids])
            np.testing.assert_allclose(got.weights, want["weights"], rtol=2e-5, atol=1e-6)
            assert got.shared_out is not None
            for part in ("moe_out", "shared_out", "ffn_out"):
                err = _rel(getattr(got, part), want[part])
                worst = max(worst, err)
                assert err < (1e-5 if part == "shared_out" else tol), (block, part, err)
            one = await session.moe_result(block, x[3:4], token_ids=token_ids[3:4])  # decode: fused kernels
            np.testing.assert_array_equal(one.ids, want["ids"][3:4])
            err = _rel(one.moe_out, want["moe_out"][3:4])
            worst = max(worst, err)
            assert err < tol, (block, "one token", err)
    MEASURED[f"{arch}-{geo.expert_type.name}"] = worst
    print(f"\n{arch} {geo.expert_type.name}: max rel L2 {worst:.3g} (bound {tol:g})")


@pytest.mark.anyio
async def test_the_clamps_and_the_token_table_decide(tmp_path: Path, anyio_backend: object) -> None:
    """The file's clamps bite (a reference without them disagrees) and a hash block's ids are the table's,
    not the router's top-k."""
    path = tmp_path / "deepseek4.gguf"
    weights, meta = write_model("deepseek4", path, F32_GEOMETRY, seed=3)
    x, token_ids = _inputs(F32_GEOMETRY.n_embd)
    unclamped = {**meta, "swiglu_clamp_exp": [0.0] * 4, "swiglu_clamp_shexp": [0.0] * 4}
    async with moe_session(path, slots=N_EXPERT) as session:
        for block in (0, 1, 3 - 1):
            got = await session.moe_result(block, x, token_ids=token_ids)
            loose = reference_deepseek4(x.astype(np.float64), weights[block], block, unclamped, token_ids)
            clamped_exp, clamped_sh = meta["swiglu_clamp_exp"][block] > 0, meta["swiglu_clamp_shexp"][block] > 0
            assert (_rel(got.moe_out, loose["moe_out"]) > 1e-3) == clamped_exp, block
            assert (_rel(got.shared_out, loose["shared_out"]) > 1e-3) == clamped_sh, block
        got = await session.moe_result(0, x, token_ids=token_ids)
    top_k = np.argsort(-(x.astype(np.float64) @ weights[0]["router"].T), axis=1, kind="stable")[:, :K]
    assert not np.array_equal(np.sort(got.ids, axis=1), np.sort(top_k, axis=1))


@pytest.mark.anyio
async def test_hash_routed_layers_need_valid_token_ids_before_any_read(tmp_path: Path, anyio_backend: object) -> None:
    path = tmp_path / "deepseek4.gguf"
    write_model("deepseek4", path, F32_GEOMETRY, seed=5)
    x, token_ids = _inputs(F32_GEOMETRY.n_embd)
    async with moe_session(path, slots=N_EXPERT) as session:
        await session.warmup()
        before = session.store.statistics()
        bad = {
            "missing": None,
            "out of range": np.array([0, 1, 2, 3, 4, N_VOCAB], dtype=np.int32),
            "negative": np.array([0, 1, -1, 3, 4, 5], dtype=np.int64),
            "wrong length": token_ids[:3],
            "floats": token_ids.astype(np.float32),
            "a list of floats": [float(t) for t in token_ids],
            "bools": token_ids > 3,
            "strings": [str(t) for t in token_ids],
            "a ragged list": [[1, 2], 3, 4, 5, 6, 7],
            "a 2-D list": [token_ids.tolist()],
            "a str": "012345",
        }
        for what, ids in bad.items():
            for call in (
                lambda ids=ids: session.moe_result(0, x, token_ids=ids),
                lambda ids=ids: session.moe(1, x, token_ids=ids),
                lambda ids=ids: session.run_moe_layers(x, token_ids=ids),
            ):
                with pytest.raises(aioexperts.InvalidRequestError) as err:
                    await call()
                needle = {"missing": "routes by token id", "out of range": "must be in 0..39",
                          "negative": "must be in 0..39"}.get(what, "token_ids must be an integer array")  # fmt: skip
                assert needle in str(err.value), (what, str(err.value))
        assert session.store.statistics() == before  # nothing was read or even queued
        # a router-routed layer does not need them
        assert (await session.moe(2, x)).shape == x.shape


@pytest.mark.anyio
async def test_token_ids_may_be_any_integer_array_like(tmp_path: Path, anyio_backend: object) -> None:
    """A list, tuple or range of ints, numpy ints of any width: taken as numpy APIs take them."""
    path = tmp_path / "deepseek4.gguf"
    write_model("deepseek4", path, F32_GEOMETRY, seed=5)
    x, token_ids = _inputs(F32_GEOMETRY.n_embd)
    async with moe_session(path, slots=3 * N_EXPERT) as session:
        want = await session.moe_result(0, x, token_ids=token_ids)
        layers = await session.run_moe_layers(x, token_ids=token_ids, prefetch=False)
        for like in (
            token_ids.tolist(),
            tuple(token_ids.tolist()),
            [np.int16(t) for t in token_ids],
            token_ids.astype(np.uint8),
            token_ids.astype(np.int32)[::-1][::-1],  # a non-contiguous view
        ):
            got = await session.moe_result(0, x, token_ids=like)
            np.testing.assert_array_equal(got.ids, want.ids)
            np.testing.assert_array_equal(got.ffn_out, want.ffn_out)
            np.testing.assert_array_equal(await session.moe(0, x, token_ids=like), want.ffn_out)
            again = await session.run_moe_layers(x, token_ids=like, prefetch=False)
            for a, b in zip(again.steps, layers.steps, strict=True):
                np.testing.assert_array_equal(a.ids, b.ids)
        one = await session.moe_result(0, x[:3], token_ids=range(3))
        np.testing.assert_array_equal(one.ids, (await session.moe_result(0, x[:3], token_ids=np.arange(3))).ids)
        assert session.prefetch_token([int(token_ids[0])]) >= 0
        assert session.prefetch_token([]) == 0


@pytest.mark.anyio
async def test_run_token_and_prefetch_use_the_token_ids(tmp_path: Path, anyio_backend: object) -> None:
    path = tmp_path / "deepseek4.gguf"
    weights, meta = write_model("deepseek4", path, F32_GEOMETRY, seed=9)
    x, token_ids = _inputs(F32_GEOMETRY.n_embd)
    async with moe_session(path, slots=3 * N_EXPERT) as session:
        await session.warmup()
        wanted = {(b, int(e)) for b in (0, 1) for e in weights[b]["tid2eid"][token_ids[:1]].reshape(-1)}
        started = session.prefetch_token(token_ids[:1])
        assert started == len(wanted)  # the experts of both hash layers for that token, exactly
        result = await session.run_moe_layers(x[:1], token_ids=token_ids[:1])
        for step in result.steps[:2]:
            np.testing.assert_array_equal(step.ids, weights[step.layer]["tid2eid"][token_ids[:1]])
        with pytest.raises(aioexperts.InvalidRequestError, match="token_ids"):
            await session.run_moe_layers(x[:1])


def test_deepseek4_keys_are_read_as_llama_cpp_reads_them() -> None:
    base = {"deepseek4.block_count": 2, "deepseek4.embedding_length": 32, "deepseek4.expert_count": 8,
            "deepseek4.expert_used_count": 2, "deepseek4.expert_feed_forward_length": [16, 24],
            "deepseek4.expert_shared_count": 1, "deepseek4.expert_weights_scale": 1.5,
            "deepseek4.expert_weights_norm": True, "deepseek4.expert_gating_func": 4,
            "deepseek4.hash_layer_count": 1, "deepseek4.swiglu_clamp_exp": 7.0}  # fmt: skip
    hp = aioexperts.MoEHParams.from_metadata("deepseek4", base)
    assert hp.gating_func == GatingFunc.SQRT_SOFTPLUS
    assert [hp.expert_width(b) for b in (0, 1)] == [16, 24]
    assert hp.expert_clamp(1) == 7.0 and hp.shared_clamp(1) == 7.0  # clamp_shexp defaults to clamp_exp
    assert hp.is_hash_layer(0) and not hp.is_hash_layer(1)
    with pytest.raises(aioexperts.UnsupportedTypeError, match="sqrtsoftplus"):
        aioexperts.MoEHParams.from_metadata("deepseek4", {**base, "deepseek4.expert_gating_func": 2})
    for key in ("expert_gating_func", "expert_weights_norm", "hash_layer_count", "swiglu_clamp_exp"):
        with pytest.raises(aioexperts.FormatError, match=key):
            aioexperts.MoEHParams.from_metadata("deepseek4", {k: v for k, v in base.items() if not k.endswith(key)})
    with pytest.raises(aioexperts.FormatError, match="one per block"):
        aioexperts.MoEHParams.from_metadata("deepseek4", {**base, "deepseek4.swiglu_clamp_exp": [1.0, 2.0, 3.0]})


@pytest.mark.anyio
async def test_the_image_token_bias_is_refused(tmp_path: Path, anyio_backend: object) -> None:
    path = tmp_path / "deepseek4.gguf"
    write_model("deepseek4", path, F32_GEOMETRY, seed=2, vision_bias=True)
    async with moe_session(path, slots=N_EXPERT) as session:
        with pytest.raises(aioexperts.UnsupportedTypeError, match="exp_probs_b_vl"):
            await session.warmup()


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["id out of range", "no table"])
async def test_a_bad_token_table_is_refused(tmp_path: Path, fault: str, anyio_backend: object) -> None:
    path = tmp_path / "deepseek4.gguf"
    write_model("deepseek4", path, F32_GEOMETRY, seed=2, table_fault=fault)
    async with moe_session(path, slots=N_EXPERT) as session:
        with pytest.raises(aioexperts.FormatError, match="ffn_gate_tid2eid" if fault == "no table" else "outside 0..7"):
            await session.warmup()


@pytest.mark.anyio
async def test_prefetch_token_without_hash_layers_and_with_bad_ids(tmp_path: Path, anyio_backend: object) -> None:
    path = tmp_path / "qwen35moe.gguf"
    write_model("qwen35moe", path, F32_GEOMETRY, seed=1)
    x, token_ids = _inputs(F32_GEOMETRY.n_embd)
    async with moe_session(path, slots=N_EXPERT) as session:
        await session.warmup()
        assert session.prefetch_token(token_ids) == 0  # no hash-routed layer: nothing is certain
        assert session.prefetch_token([1, 2]) == 0  # a list is taken as an array
        for bad in ([[1, 2]], [1.5, 2.0], "12", None, 3):
            with pytest.raises(aioexperts.InvalidRequestError, match="1-D integer array"):
                session.prefetch_token(bad)
        with pytest.raises(aioexperts.InvalidRequestError, match="integer array"):
            await session.moe(0, x, token_ids=token_ids.astype(np.float64))
        got = await session.moe_result(0, x, token_ids=token_ids)  # accepted, not needed
        want = await session.moe_result(0, x)
        np.testing.assert_array_equal(got.ffn_out, want.ffn_out)


@pytest.mark.anyio
async def test_the_router_predictor_ranks_with_sqrt_softplus(tmp_path: Path, anyio_backend: object) -> None:
    """On its own layer's input the router predictor names the routed experts, in llama.cpp's order."""
    path = tmp_path / "deepseek4.gguf"
    write_model("deepseek4", path, F32_GEOMETRY, seed=11)
    x, _ = _inputs(F32_GEOMETRY.n_embd)
    async with moe_session(path, slots=N_EXPERT) as session:
        await session.warmup()
        predictor = aioexperts.predictors.make_predictor("router", residents=session.residents, hparams=session.hparams)
        for row in range(N_TOKENS):
            got = await session.moe_result(2, x[row : row + 1], prefetch=False)
            assert predictor.predict(1, 2, x[row : row + 1], K) == got.ids[0].tolist()


@pytest.mark.anyio
async def test_qwen35moe_gate_or_up_scales_of_a_merged_bank_are_refused(tmp_path: Path, anyio_backend: object) -> None:
    """llama.cpp creates ffn_{gate,up}_exps.scale only for separate gate and up banks."""
    path = tmp_path / "qwen35moe.gguf"
    write_model("qwen35moe", path, F32_GEOMETRY, seed=4, merged_gate_up=True)
    async with moe_session(path, slots=N_EXPERT) as session:
        assert session.layout.layers[0].banks[0].merged
        with pytest.raises(aioexperts.UnsupportedTypeError, match="merged ffn_gate_up_exps"):
            await session.warmup()


def test_qwen35moe_expert_width_may_be_a_per_block_array() -> None:
    md = {"qwen35moe.block_count": 2, "qwen35moe.embedding_length": 32, "qwen35moe.expert_count": 8,
          "qwen35moe.expert_used_count": 2, "qwen35moe.expert_feed_forward_length": [16, 16]}  # fmt: skip
    hp = aioexperts.MoEHParams.from_metadata("qwen35moe", md)
    assert (hp.n_ff_exp, hp.n_ff_exp_layers, hp.expert_scales) == (16, (16, 16), True)
    assert hp.gating_func == GatingFunc.SOFTMAX and hp.weights_norm and hp.weights_scale == 1.0
    with pytest.raises(aioexperts.FormatError, match="one per block"):
        aioexperts.MoEHParams.from_metadata("qwen35moe", {**md, "qwen35moe.expert_feed_forward_length": [16]})


@pytest.mark.anyio
@pytest.mark.parametrize("arch", ["deepseek4", "qwen35moe"])
async def test_load_refuses_the_whole_model_naming_the_missing_part(
    arch: str, tmp_path: Path, anyio_backend: object
) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_model(arch, path, F32_GEOMETRY, seed=3)
    # both run whole (tests/model/test_deepseek4.py, test_qwen35moe.py): an MoE-only file is not a whole model
    with pytest.raises(aioexperts.FormatError, match="holds MoE layers only") as err:
        async with aioexperts.load(path, io=aioexperts.IOOptions(backend="threads")):
            pass
    assert "MoERunner" in str(err.value)  # the MoE layers still run through open() + MoERunner
