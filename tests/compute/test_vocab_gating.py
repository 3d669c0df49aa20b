"""The vocabulary size reaches the gating default: GLM-4.7-Flash in a ``deepseek2`` file.

llama.cpp's DeepSeek2 loader picks sigmoid gating when ``expert_gating_func`` is absent and the model
has 47 or 48 blocks (not counting NextN blocks) and a vocabulary of 154880 tokens; the vocabulary size
is ``deepseek2.vocab_size`` or, without it, the length of ``tokenizer.ggml.tokens``
(``get_key(LLM_KV_VOCAB_SIZE) || get_arr_n(LLM_KV_TOKENIZER_LIST)``). That array is far too long to be
copied out of the header, so only its length is kept; these files have no ``vocab_size`` key.
"""

from __future__ import annotations

from pathlib import Path

import gguf_bytes as gb
import numpy as np
import pytest
from gguf import GGUFValueType
from moe_session import moe_session

from aioexperts._format.hparams import GatingFunc, MoEHParams
from aioexperts._format.model import SkippedValue, open_model

T = GGUFValueType
N_EMBD, N_EXPERT, N_USED, N_FF = 32, 8, 2, 32
GLM47_VOCAB = 154880


def _deepseek2_file(path: Path, n_tokens: int, block_count: int, nextn: int = 0) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(7)
    router = rng.standard_normal((N_EXPERT, N_EMBD)).astype(np.float32)  # numpy order (n_expert, n_embd)
    f = gb.GGUFBytes()
    f.add("general.architecture", T.STRING, "deepseek2")
    for key, value in (
        ("block_count", block_count),
        ("embedding_length", N_EMBD),
        ("expert_count", N_EXPERT),
        ("expert_used_count", N_USED),
        ("expert_feed_forward_length", N_FF),
        ("expert_shared_count", 0),
        ("leading_dense_block_count", 1),
    ):
        f.add(f"deepseek2.{key}", T.UINT32, value)
    if nextn:
        f.add("deepseek2.nextn_predict_layers", T.UINT32, nextn)
    f.add("tokenizer.ggml.tokens", T.ARRAY, gb.Arr(T.STRING, [b"t"] * n_tokens))
    f.tensors = [
        gb.Tensor("blk.1.ffn_gate_inp.weight", [N_EMBD, N_EXPERT], data=router.tobytes()),
        gb.Tensor("blk.1.ffn_gate_exps.weight", [N_EMBD, N_FF, N_EXPERT]),
        gb.Tensor("blk.1.ffn_up_exps.weight", [N_EMBD, N_FF, N_EXPERT]),
        gb.Tensor("blk.1.ffn_down_exps.weight", [N_FF, N_EMBD, N_EXPERT]),
    ]
    path.write_bytes(f.build())
    return path, router


def _reference(x: np.ndarray, router: np.ndarray, gating: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 build_moe_ffn for these files: probs, top-2 (stable), weights = probs (no norm, no scale)."""
    logits = x.astype(np.float64) @ router.astype(np.float64).T
    if gating == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :N_USED]
    return ids, np.take_along_axis(probs, ids, axis=1)


@pytest.mark.parametrize(
    ("n_tokens", "block_count", "nextn", "expected"),
    [
        (GLM47_VOCAB, 48, 0, GatingFunc.SIGMOID),
        (GLM47_VOCAB, 47, 0, GatingFunc.SIGMOID),
        (GLM47_VOCAB, 48, 1, GatingFunc.SIGMOID),  # 49 blocks, one of them NextN
        (GLM47_VOCAB - 1, 48, 0, GatingFunc.SOFTMAX),
        (GLM47_VOCAB, 46, 0, GatingFunc.SOFTMAX),
    ],
    ids=["48-blocks", "47-blocks", "48+1-nextn", "other-vocab", "other-depth"],
)
def test_gating_default_sees_the_token_count(
    tmp_path: Path, n_tokens: int, block_count: int, nextn: int, expected: GatingFunc
) -> None:
    path, _ = _deepseek2_file(tmp_path / "m.gguf", n_tokens, block_count + nextn, nextn)
    model = open_model(path)
    assert "deepseek2.vocab_size" not in model.metadata
    tokens = model.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, SkippedValue) and len(tokens) == n_tokens
    assert MoEHParams.from_metadata(model.architecture, model.metadata).gating_func == expected


@pytest.mark.anyio
async def test_glm47_flash_file_without_vocab_size_routes_with_sigmoid(tmp_path: Path, anyio_backend: object) -> None:
    path, router = _deepseek2_file(tmp_path / "glm47.gguf", GLM47_VOCAB, 48)
    x = np.random.default_rng(3).standard_normal((5, N_EMBD)).astype(np.float32)
    async with moe_session(path, slots=N_EXPERT) as session:
        result = await session.moe_result(1, x)
    ids, weights = _reference(x, router, "sigmoid")
    np.testing.assert_array_equal(result.ids, ids)
    np.testing.assert_allclose(result.weights, weights, rtol=1e-5)
    soft_ids, soft_weights = _reference(x, router, "softmax")
    assert not np.allclose(result.weights, soft_weights, rtol=1e-3)  # the two gatings differ here
