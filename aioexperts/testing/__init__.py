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
- :func:`write_dsv4_model` writes a whole ``deepseek4`` model of the geometry a :class:`DSV4Spec`
  gives (default :data:`DSV4_SPEC`: DeepSeek-V4-Flash's shapes, 4 layers, Q2_K experts, about 9.1 GB):
  compressed attention, hyper-connections and hash-routed layers, random weights, the same vocabulary;
  :data:`TINY_DSV4_SPEC` is its layout at a test size.
- :func:`builtin_model_path` is the path of the built-in full model (:data:`FULL_SPEC`, about
  2.9 GB), written once into the user cache (``$AIOEXPERTS_CACHE``, else ``~/.cache/aioexperts``):
  what the examples of README.md and docs/ open. ``$AIOEXPERTS_BUILTIN_SIZE=tiny`` makes it
  :data:`TINY_FULL_SPEC`, the same architecture at a test size (about 2 MB).
- The built-in models in the user cache (:func:`cache_dir`), written once and reused, safely when
  two processes ask at once: :func:`ensure_bench_model` (:data:`BENCH_SPEC`, ``aioexperts-bench``)
  and :func:`ensure_full_model` (:data:`FULL_SPEC` of :data:`DEFAULT_FULL_LAYERS` layers,
  ``aioexperts-run`` and ``aioexperts-serve``); :func:`print_progress` prints a build's progress
  (its sizes by :func:`progress_bytes`, in the unit that fits).
  :data:`SKEWED_SPEC` is the full model with skewed routing. :func:`ensure_dsv4_model` is the
  DeepSeek-V4-geometry model (:data:`DSV4_SPEC`, 4 layers by default, about 9.1 GB; the benches'
  ``--model dsv4-flash``), :func:`dsv4_model_path` where it lives.
- :func:`memory_cgroups` lists this process's memory cgroups (the slab budget reads its limit from
  them; the bench makes its memory-limited groups inside them).
- :class:`ScriptedSampler` makes the model say chosen text (its sampler ignores the logits): for
  end-to-end tests of what reads replies (the server's tool calls, reasoning).
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

from .._cgroups import memory_cgroups as memory_cgroups
from ._builtin import BUILTIN_SIZE_ENV as BUILTIN_SIZE_ENV
from ._builtin import TINY_FULL_SPEC as TINY_FULL_SPEC
from ._builtin import builtin_model_path as builtin_model_path
from ._builtin import dsv4_model_path as dsv4_model_path
from ._builtin import ensure_dsv4_model as ensure_dsv4_model
from ._builtin import ensure_full_model as ensure_full_model
from ._builtin import full_model_path as full_model_path
from ._cache import cache_dir as cache_dir
from ._cache import print_progress as print_progress
from ._cache import progress_bytes as progress_bytes
from ._dsv4_model import DSV4_SPEC as DSV4_SPEC
from ._dsv4_model import TINY_DSV4_SPEC as TINY_DSV4_SPEC
from ._dsv4_model import DSV4Spec as DSV4Spec
from ._dsv4_model import write_dsv4_model as write_dsv4_model
from ._fake_backend import FakeBackend as FakeBackend
from ._full_model import DEFAULT_FULL_LAYERS as DEFAULT_FULL_LAYERS
from ._full_model import FULL_SPEC as FULL_SPEC
from ._full_model import SKEWED_SPEC as SKEWED_SPEC
from ._full_model import FullModelSpec as FullModelSpec
from ._full_model import Progress as Progress
from ._full_model import write_full_model as write_full_model
from ._model_cache import BENCH_NAME as BENCH_NAME
from ._model_cache import bench_model_path as bench_model_path
from ._model_cache import ensure_bench_model as ensure_bench_model
from ._scripted import ScriptedSampler as ScriptedSampler
from ._synthetic import BENCH_SPEC as BENCH_SPEC
from ._synthetic import SyntheticSpec as SyntheticSpec
from ._synthetic import tiny_moe_writer as tiny_moe_writer
from ._synthetic import write_synthetic_model as write_synthetic_model

__all__ = (
    "BENCH_NAME",
    "BENCH_SPEC",
    "BUILTIN_SIZE_ENV",
    "DEFAULT_FULL_LAYERS",
    "DSV4_SPEC",
    "FULL_SPEC",
    "SKEWED_SPEC",
    "ScriptedSampler",
    "TINY_DSV4_SPEC",
    "TINY_FULL_SPEC",
    "DSV4Spec",
    "FakeBackend",
    "FullModelSpec",
    "Progress",
    "SyntheticSpec",
    "bench_model_path",
    "builtin_model_path",
    "cache_dir",
    "dsv4_model_path",
    "ensure_bench_model",
    "ensure_dsv4_model",
    "ensure_full_model",
    "full_model_path",
    "memory_cgroups",
    "print_progress",
    "progress_bytes",
    "tiny_moe_writer",
    "write_dsv4_model",
    "write_full_model",
    "write_synthetic_model",
)
