"""What the executor does not compute is refused with UnsupportedTypeError naming it, never ignored.

Refused architectures (docs/executor.md, status "refused"), per-expert output scales
(``blk.L.ffn_*_exps.scale``, applied by llama.cpp's ``build_lora_mm_id``) and grok-2's parallel dense
FFN (``blk.L.ffn_up.weight`` beside the experts, grok.cpp).
"""

from __future__ import annotations

from pathlib import Path

import gguf_bytes as gb
import numpy as np
import pytest
from gguf import GGUFValueType
from moe_session import moe_session

from aioexperts._errors import UnsupportedTypeError
from aioexperts._format.archs import LLAMA_CPP_ARCHS, REFUSED
from aioexperts._format.archs import STATUSES as ARCHITECTURES
from aioexperts._format.hparams import MoEHParams, Status

T = GGUFValueType
N_EMBD, N_FF, N_EXPERT = 32, 32, 4


def _model(path: Path, arch: str, extra_tensors: list[gb.Tensor] = (), **kv: int) -> Path:  # type: ignore[assignment]
    f = gb.GGUFBytes().add("general.architecture", T.STRING, arch)
    for key, value in {
        "block_count": 1,
        "embedding_length": N_EMBD,
        "feed_forward_length": N_FF,
        "expert_count": N_EXPERT,
        "expert_used_count": 2,
        "expert_feed_forward_length": N_FF,
        **kv,
    }.items():
        f.add(f"{arch}.{key}", T.UINT32, value)
    rng = np.random.default_rng(0)

    def t(name: str, dims: list[int]) -> gb.Tensor:
        return gb.Tensor(name, dims, data=rng.standard_normal(int(np.prod(dims))).astype(np.float32).tobytes())

    f.tensors = [
        t("blk.0.ffn_gate_inp.weight", [N_EMBD, N_EXPERT]),
        t("blk.0.ffn_gate_exps.weight", [N_EMBD, N_FF, N_EXPERT]),
        t("blk.0.ffn_up_exps.weight", [N_EMBD, N_FF, N_EXPERT]),
        t("blk.0.ffn_down_exps.weight", [N_FF, N_EMBD, N_EXPERT]),
        *extra_tensors,
    ]
    path.write_bytes(f.build())
    return path


X = np.ones((2, N_EMBD), dtype=np.float32)


@pytest.mark.anyio
@pytest.mark.parametrize("proj", ["gate", "up", "down"])
async def test_per_expert_scales_are_refused(tmp_path: Path, proj: str, anyio_backend: object) -> None:
    name = f"blk.0.ffn_{proj}_exps.scale"
    path = _model(tmp_path / "m.gguf", "qwen3moe", [gb.Tensor(name, [N_EXPERT])])
    async with moe_session(path, slots=N_EXPERT) as session:
        async with session.experts(0, [1]) as views:  # the raw bytes are still served
            assert views[0] is not None
        with pytest.raises(UnsupportedTypeError, match=rf"'{name}': per-expert output scales"):
            await session.moe(0, X)


@pytest.mark.anyio
async def test_grok2_parallel_dense_ffn_is_refused(tmp_path: Path, anyio_backend: object) -> None:
    dense = [gb.Tensor(f"blk.0.ffn_{p}.weight", [N_EMBD, 64] if p != "down" else [64, N_EMBD]) for p in ("gate", "up")]
    path = _model(tmp_path / "g.gguf", "grok", dense)
    async with moe_session(path, slots=N_EXPERT) as session:
        with pytest.raises(UnsupportedTypeError, match=r"'blk\.0\.ffn_up\.weight': grok's parallel dense FFN"):
            await session.moe(0, X)
    grok1 = _model(tmp_path / "g1.gguf", "grok")  # Grok-1: experts only
    async with moe_session(grok1, slots=N_EXPERT) as session:
        assert (await session.moe(0, X)).shape == X.shape


def test_check_tensors_accepts_the_usual_names() -> None:
    hp = MoEHParams(arch="grok", n_layer=2, n_embd=8, n_expert=4, n_expert_used=2, n_ff_exp=8)
    hp.check_tensors(["blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_shexp.weight"])
    with pytest.raises(UnsupportedTypeError):
        hp.check_tensors(["blk.1.ffn_up.weight"])
    MoEHParams(arch="llama", n_layer=2, n_embd=8, n_expert=4, n_expert_used=2, n_ff_exp=8).check_tensors(
        ["blk.1.ffn_up.weight"]  # a dense FFN is a dense block's business elsewhere
    )


@pytest.mark.anyio
@pytest.mark.parametrize("arch", sorted(REFUSED))
async def test_refused_architectures_say_why(tmp_path: Path, arch: str, anyio_backend: object) -> None:
    assert ARCHITECTURES[arch] is Status.REFUSED
    path = _model(tmp_path / "r.gguf", arch, interleave_moe_layer_step=1)
    async with moe_session(path) as session:
        layer = next(iter(session.layout.layers))
        async with session.experts(layer, [0, 1]) as views:  # the raw bytes still stream
            assert all(v is not None and v.gate.n_bytes > 0 for v in views)
        with pytest.raises(UnsupportedTypeError, match=rf"architecture '{arch}' is not supported: .+"):
            session.hparams  # noqa: B018
        with pytest.raises(UnsupportedTypeError, match=rf"architecture '{arch}' is not supported: .+"):
            await session.warmup()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "falcon"])
def test_llama_cpp_archs_without_moe_support_are_refused(tmp_path: Path, arch: str) -> None:
    assert arch in LLAMA_CPP_ARCHS and arch not in ARCHITECTURES
    md = {f"{arch}.expert_count": 4, f"{arch}.expert_used_count": 2, f"{arch}.embedding_length": 8}
    with pytest.raises(UnsupportedTypeError, match="no MoE layer in llama.cpp that this executor implements"):
        MoEHParams.from_metadata(arch, md)


def test_every_moe_arch_of_the_table_is_a_llama_cpp_arch() -> None:
    assert set(ARCHITECTURES) <= LLAMA_CPP_ARCHS
