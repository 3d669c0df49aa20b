"""The rules of a name llama.cpp does not know (not in :data:`LLAMA_CPP_ARCHS`): every key read where given.

:data:`LLAMA_CPP_ARCHS` is every architecture name of llama.cpp's src/llama-arch.cpp; a name in it
without an entry in the registry is refused, a name outside it takes :data:`GENERIC` (unverified:
llama.cpp cannot open such a file, so there is nothing to follow; the runner warns).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioexperts._errors import FormatError
from aioexperts._format.archs._base import GatingFunc, MoERule, Status

if TYPE_CHECKING:
    from aioexperts._format.keys import ArchKeys, ExpertCounts


def _width_optional(md: ArchKeys, counts: ExpertCounts, n_ff_exp: int) -> int:
    """A name llama.cpp does not know: the key if given (0: taken from the expert views later)."""
    if n_ff_exp < 0:
        raise FormatError(f"{md.key('expert_feed_forward_length')} must be >= 0, got {n_ff_exp}")
    return n_ff_exp


def _shared_generic(
    md: ArchKeys, counts: ExpertCounts, n_ff_exp: int, n_shared: int, n_ff_shexp: int
) -> tuple[int, int]:
    """A name llama.cpp does not know: the width key, else ``count * n_ff_exp``; a width means one."""
    width = n_ff_shexp or (n_ff_exp * n_shared)
    return (1 if width and not n_shared else n_shared), width


#: a name llama.cpp does not know: every key read where given, leading dense blocks included
GENERIC = MoERule(
    Status.GENERIC, None, GatingFunc.SOFTMAX, None, False, True, _width_optional, _shared_generic, dense_lead=True
)

#: Every architecture name of llama.cpp's src/llama-arch.cpp (LLM_ARCH_NAMES, read 2026-11-30). A name
#: outside this set and outside the registry takes the generic path (llama.cpp cannot open such a file).
LLAMA_CPP_ARCHS = frozenset(
    """clip llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
    nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2 qwen2moe
    qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe phi2 phi3 phimoe plamo plamo2 plamo3
    codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 gemma3n gemma4 gemma4-assistant
    gemma-embedding starcoder2 mamba mamba2 jamba falcon-h1 xverse command-r cohere2 cohere2moe dbrx olmo
    olmo2 olmoe openelm arctic deepseek deepseek2 deepseek2-ocr deepseek32 deepseek4 chatglm glm4 glm4moe
    glm-dsa bitnet t5 t5encoder jais jais2 nemotron nemotron_h nemotron_h_moe exaone exaone4 exaone-moe rwkv6
    rwkv6qwen2 rwkv7 arwkv7 granite granitemoe granitehybrid chameleon wavtokenizer-dec plm bailingmoe
    bailingmoe2 dots1 arcee afmoe laguna ernie4_5 ernie4_5-moe hunyuan-moe hunyuan-dense hunyuan_vl hy_v3
    smollm3 gpt-oss lfm2 lfm2moe dream smallthinker llada llada-moe seed_oss grovemoe apertus minimax-m2
    cogvlm rnd1 pangu-embedded mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35 llama-embed maincoder
    kimi-linear talkie mellum""".split()
)
