"""deepseek4's MoE blocks fed llama.cpp's inputs (shared/fixtures/next-archs ``ffn_norm-L``).

Hash-routed layers 0-1 (``ffn_gate_tid2eid``), router layers 2-3 (``sqrt(softplus)`` scores plus
``exp_probs_b``), weights normalised and scaled by 1.5, clamped SwiGLU for the experts and the shared
expert. The golden's experts are chosen, its weights reproduced to float noise, and the block output
is llama.cpp's to float32 noise: F32 4.7e-7 over all positions, Q4_K_M 2.2e-7 at the median position.
In the Q4_K_M file that noise flips an 8-bit activation step at a few positions (2..4 of 250 per
layer, 2e-4..1.4e-3 there): 1.6e-5..1.1e-4 over all positions (measured).
"""

from __future__ import annotations

from pathlib import Path

import fixture_views as fv
import numpy as np
import pytest
from conftest import rel_l2

from aioexperts._compute.moe import ResidentLayer, moe_forward, route
from aioexperts._format.hparams import MoEHParams

DIR = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "next-archs"
if not DIR.exists():
    DIR = Path("/work/shared/fixtures/next-archs")
FILES = [DIR / "deepseek4-f32.gguf", DIR / "deepseek4-q4_k_m.gguf"]

pytestmark = pytest.mark.skipif(not FILES[0].exists(), reason="shared next-archs fixtures not found")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("layer", range(4))
def test_moe_block_fed_llama_cpp_s_input_is_llama_cpp_s(path: Path, layer: int) -> None:
    md = fv.metadata(path)
    hp = MoEHParams.from_metadata(str(md["general.architecture"]), md)
    want = np.load(path.with_name(path.stem + ".forward.npz"))
    by_name = {t.name: t for t in fv.reader(path).tensors}
    table = by_name.get(f"blk.{layer}.ffn_gate_tid2eid.weight")
    token_experts = None if table is None else np.asarray(table.data).reshape(int(table.shape[1]), -1)
    assert (token_experts is not None) == (layer < 2)  # hash_layer_count 2
    resident = ResidentLayer.from_tensors(
        layer, fv.tensor_getter(path), hp, token_experts=token_experts, tensor_type=fv.type_getter(path)
    )
    x = np.ascontiguousarray(want[f"ffn_norm-{layer}"])
    ids, weights = route(x, resident, hp, token_ids=want["tokens"])
    assert np.array_equal(ids, want[f"topk-{layer}"])
    assert rel_l2(weights, want[f"weights-{layer}"]) <= 1e-6
    out = moe_forward(x, ids, weights, fv.expert_views(path, layer), resident, hp)
    assert out.shared_out is not None
    quantized = path.stem.endswith("q4_k_m")
    errors = {
        key: rel_l2(got, want[f"{key}-{layer}"])
        for key, got in (("moe_out", out.moe_out), ("shared_out", out.shared_out), ("ffn_out", out.ffn_out))
    }
    assert max(errors.values()) <= (5e-4 if quantized else 1e-6), errors
    per_position = np.array([rel_l2(g, w) for g, w in zip(out.ffn_out, want[f"ffn_out-{layer}"], strict=True)])
    assert np.median(per_position) <= 1e-6 and (per_position <= 1e-5).sum() >= 240, sorted(per_position)[-8:]
