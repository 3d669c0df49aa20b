"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as llama.cpp computes it with the absorbed ``attn_k_b``.

The maths of src/models/deepseek2.cpp (``llama_model_deepseek2::graph``, the ``is_mla`` branch) and
src/llama-graph.cpp (``build_attn`` with ``v_mla``, ``build_attn_mha``), for one layer and ``T``
tokens, ``H`` heads, latent width ``C = kv_lora_rank``, RoPE width ``R``, no-RoPE width ``N``::

    q            = attn_q_b(rms_norm(attn_q_a(x)))            (T, H, N + R)   (lite: attn_q(x))
    q_nope, q_pe = q[..., :N], rope(q[..., N:])
    q_latent     = attn_k_b[h] @ q_nope[t, h]                 (T, H, C)       "q_nope_absorbed"
    latent, k_pe = rms_norm(attn_kv_a_mqa(x)[:, :C]), rope(attn_kv_a_mqa(x)[:, C:])   (T, C), (T, R)
    cache[p]     = [latent | k_pe]                            one row of C + R floats per position
    score[t,h,s] = kq_scale * (q_latent[t,h] . latent[s] + q_pe[t,h] . k_pe[s]),  causal
    out_latent   = softmax_s(score) @ latent                  (T, H, C)
    out          = attn_output(concat_h(attn_v_b[h] @ out_latent[t, h]))           (T, n_embd)

so the KV cache never holds per-head keys or values: it is MQA with one shared key of ``C + R``
floats whose first ``C`` floats are also the value (llama.cpp's ``Kcur = concat(kv_cmpr, k_pe)``,
``Vcur`` a view of it). The functions are stateless; the cache is a ``(n_ctx, C + R)`` float32 array
the caller owns (one per layer and sequence). RoPE is applied by the caller's ``rope`` callable, so
this module has none of its own.

Precision: float32 throughout (the cache rows exact, the softmax by
:func:`aioexperts._compute.attention.attend`). llama.cpp runs, by default, with an F16 KV cache and
its CPU flash attention (F16 query, F16 value accumulator: ggml/src/ggml-cpu/ops.cpp
``ggml_compute_forward_flash_attn_ext_f16_one_chunk``), which differs from this by the F16 rounding
(tests/model/test_mla.py reproduces that arithmetic to show the gap is only that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import ConfigError, FormatError
from .._format.mla import MLAHParams
from .attention import attend
from .norms import rms_norm

__all__ = (
    "HeadMatrices",
    "MLAWeights",
    "Matmul",
    "Rope",
    "absorb_query",
    "expand_values",
    "kq_scale",
    "latent_attention",
    "mla_attention",
    "project_latent",
    "project_query",
    "split_kv_b",
    "temperature_scales",
)

#: ``rope(x, positions)``: x ``(T, n, R)`` float32, positions ``(T,)`` int; returns the rotated ``(T, n, R)``
Rope = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: ``w(x) = x @ W.T``: ``(T, cols)`` float32 -> ``(T, rows)`` float32 (a float32 matrix or a ggml one)
Matmul = Callable[[np.ndarray], np.ndarray]
#: per-head matrices: a ``(H, rows, cols)`` float32 array, or ``H`` callables ``x @ W_h.T``
HeadMatrices = np.ndarray | Sequence[Matmul]

_F32 = np.float32


# ----------------------------------------------------------------------------------------------
# scales


def kq_scale(hp: MLAHParams, attn_factor: float = 1.0, freq_scale: float = 1.0) -> float:
    """The score scale of deepseek2's attention, with YaRN's ``mscale`` correction.

    src/models/deepseek2.cpp ``llama_model_deepseek2::graph`` (and [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]
    in its ``load_arch_hparams``: ``yarn_log_mul = rope.scaling.yarn_log_multiplier / 0.1``)::

        attn_factor_org = attn_factor * (1 + 0.1 ln(1 / freq_scale))
        mscale          = attn_factor_org * (1 + 0.1 yarn_log_mul ln(1 / freq_scale))
        kq_scale        = mscale^2 / sqrt(key_length)

    ``attn_factor`` is the one llama.cpp hands to RoPE (``cparams.yarn_attn_factor``: with YaRN
    ``1 / (1 + 0.1 ln factor)`` times ``rope.scaling.attn_factor``, src/llama-context.cpp); the first
    line undoes that division. Without RoPE scaling this is ``attn_factor^2 / sqrt(key_length)``
    (``1/sqrt(96)`` for the test fixture).

    Args:
        hp: the MLA hyper-parameters (``key_length``, ``yarn_log_multiplier``).
        attn_factor: RoPE's magnitude factor as llama.cpp resolves it (> 0).
        freq_scale: RoPE's frequency scale, ``1 / rope.scaling.factor`` (> 0).

    Returns:
        The scale (float64; llama.cpp computes it in float32).

    Raises:
        ConfigError: ``attn_factor`` or ``freq_scale`` not a positive finite number.
    """
    for what, v in (("attn_factor", attn_factor), ("freq_scale", freq_scale)):
        if not (math.isfinite(v) and v > 0.0):
            raise ConfigError(f"{what} must be a positive finite number, got {v!r}")
    yarn_log_mul = hp.yarn_log_multiplier / 0.1
    attn_factor_org = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    mscale = attn_factor_org * (1.0 + 0.1 * yarn_log_mul * math.log(1.0 / freq_scale))
    return mscale * mscale / math.sqrt(hp.key_length)


def temperature_scales(hp: MLAHParams, positions: np.ndarray) -> np.ndarray | None:
    """The per-position query temperature (``attention.temperature_scale``), or None without one.

    src/llama-graph.cpp ``llm_graph_input_attn_temp::set_input``:
    ``log(floor(pos / temperature_length) + 1) * temperature_scale + 1`` (deepseek2 sets the offset to 0).

    Args:
        hp: the hyper-parameters.
        positions: ``(T,)`` integer positions.

    Returns:
        ``(T,)`` float32 factors applied to the whole query row, or None.
    """
    if hp.temperature_scale == 0.0:
        return None
    pos = np.asarray(positions, dtype=np.float64)
    scale = np.log(np.floor(pos / hp.temperature_length) + 1.0) * hp.temperature_scale + 1.0
    return scale.astype(_F32)


# ----------------------------------------------------------------------------------------------
# weights


def _float32_matmul(w: np.ndarray) -> Matmul:
    def matmul(x: np.ndarray) -> np.ndarray:
        y: np.ndarray = np.matmul(x, w.T)
        return y

    return matmul


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """The attention weights of one layer (``H`` heads; numpy shapes).

    The matrices are :data:`Matmul` callables ``x -> x @ W.T`` (a float32 matrix through
    :meth:`from_arrays`, or a ggml matrix multiplied by the compiled kernels); the norms are float32.

    Attributes:
        q_a: ``attn_q_a`` ``(q_lora_rank, n_embd)``; None for the lite variants.
        q_a_norm: ``(q_lora_rank,)`` ``attn_q_a_norm``; None for the lite variants.
        q_b: ``attn_q_b`` ``(H * key_length, q_lora_rank)``, or the lite ``attn_q``
            ``(H * key_length, n_embd)``.
        kv_a: ``attn_kv_a_mqa`` ``(kv_lora_rank + rope_dims, n_embd)``.
        kv_a_norm: ``(kv_lora_rank,)`` ``attn_kv_a_norm``.
        k_b: ``attn_k_b`` per head ``(kv_lora_rank, nope_dims)`` (ggml ``{nope, kv_lora_rank, H}``).
        v_b: ``attn_v_b`` per head ``(value_length, kv_lora_rank)`` (ggml ``{kv_lora_rank, value_length, H}``).
            Old files: both from ``attn_kv_b`` (:func:`split_kv_b`).
        output: ``attn_output`` ``(n_embd, H * value_length)``.
    """

    q_a: Matmul | None
    q_a_norm: np.ndarray | None
    q_b: Matmul
    kv_a: Matmul
    kv_a_norm: np.ndarray
    k_b: HeadMatrices
    v_b: HeadMatrices
    output: Matmul

    @classmethod
    def from_arrays(cls, layer: int, tensor: Callable[[str], np.ndarray | None], hp: MLAHParams) -> MLAWeights:
        """Gather the weights of block ``layer`` as float32 arrays through ``tensor(name)`` (None if absent).

        Raises:
            FormatError: a tensor of :meth:`MLAHParams.tensor_shapes` is missing, has another shape
                or is not finite.
        """
        arrays: dict[str, np.ndarray] = {}
        for name, shape in hp.tensor_shapes(layer).items():
            value = tensor(name)
            if value is None:
                raise FormatError(f"MLA attention tensor {name} is missing")
            arr = np.ascontiguousarray(value, dtype=_F32)
            if arr.shape != shape:
                raise FormatError(f"{name} has shape {arr.shape}, expected {shape} from the hyper-parameters")
            if not np.isfinite(arr).all():
                raise FormatError(f"{name} holds NaN or infinite values")
            arrays[name.split(".")[2]] = arr
        lite = hp.q_lora_rank == 0
        if hp.split_kv_b:
            k_b, v_b = arrays["attn_k_b"], arrays["attn_v_b"]
        else:
            k_b, v_b = split_kv_b(arrays["attn_kv_b"], hp)
        return cls(
            q_a=None if lite else _float32_matmul(arrays["attn_q_a"]),
            q_a_norm=None if lite else arrays["attn_q_a_norm"],
            q_b=_float32_matmul(arrays["attn_q"] if lite else arrays["attn_q_b"]),
            kv_a=_float32_matmul(arrays["attn_kv_a_mqa"]),
            kv_a_norm=arrays["attn_kv_a_norm"],
            k_b=k_b,
            v_b=v_b,
            output=_float32_matmul(arrays["attn_output"]),
        )


def split_kv_b(kv_b: np.ndarray, hp: MLAHParams) -> tuple[np.ndarray, np.ndarray]:
    """``attn_k_b`` and ``attn_v_b`` from an old file's ``attn_kv_b`` (what llama.cpp's converter now writes).

    ``attn_kv_b`` ``(H * (N + V), C)`` holds per head ``N`` rows of its no-RoPE key projection then
    ``V`` rows of its value projection (deepseek2.cpp, the ``!is_mla`` branch: ``kv = wkv_b(kv_cmpr)``
    split into ``k_nope`` and ``Vcur``). Since ``q_nope . (Wk_h c) = (Wk_h^T q_nope) . c``, the
    absorbed key matrix is the transpose of the key rows.

    Args:
        kv_b: ``(H * (nope_dims + value_length), kv_lora_rank)`` float32.
        hp: the hyper-parameters.

    Returns:
        ``k_b`` ``(H, kv_lora_rank, nope_dims)`` and ``v_b`` ``(H, value_length, kv_lora_rank)``,
        float32, C-contiguous.
    """
    per_head = kv_b.reshape(hp.n_head, hp.nope_dims + hp.value_length, hp.kv_lora_rank)
    k_b = np.ascontiguousarray(per_head[:, : hp.nope_dims].transpose(0, 2, 1))
    v_b = np.ascontiguousarray(per_head[:, hp.nope_dims :])
    return k_b, v_b


# ----------------------------------------------------------------------------------------------
# the steps


def project_query(x: np.ndarray, w: MLAWeights, hp: MLAHParams) -> tuple[np.ndarray, np.ndarray]:
    """The per-head query, split into its no-RoPE and (not yet rotated) RoPE parts.

    deepseek2.cpp: ``q = wq_b(rms_norm(wq_a(x), attn_q_a_norm))`` (lite: ``wq(x)``), viewed as
    ``{key_length, H, T}`` and split at ``nope_dims``.

    Args:
        x: ``(T, n_embd)`` float32, the attention input after ``attn_norm``.

    Returns:
        ``q_nope`` ``(T, H, nope_dims)`` and ``q_pe`` ``(T, H, rope_dims)``, float32, contiguous.
    """
    if w.q_a is not None and w.q_a_norm is not None:
        q = w.q_b(rms_norm(w.q_a(x), w.q_a_norm, hp.rms_eps))
    else:
        q = w.q_b(x)
    q = q.reshape(x.shape[0], hp.n_head, hp.key_length)
    return np.ascontiguousarray(q[..., : hp.nope_dims]), np.ascontiguousarray(q[..., hp.nope_dims :])


def project_latent(x: np.ndarray, w: MLAWeights, hp: MLAHParams) -> tuple[np.ndarray, np.ndarray]:
    """The compressed latent (normalised by ``attn_kv_a_norm``) and the shared RoPE key (not rotated).

    deepseek2.cpp: ``kv_cmpr_pe = wkv_a_mqa(x)`` split into ``kv_cmpr`` (then ``attn_kv_a_norm``) and ``k_pe``.

    Args:
        x: ``(T, n_embd)`` float32, the attention input after ``attn_norm``.

    Returns:
        ``latent`` ``(T, kv_lora_rank)`` and ``k_pe`` ``(T, rope_dims)``, float32.
    """
    kv = w.kv_a(x)
    latent = rms_norm(kv[:, : hp.kv_lora_rank], w.kv_a_norm, hp.rms_eps)
    return latent, np.ascontiguousarray(kv[:, hp.kv_lora_rank :])


def _per_head(x: np.ndarray, w: HeadMatrices) -> np.ndarray:
    # out[t, h] = W_h @ x[t, h]
    if isinstance(w, np.ndarray):
        out: np.ndarray = np.matmul(w[None], x[..., None])[..., 0]
        return out
    return np.stack([w_h(np.ascontiguousarray(x[:, h])) for h, w_h in enumerate(w)], axis=1)


def absorb_query(q_nope: np.ndarray, k_b: HeadMatrices) -> np.ndarray:
    """``q_latent[t, h] = k_b[h] @ q_nope[t, h]``: the no-RoPE query moved into latent space.

    deepseek2.cpp ``q_nope_absorbed = ggml_mul_mat(wk_b, q_nope)``.

    Args:
        q_nope: ``(T, H, N)`` float32.
        k_b: ``(H, C, N)`` float32, or ``H`` callables ``(T, N) -> (T, C)``.

    Returns:
        ``(T, H, C)`` float32.
    """
    return _per_head(q_nope, k_b)


def expand_values(out_latent: np.ndarray, v_b: HeadMatrices) -> np.ndarray:
    """``out[t, h] = v_b[h] @ out_latent[t, h]``, heads concatenated (llama-graph.cpp ``kqv_mla``).

    Args:
        out_latent: ``(T, H, C)`` float32, the attention-weighted latents.
        v_b: ``(H, V, C)`` float32, or ``H`` callables ``(T, C) -> (T, V)``.

    Returns:
        ``(T, H * V)`` float32, head-major (head ``h`` is columns ``h*V .. h*V + V - 1``).
    """
    return _per_head(out_latent, v_b).reshape(out_latent.shape[0], -1)


def latent_attention(
    q_latent: np.ndarray,
    q_pe: np.ndarray,
    rows: np.ndarray,
    start: int,
    kv_lora_rank: int,
    scale: float,
) -> np.ndarray:
    """Causal softmax attention of ``T`` queries over the cached rows, in latent space.

    The queries are positions ``start .. start + T - 1``; the query at position ``p`` sees rows
    ``0 .. p``. llama-graph.cpp ``build_attn_mha`` with one KV head (MLA is MQA after absorption):
    ``Qcur = concat(q_nope_absorbed, q_pe)``, ``K`` = the rows, ``V`` = their first ``C`` floats.
    A long batch runs in chunks of queries (:data:`aioexperts._compute.attention.SCORE_BYTES`).

    Args:
        q_latent: ``(T, H, C)`` float32 (:func:`absorb_query`).
        q_pe: ``(T, H, R)`` float32, rotated.
        rows: ``(start + T, C + R)`` float32 cache rows of positions ``0 .. start + T - 1``.
        start: position of the first query.
        kv_lora_rank: ``C``.
        scale: the score scale (:func:`kq_scale`).

    Returns:
        ``(T, H, C)`` float32: the softmax-weighted sum of the cached latents.

    Raises:
        ConfigError: shapes that do not fit.
    """
    t, h, c = q_latent.shape
    if c != kv_lora_rank or q_pe.shape[:2] != (t, h) or rows.shape != (start + t, c + q_pe.shape[2]) or start < 0:
        raise ConfigError(
            f"MLA attention: q_latent {q_latent.shape}, q_pe {q_pe.shape}, rows {rows.shape}, start {start} do not fit"
        )
    query = np.concatenate([q_latent, q_pe], axis=-1)
    keys = rows[:, None, :]  # MQA: one KV head, whose first C floats are the value
    out = attend(query, keys, keys[..., :c], start, scale)  # chunks a long prefill (attention.SCORE_BYTES)
    return out.reshape(t, h, c)


def mla_attention(
    x: np.ndarray,
    start: int,
    w: MLAWeights,
    hp: MLAHParams,
    cache: np.ndarray,
    rope: Rope,
    scale: float,
) -> np.ndarray:
    """One MLA attention block for ``T`` new tokens: project, rotate, cache, attend, output.

    llama.cpp src/models/deepseek2.cpp ``llama_model_deepseek2::graph`` (``is_mla``), with the
    attention of src/llama-graph.cpp ``build_attn_mha`` and ``attn_output`` applied by ``build_attn``
    (and Mistral-Large's query temperature where the file has one).

    Args:
        x: ``(T, n_embd)`` float32, the attention input after ``attn_norm``, positions
            ``start .. start + T - 1``.
        start: position of the first token; rows ``0 .. start - 1`` of ``cache`` are filled.
        w: the layer's weights.
        hp: the hyper-parameters.
        cache: ``(n_ctx, C + R)`` float32, the layer's latent KV cache; rows ``start .. start + T - 1``
            are written.
        rope: rotates ``(T, n, rope_dims)`` float32 by position (NORM pairing, with llama.cpp's
            ``attn_factor`` and ``freq_scale``).
        scale: :func:`kq_scale`.

    Returns:
        ``(T, n_embd)`` float32: the attention block's output (before the residual add).

    Raises:
        ConfigError: ``x`` is not ``(T, n_embd)`` float32, the cache has the wrong width, or
            ``start + T`` passes its ``n_ctx`` rows.
    """
    if x.dtype != _F32 or x.ndim != 2 or x.shape[1] != hp.n_embd:
        raise ConfigError(f"x must be (T, {hp.n_embd}) float32, got {x.dtype} {x.shape}")
    t = x.shape[0]
    if cache.ndim != 2 or cache.shape[1] != hp.cache_width or not 0 <= start <= cache.shape[0] - t:
        raise ConfigError(
            f"cache {cache.shape} cannot take positions {start}..{start + t - 1} of width {hp.cache_width}"
        )
    pos = np.arange(start, start + t)
    q_nope, q_pe = project_query(x, w, hp)
    q_pe = rope(q_pe, pos)
    latent, k_pe = project_latent(x, w, hp)
    k_pe = rope(k_pe[:, None, :], pos)[:, 0, :]
    q_latent = absorb_query(q_nope, w.k_b)
    temperature = temperature_scales(hp, pos)
    if temperature is not None:  # deepseek2.cpp: Qcur = ggml_mul(Qcur, inp_attn_scale), both parts
        q_latent = q_latent * temperature[:, None, None]
        q_pe = q_pe * temperature[:, None, None]
    cache[start : start + t, : hp.kv_lora_rank] = latent  # llama.cpp Kcur = concat(kv_cmpr, k_pe)
    cache[start : start + t, hp.kv_lora_rank :] = k_pe
    out_latent = latent_attention(q_latent, q_pe, cache[: start + t], start, hp.kv_lora_rank, scale)
    return w.output(expand_values(out_latent, w.v_b))
