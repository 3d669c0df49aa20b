"""deepseek4 against llama.cpp run here, in the test (llama-cpp-python; skipped when it is missing).

The default-settings goldens of shared/fixtures/next-archs were made by llama.cpp on another machine.
On this one (2-vCPU AMD EPYC, AVX2, no AVX-512) llama-cpp-python 0.3.36 with the golden's settings
gives other logits: the F32 file 3.1e-3 from its golden (1.9e-4 without the README's indexer near-ties
82, 207 and 248), the Q4_K_M file 0.097 with the same argmax at 228 of 250. The Q4_K_M network is
chaotic: float32 noise flips 8-bit activation steps (``Q8_K`` / ``Q8_0``) at some positions of every
block, and the indexer's top-k near-ties and the four hyper-connection streams amplify each flip.
llama.cpp itself moves as far when its norm weights move by one ulp: 12 random one-ulp moves of the
``attn_norm`` / ``ffn_norm`` weights (about 6e-8 relative) put its logits 0.084..0.111 from its own
unmoved run (argmax equal at 222..235 of 250) and 0.085..0.117 from the golden (222..234), none inside
the issue's bound (8e-2 and 238 of 250). Without its weight repacking (``use_extra_bufts`` off: Q4_K
multiplied by ``ggml_vec_dot_q4_K_q8_K``, not the 8-row interleaved gemm) llama.cpp here is 0.071 from
the golden (argmax 239), its one-ulp moves 0.067..0.100 (222..241), 2 of 12 inside the bound: nearer,
and still as chaotic. Neither run reproduces the golden bit for bit, so it was made on another machine.
So the Q4_K_M file is held here to llama.cpp's self-distance and the F32 file to a tight bound:

- F32 file, default settings: our logits are 2.2e-4 from llama.cpp here (measured), the argmax equal
  at every position.
- Q4_K_M file, default settings: ours are 0.110 from llama.cpp here, argmax equal at 229 (measured),
  inside the spread of llama.cpp's one-ulp runs. A wrong graph is far outside it: the F16 rounding
  of the keys and rows left out (``DSV4Block.f16_cache`` False) puts ours 0.17 off.

Block by block, fed llama.cpp's inputs, the Q4_K_M attention blocks are llama.cpp's to 5e-7 at the
median position (``test_deepseek4.test_attention_blocks_match_llama_cpp``).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import anyio
import gguf
import numpy as np
import pytest
from conftest import rel_l2

import aioexperts

llama_cpp = pytest.importorskip("llama_cpp")

DIR = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "next-archs"
if not DIR.exists():
    DIR = Path("/work/shared/fixtures/next-archs")
F32 = DIR / "deepseek4-f32.gguf"
Q4 = DIR / "deepseek4-q4_k_m.gguf"
THREADS = aioexperts.IOOptions(backend="threads")
#: the README's indexer near-ties of the F32 file (layer 3: the 8th and 9th score within 1e-3 relative)
INDEXER_NEAR_TIES = (82, 207, 248)
#: the one-ulp runs of llama.cpp measured against its unmoved run (seeds 0-3 of :func:`one_ulp_away`)
ONE_ULP_SEEDS = range(4)

pytestmark = pytest.mark.skipif(not Q4.exists(), reason="shared next-archs fixtures not found")


def tokens_of(path: Path) -> list[int]:
    tokens: list[int] = np.load(path.with_name(path.stem + ".forward.npz"))["tokens"].tolist()
    return tokens


def llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits at every prompt position with the golden's settings (README: one ubatch,
    ``n_ctx = n_batch = n_ubatch = 512``, F16 K/V, flash attention on, 2 threads)."""
    try:
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=512,
            n_batch=512,
            n_ubatch=512,
            n_threads=2,
            n_threads_batch=2,
            logits_all=True,
            flash_attn=True,
            verbose=False,
        )
    except ValueError as exc:  # a llama.cpp without deepseek4
        pytest.skip(f"this llama-cpp-python does not load deepseek4: {exc}")
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def our_logits(path: Path) -> np.ndarray:
    async def main() -> np.ndarray:
        async with aioexperts.load(path, slots=8, io=THREADS) as model:
            async with model.sequence() as seq:
                return await seq.forward(tokens_of(path))

    return anyio.run(main)


def one_ulp_away(path: Path, out: Path, seed: int) -> Path:
    """A copy of ``path`` whose ``attn_norm`` / ``ffn_norm`` weights (F32) each moved one ulp up or down
    at random: float32 noise at every block's input, nothing else."""
    shutil.copyfile(path, out)
    rng = np.random.default_rng(seed)
    norms = [
        t
        for t in gguf.GGUFReader(path).tensors
        if t.name.endswith(("attn_norm.weight", "ffn_norm.weight")) and t.tensor_type == gguf.GGMLQuantizationType.F32
    ]
    assert len(norms) == 8
    data = np.memmap(out, dtype=np.uint8, mode="r+")
    for t in norms:
        w = data[int(t.data_offset) : int(t.data_offset) + 4 * int(t.n_elements)].view(np.float32)
        up = rng.random(w.size) < 0.5
        w[:] = np.where(up, np.nextafter(w, np.float32(np.inf)), np.nextafter(w, np.float32(-np.inf)))
    data.flush()
    del data
    return out


def argmax_equal(a: np.ndarray, b: np.ndarray) -> int:
    return int((a.argmax(axis=1) == b.argmax(axis=1)).sum())


@functools.cache
def llama_here(path: Path) -> np.ndarray:
    return llama_logits(path, tokens_of(path))


def test_f32_file_is_llama_cpp_here_s_to_its_f16_roundings() -> None:
    """What is left away from the indexer's near-ties (2.2e-4 on an AMD EPYC) is float32 noise that
    flips some F16 roundings of the cached keys. Which way the near-tie at 207 falls depends on the
    CPU llama.cpp runs on: on the AMD EPYC its rows are ours and the golden is 3.1e-3 away; on an
    Intel Xeon with AVX-512 and AMX llama.cpp here is the golden bit for bit and ours are 3.1e-3 away,
    4.5e-2 at 207 alone."""
    theirs = llama_here(F32)
    ours = our_logits(F32)
    keep = np.setdiff1d(np.arange(len(theirs)), INDEXER_NEAR_TIES)
    assert rel_l2(ours[keep], theirs[keep]) <= 5e-4
    assert argmax_equal(ours, theirs) == len(theirs)


def _cpu_has_amx() -> bool:
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(
    _cpu_has_amx(),
    reason="llama.cpp 0.3.36 aborts on this Q4_K_M file where it repacks for AMX "
    "(GGML_ASSERT(*cur_backend_id != -1) in ggml-backend.cpp), and the test needs its default settings",
)
def test_q4_k_m_file_is_as_far_from_llama_cpp_here_as_llama_cpp_one_ulp_away(tmp_path: Path) -> None:
    theirs = llama_here(Q4)
    assert np.array_equal(llama_logits(Q4, tokens_of(Q4)), theirs)  # llama.cpp repeats itself bit for bit
    moved = [llama_logits(one_ulp_away(Q4, tmp_path / f"moved-{s}.gguf", s), tokens_of(Q4)) for s in ONE_ULP_SEEDS]
    spread = [rel_l2(m, theirs) for m in moved]
    agree = [argmax_equal(m, theirs) for m in moved]
    # the chaos itself (measured 0.094..0.111, argmax 222..230): the 8e-2 is inside it
    assert min(spread) >= 5e-2 and max(agree) < len(theirs), (spread, agree)
    ours = our_logits(Q4)
    error, same = rel_l2(ours, theirs), argmax_equal(ours, theirs)
    # measured 0.110 and 229 of 250
    assert error <= 1.25 * max(spread), (error, spread)
    assert same >= min(agree) - 5, (same, agree)
