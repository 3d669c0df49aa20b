"""aioexperts: stream the routed experts of Mixture-of-Experts GGUF models from SSD.

Two objects: :func:`open` gives an :class:`ExpertStore` (files, slab, reads, cache;
``store.experts(layer, ids)``), and an :class:`MoERunner` runs MoE layers on top of it
(``await runner.moe(layer, x)``). :func:`load` runs the whole model on top of both
(``await model.logits(ids)``, ``model.generate(ids, max_tokens=...)``; docs/model.md).
The public API is re-exported here; extension points live in :mod:`aioexperts.backends`,
:mod:`aioexperts.policies` and :mod:`aioexperts.predictors`, cache simulations over routing traces in
:mod:`aioexperts.traces`, test helpers (synthetic GGUF models, a scriptable backend) in
:mod:`aioexperts.testing`; the user commands in :mod:`aioexperts.cli`; the implementation lives in
private modules.
"""

from ._batch import DecodeStream as DecodeStream
from ._cache.mapped_cache import PageCacheStatistics as PageCacheStatistics
from ._cache.stats import StoreStatistics as StoreStatistics
from ._compute.fused import WarmupReport as WarmupReport
from ._errors import AioExpertsError as AioExpertsError
from ._errors import BackendUnavailableError as BackendUnavailableError
from ._errors import ChatTemplateError as ChatTemplateError
from ._errors import ConfigError as ConfigError
from ._errors import ContextLengthError as ContextLengthError
from ._errors import EvictionPolicyError as EvictionPolicyError
from ._errors import ExpertReadError as ExpertReadError
from ._errors import FormatError as FormatError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import LayoutError as LayoutError
from ._errors import MissingShardError as MissingShardError
from ._errors import NonFiniteError as NonFiniteError
from ._errors import OptionalDependencyError as OptionalDependencyError
from ._errors import PlacementError as PlacementError
from ._errors import ShardError as ShardError
from ._errors import ShardTimeoutError as ShardTimeoutError
from ._errors import SlabExhaustedError as SlabExhaustedError
from ._errors import SlotTimeoutError as SlotTimeoutError
from ._errors import StaleMapError as StaleMapError
from ._errors import StoreClosedError as StoreClosedError
from ._errors import TokenizerError as TokenizerError
from ._errors import UnsupportedTypeError as UnsupportedTypeError
from ._errors import VocabularyError as VocabularyError
from ._format.expert_map import ExpertMap as ExpertMap
from ._format.expert_map import check_map_matches_layout as check_map_matches_layout
from ._format.expert_map import read_expert_map as read_expert_map
from ._format.expert_map import write_expert_map as write_expert_map
from ._format.hparams import MoEHParams as MoEHParams
from ._format.layout import Bank as Bank
from ._format.layout import ExpertLayout as ExpertLayout
from ._format.layout import ExpertLocation as ExpertLocation
from ._format.layout import MoELayer as MoELayer
from ._format.layout import Segment as Segment
from ._format.layout import build_layout as build_layout
from ._format.model import GGUFModel as GGUFModel
from ._format.model import TensorInfo as TensorInfo
from ._format.model import open_model as open_model
from ._format.views import ExpertView as ExpertView
from ._format.views import ProjectionView as ProjectionView
from ._model.memory import MemoryLimit as MemoryLimit
from ._model.memory import read_memory_limit as read_memory_limit
from ._model.model import Model as Model
from ._model.model import ModelStatistics as ModelStatistics
from ._model.model import load as load
from ._model.sessions import Generation as Generation
from ._model.sessions import ModelSequence as ModelSequence
from ._model.text import ChatSession as ChatSession
from ._model.text import GenerationStatistics as GenerationStatistics
from ._model.text import TextStream as TextStream
from ._model.text import TokenStream as TokenStream
from ._options import CacheOptions as CacheOptions
from ._options import IOOptions as IOOptions
from ._options import MissTier as MissTier
from ._options import PageCacheOptions as PageCacheOptions
from ._pipeline import ComputeStep as ComputeStep
from ._pipeline import LayerStep as LayerStep
from ._pipeline import MoELayersResult as MoELayersResult
from ._predict.trace import RoutingTrace as RoutingTrace
from ._quant.sidecar import write_miss_tier as write_miss_tier
from ._runner import MoEResult as MoEResult
from ._runner import MoERunner as MoERunner
from ._runner import PrefetchOptions as PrefetchOptions
from ._runner import RouteStep as RouteStep
from ._runner import RunnerStatistics as RunnerStatistics
from ._store import ExpertStore as ExpertStore
from ._store import open as open  # noqa: A004
from ._text.chat import ChatTemplate as ChatTemplate
from ._text.constrain import TokenConstraint as TokenConstraint
from ._text.sampling import SampledToken as SampledToken
from ._text.sampling import Sampler as Sampler
from ._text.sampling import SamplingOptions as SamplingOptions
from ._text.sampling import StopMatcher as StopMatcher
from ._text.tokenizer import IncrementalDecoder as IncrementalDecoder
from ._text.tokenizer import Tokenizer as Tokenizer
from ._text.toolcalls import REASONING_FORMATS as REASONING_FORMATS
from ._text.toolcalls import TOOL_CALL_FORMATS as TOOL_CALL_FORMATS
from ._text.toolcalls import Reply as Reply
from ._text.toolcalls import ReplyDelta as ReplyDelta
from ._text.toolcalls import ReplyParser as ReplyParser
from ._text.toolcalls import ToolCall as ToolCall
from ._text.toolcalls import call_prefix as call_prefix
from ._text.toolcalls import thinking_open as thinking_open
from ._text.toolcalls import tool_call_format as tool_call_format
from ._timeline import Timeline as Timeline

__version__ = "0.2.0"

_RENAMED = {
    "EngineClosedError": "StoreClosedError",
    "EngineStatistics": "StoreStatistics",
    "TokenResult": "MoELayersResult",  # 0.3: it is the MoE layers of a token, not a model forward pass
}


def __getattr__(name: str) -> object:
    """Names of 0.1 that were renamed (kept for one release, with a DeprecationWarning) or split."""
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(f"aioexperts.{name} is now aioexperts.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    if name == "Engine":
        raise AttributeError(
            "aioexperts.Engine was split in 0.2: aioexperts.open() gives an ExpertStore (experts(), statistics()), "
            "aioexperts.MoERunner(store) runs moe()/moe_result()/run_moe_layers(); see CHANGELOG.md"
        )
    raise AttributeError(f"module 'aioexperts' has no attribute {name!r}")


__all__ = (
    "AioExpertsError",
    "BackendUnavailableError",
    "Bank",
    "CacheOptions",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatSession",
    "ComputeStep",
    "ConfigError",
    "ContextLengthError",
    "StoreClosedError",
    "StoreStatistics",
    "EvictionPolicyError",
    "ExpertLayout",
    "ExpertLocation",
    "DecodeStream",
    "ExpertMap",
    "ExpertReadError",
    "ExpertStore",
    "ExpertView",
    "FormatError",
    "GenerationStatistics",
    "GGUFModel",
    "Generation",
    "IOOptions",
    "IncrementalDecoder",
    "InvalidRequestError",
    "LayerStep",
    "LayoutError",
    "MemoryLimit",
    "MissTier",
    "MissingShardError",
    "Model",
    "ModelSequence",
    "ModelStatistics",
    "MoEHParams",
    "MoELayer",
    "MoELayersResult",
    "MoEResult",
    "MoERunner",
    "NonFiniteError",
    "OptionalDependencyError",
    "PageCacheOptions",
    "PageCacheStatistics",
    "PlacementError",
    "PrefetchOptions",
    "REASONING_FORMATS",
    "Reply",
    "ReplyDelta",
    "ReplyParser",
    "ProjectionView",
    "RouteStep",
    "RoutingTrace",
    "RunnerStatistics",
    "SampledToken",
    "Sampler",
    "SamplingOptions",
    "Segment",
    "ShardError",
    "ShardTimeoutError",
    "SlabExhaustedError",
    "SlotTimeoutError",
    "StaleMapError",
    "StopMatcher",
    "TOOL_CALL_FORMATS",
    "TensorInfo",
    "TextStream",
    "Timeline",
    "TokenStream",
    "TokenConstraint",
    "Tokenizer",
    "TokenizerError",
    "ToolCall",
    "UnsupportedTypeError",
    "VocabularyError",
    "WarmupReport",
    "build_layout",
    "check_map_matches_layout",
    "load",
    "open",
    "open_model",
    "read_expert_map",
    "read_memory_limit",
    "call_prefix",
    "thinking_open",
    "tool_call_format",
    "write_expert_map",
    "write_miss_tier",
)
