"""Helpers for testing code that uses aioexperts: synthetic models and a scriptable read backend.

Hosts that build on aioexperts (their own kernels, a server, a scheduler) need models to test
with and reads they can steer; both are here, and neither needs a real model or io_uring.

- :func:`write_synthetic_model` writes a valid MoE GGUF file (or a split set) of any geometry
  described by a :class:`SyntheticSpec`: real ggml blocks (Q4_K and the other types ``gguf`` can
  quantize) of numerically sane random weights, so the runner's outputs stay finite over many
  tokens. :data:`BENCH_SPEC` is the built-in bench model (Qwen3-30B-A3B expert geometry, about
  2.7 GB); :func:`tiny_moe_writer` starts a one-layer F32 MoE file to which a test adds tensors
  of its own (row tables, say) before writing it.
- :func:`write_full_model` writes a whole model (attention, norms, embeddings, head and experts)
  of the geometry a :class:`FullModelSpec` gives (default :data:`FULL_SPEC`: Qwen3-30B-A3B-shaped
  ``qwen3moe``), with a small byte-level BPE vocabulary and a ChatML template, random weights
  scaled so the residual stream stays finite; its text is random. (``tokenizers`` trains the
  vocabulary: the ``text`` extra.)
- :func:`builtin_model_path` is the path of the built-in full model (:data:`FULL_SPEC`, about
  2.9 GB), written once into the user cache (``$AIOEXPERTS_CACHE``, else ``~/.cache/aioexperts``):
  what the examples of README.md and docs/ open. ``$AIOEXPERTS_BUILTIN_SIZE=tiny`` makes it
  :data:`TINY_FULL_SPEC`, the same architecture at a test size (about 2 MB).
- :class:`FakeBackend` is an :class:`~aioexperts.backends.IOBackend` whose completions arrive when
  the test says so, in the order it says, short or failed as it says:
  ``aioexperts.open(path, io=IOOptions(backend=lambda *a: FakeBackend(*a, auto=True)))``.

Example:
    >>> import tempfile, pathlib, aioexperts
    >>> from aioexperts.testing import SyntheticSpec, write_synthetic_model
    >>> spec = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)
    >>> paths = write_synthetic_model(pathlib.Path(tempfile.mkdtemp()) / "tiny.gguf", spec)
    >>> aioexperts.build_layout(aioexperts.open_model(paths[0])).layers[0].n_experts
    8
"""

from ._builtin import TINY_FULL_SPEC as TINY_FULL_SPEC
from ._builtin import builtin_model_path as builtin_model_path
from ._fake_backend import FakeBackend as FakeBackend
from ._full_model import FULL_SPEC as FULL_SPEC
from ._full_model import FullModelSpec as FullModelSpec
from ._full_model import write_full_model as write_full_model
from ._synthetic import BENCH_SPEC as BENCH_SPEC
from ._synthetic import SyntheticSpec as SyntheticSpec
from ._synthetic import tiny_moe_writer as tiny_moe_writer
from ._synthetic import write_synthetic_model as write_synthetic_model

__all__ = (
    "BENCH_SPEC",
    "FULL_SPEC",
    "FakeBackend",
    "FullModelSpec",
    "SyntheticSpec",
    "TINY_FULL_SPEC",
    "builtin_model_path",
    "tiny_moe_writer",
    "write_full_model",
    "write_synthetic_model",
)
