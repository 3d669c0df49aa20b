"""The kernel cache (where it lives, that an edit can never run stale machine code) and the fallback.

The subprocess tests run a copy of the package, so that editing a kernel module cannot touch the
checkout, with their own cache root (``AIOEXPERTS_CACHE``), so that nothing is written into the
repository or the user's cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aioexperts
from aioexperts._compute import jit

PACKAGE = Path(aioexperts.__file__).resolve().parent


def run_python(code: str, *, cache: Path, pythonpath: Path | None = None, **env: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; it prints one JSON object on its last line."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("AIOEXPERTS_", "NUMBA_"))}
    environ.update(env, AIOEXPERTS_CACHE=str(cache))
    prelude = ""
    if pythonpath is not None:
        # import the copy, not the checkout: an editable install's meta-path finder comes first
        prelude = (
            "import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
            f"sys.path.insert(0, {str(pythonpath)!r})\n"
        )
    source = prelude + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", source], env=environ, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


def test_cache_dir_is_under_the_user_cache_and_named_after_the_sources(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(tmp_path))
    folder = jit.cache_dir()
    assert folder.parent == tmp_path / "numba"
    assert folder.name.endswith(jit.kernel_sources_hash())
    assert PACKAGE not in folder.parents
    monkeypatch.delenv("AIOEXPERTS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_dir().parent == tmp_path / "xdg" / "aioexperts" / "numba"


def test_the_hash_covers_every_kernel_module_and_names(tmp_path) -> None:
    kernels = tmp_path / "kernels"
    shutil.copytree(PACKAGE / "_compute" / "kernels", kernels, ignore=shutil.ignore_patterns("__pycache__"))
    files = sorted(kernels.glob("*.py"))
    assert len(files) >= 5
    before = jit.sources_hash(files)
    assert before == jit.sources_hash(reversed(files))  # order does not matter
    helper = kernels / "common.py"
    helper.write_text(helper.read_text().replace("PREFETCH_ROWS = 2", "PREFETCH_ROWS = 3"))
    edited = jit.sources_hash(files)
    assert edited != before
    helper.rename(kernels / "helpers.py")
    assert jit.sources_hash(sorted(kernels.glob("*.py"))) != edited  # same bytes under another name


def test_an_unwritable_cache_folder_disables_the_cache(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("AIOEXPERTS_CACHE", str(blocker))
    jit.reset_jit_status()
    try:
        status = jit.jit_status()
        assert status.available
        assert status.cache_dir is None
        assert status.cache_reason is not None and str(blocker) in status.cache_reason
    finally:
        jit.reset_jit_status()


PROBE = """
import json, numpy as np
from gguf import GGMLQuantizationType as T
from aioexperts._compute import fused
from aioexperts._compute.jit import jit_status
rng = np.random.default_rng(0)
blocks = rng.integers(0, 256, (4, 144), dtype=np.uint8)
blocks[:, 0:4] = np.array([0x1400, 0x1400], '<u2').view(np.uint8)  # d = dmin = 2**-10
x = np.ones((1, 256), np.float32)
report = fused.warmup([T.Q4_K], kinds=["matvec"])
y = fused.linear(blocks.reshape(-1), T.Q4_K, (4, 256), x)
import aioexperts
print(json.dumps({"y": y.tolist(), "loaded": report.loaded, "compiled": report.compiled,
                  "backend": fused.backend().name, "cache": str(jit_status().cache_dir),
                  "package": aioexperts.__file__}))
"""


def test_an_edited_helper_in_another_module_never_runs_stale_code(tmp_path) -> None:
    """docs/notes/KERNELS.md pitfall 4: ``matvec_q4_k`` inlines ``sub_sums`` from ``common.py``.

    numba's own cache key covers only ``kquants.py``; the hash of every kernel source in the cache
    folder name must make the edited helper take effect in the next process.
    """
    copy = tmp_path / "src"
    shutil.copytree(PACKAGE, copy / "aioexperts", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    first = run_python(PROBE, cache=cache, pythonpath=copy, AIOEXPERTS_PRECISION="float")  # matvec_q4_k
    assert first["backend"] == "numba"
    assert str(first["package"]).startswith(str(copy))
    assert first["compiled"] == 1 and first["loaded"] == 0
    again = run_python(PROBE, cache=cache, pythonpath=copy, AIOEXPERTS_PRECISION="float")
    assert again["loaded"] == 1 and again["compiled"] == 0  # a warm start loads it
    assert again["y"] == first["y"]

    common = copy / "aioexperts" / "_compute" / "kernels" / "common.py"
    source = common.read_text()
    edited = source.replace("        out[j] = s\n", "        out[j] = s + F32(1.0)\n")
    assert edited != source
    common.write_text(edited)
    after = run_python(PROBE, cache=cache, pythonpath=copy, AIOEXPERTS_PRECISION="float")
    assert after["compiled"] == 1 and after["loaded"] == 0
    assert after["cache"] != first["cache"]
    assert after["y"] != first["y"]  # the edit is in the machine code that ran


def test_the_numpy_kernels_serve_when_numba_is_missing(tmp_path) -> None:
    code = """
    import json, logging, sys
    sys.modules["numba"] = None  # `import numba` raises ImportError
    records = []
    class Keep(logging.Handler):
        def emit(self, record): records.append(record.getMessage())
    logging.getLogger("aioexperts").addHandler(Keep())
    logging.getLogger("aioexperts").setLevel(logging.INFO)
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from aioexperts._compute import fused
    from aioexperts._format import dequant as quant
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 2 * 144, dtype=np.uint8)
    raw.reshape(2, 144)[:, 0:4] = np.array([0x1400, 0x1400], '<u2').view(np.uint8)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ys = [fused.linear(raw, T.Q4_K, (2, 256), x[:n]) for n in (1, 3, 3)]
    want = x @ quant.dequantize(raw, T.Q4_K, (2, 256)).T
    exact = quant.dequantize(raw, T.Q4_K, (2, 256))
    report = fused.warmup([T.Q4_K])
    print(json.dumps({
        "backend": fused.backend().name, "reason": fused.backend().reason, "logs": records,
        "close": bool(np.allclose(ys[1], want, rtol=1e-5, atol=1e-6)),
        "exact": bool(np.array_equal(exact, quant.dequantize(raw, T.Q4_K, (2, 256), compiled=False))),
        "kernels": list(report.kernels),
    }))
    """
    result = run_python(code, cache=tmp_path, AIOEXPERTS_PRECISION="float")  # "close": to float64
    assert result["backend"] == "numpy"
    assert "numba cannot be imported (ModuleNotFoundError" in str(result["reason"])
    assert result["close"] and result["exact"]
    assert result["kernels"] == []
    logs = [line for line in result["logs"] if "numpy kernels serve" in line]  # type: ignore[union-attr]
    assert len(logs) == 1, result["logs"]
    assert not (tmp_path / "numba").exists()


def test_forcing_numpy_by_environment(tmp_path) -> None:
    code = """
    import json
    from aioexperts._compute import fused
    print(json.dumps({"backend": fused.backend().name, "reason": fused.backend().reason}))
    """
    result = run_python(code, cache=tmp_path, AIOEXPERTS_KERNELS="numpy")
    assert result == {"backend": "numpy", "reason": "AIOEXPERTS_KERNELS=numpy", "stderr": ""}


def test_a_compile_failure_switches_to_numpy_with_one_log_line(caplog, monkeypatch) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from numba.core.errors import LoweringError

    from aioexperts._compute import fused

    def broken(qtype: T, kind: str) -> object:
        raise LoweringError("simulated LLVM failure")

    fused.set_backend(None)
    monkeypatch.setattr(fused, "_compile", broken)
    monkeypatch.setattr(fused._state, "logged", set())
    raw = np.zeros(2 * 34, np.uint8)
    x = np.ones((1, 32), np.float32)
    try:
        with caplog.at_level("WARNING", logger="aioexperts"):
            y = fused.linear(raw, T.Q8_0, (2, 32), x)
            fused.linear(raw, T.Q8_0, (2, 32), x)
        assert y.shape == (1, 2)
        assert fused.backend().name == "numpy"
        assert "simulated LLVM failure" in str(fused.backend().reason)
        assert len([r for r in caplog.records if "numpy kernels serve" in r.getMessage()]) == 1
    finally:
        fused.set_backend(None)
    assert fused.backend().name == "numba"


@pytest.mark.parametrize("name", ["bogus"])
def test_unknown_backend_variable(tmp_path, name: str) -> None:
    code = """
    import json
    from aioexperts._compute import fused
    print(json.dumps({"backend": fused.backend().name, "reason": fused.backend().reason}))
    """
    result = run_python(code, cache=tmp_path, AIOEXPERTS_KERNELS=name)
    assert result["backend"] == "numpy"
    assert "is not 'numba' or 'numpy'" in str(result["reason"])


def test_numba_disable_jit_gives_the_numpy_kernels_with_one_log_line(tmp_path) -> None:
    """``NUMBA_DISABLE_JIT=1`` makes ``njit`` return plain functions (no ``.stats``, no ``.compile``):
    numba is then unusable, and ``runner.moe`` runs on the numpy kernels."""
    import numpy as np

    from aioexperts.testing import SyntheticSpec, write_synthetic_model

    model = tmp_path / "small.gguf"
    write_synthetic_model(model, SyntheticSpec(n_layer=1, n_embd=256, n_ff_exp=256, n_expert=4, n_expert_used=2))
    code = f"""
    import json, logging
    import anyio
    import numpy as np
    records = []
    class Keep(logging.Handler):
        def emit(self, record): records.append(record.getMessage())
    logging.getLogger("aioexperts").addHandler(Keep())
    logging.getLogger("aioexperts").setLevel(logging.INFO)
    import aioexperts
    from aioexperts._compute import fused

    async def main():
        io = aioexperts.IOOptions(backend="threads")
        async with aioexperts.open({str(model)!r}, slots=4, io=io) as store:
            runner = aioexperts.MoERunner(store)
            layer = next(iter(store.layout.layers))
            x = np.random.default_rng(0).standard_normal((3, store.layout.n_embd)).astype(np.float32)
            outs = [await runner.moe(layer, x) for _ in range(2)]
            return outs[0], outs[1]

    a, b = anyio.run(main)
    print(json.dumps({{
        "backend": fused.backend().name, "reason": fused.backend().reason, "logs": records,
        "shape": list(a.shape), "finite": bool(np.isfinite(a).all()), "same": bool(np.array_equal(a, b)),
        "out": a.astype(float).tolist(),
    }}))
    """
    disabled = run_python(code, cache=tmp_path, NUMBA_DISABLE_JIT="1")
    reference = run_python(code, cache=tmp_path, AIOEXPERTS_KERNELS="numpy")
    assert disabled["backend"] == "numpy"
    assert "NUMBA_DISABLE_JIT" in str(disabled["reason"])
    assert disabled["shape"] == reference["shape"] == [3, 256]
    assert disabled["finite"] and disabled["same"]
    got, want = np.array(disabled["out"]), np.array(reference["out"])
    assert np.abs(want).sum() > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    logs = [line for line in disabled["logs"] if "numpy kernels serve" in line]  # type: ignore[union-attr]
    assert len(logs) == 1 and "NUMBA_DISABLE_JIT" in logs[0], disabled["logs"]


def test_two_threads_decorating_at_once_each_see_the_kernel_cache_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel()`` sets numba's process-wide ``CACHE_DIR`` around each decoration: two threads at once
    (kernel modules imported by compute-pool threads) made numba read the other's restored ``""`` and
    create a cache folder relative to the working directory."""
    import threading
    import time

    import numba

    folder = jit.jit_status().cache_dir
    if folder is None:
        pytest.skip("no kernel cache folder here")
    seen: list[str] = []
    real_njit = numba.njit

    def slow_njit(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        def decorate(fn):  # type: ignore[no-untyped-def]
            seen.append(numba.config.CACHE_DIR)  # numba reads it more than once while it decorates
            time.sleep(0.01)
            seen.append(numba.config.CACHE_DIR)
            return fn

        return decorate

    monkeypatch.setattr(numba, "njit", slow_njit)
    threads = [threading.Thread(target=lambda: jit.kernel()(lambda x: x)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(numba, "njit", real_njit)
    assert len(seen) == 12 and set(seen) == {os.fspath(folder)}, set(seen)
