"""llama.cpp's pre-tokenizer table: ``tokenizer.ggml.pre`` -> pre-tokenizer type -> split regexes and flags.

Everything here follows ``src/llama-vocab.cpp`` of llama.cpp (the copy vendored by llama-cpp-python
0.3.36): the name -> type mapping and its flags are ``llama_vocab::impl::load`` (the ``tokenizer_pre == ...``
chain), the regexes are the constructor of ``llm_tokenizer_bpe``. The regexes are applied one after the
other, each splitting every piece the previous ones left (matches and the text between them both become
pieces), as ``unicode_regex_split`` (``src/unicode.cpp``) does.

llama.cpp runs four of these regexes (gpt-2, llama3, qwen2, qwen35) through hand-written splitters and
the rest through ``std::regex`` on a "collapsed" text in which every non-ASCII code point stands for its
Unicode category. :func:`onig_pattern` turns a regex of the second kind into the Oniguruma regex (the
engine of the ``tokenizers`` package) that splits the same way: ``\\p{Lu}``/``\\p{Ll}``/... become
``\\p{L}`` (collapsing maps every letter to one code point, so llama.cpp cannot tell the cases apart),
``\\d`` becomes ``[0-9]`` and ``$`` becomes ``\\z`` (``std::regex`` is ASCII-only and not multi-line).
Two custom splitters of llama.cpp are written as regexes (``\\p{AFMoE_digits}``: digit runs cut into
groups of three from the right). Pre-tokenizers that need code of their own are refused by name
(:data:`UNSUPPORTED_PRE`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ("REGEXES", "UNSUPPORTED_PRE", "PreTokenizer", "known_pre_values", "lookup_pre", "onig_pattern")

# --- the regexes of llm_tokenizer_bpe::llm_tokenizer_bpe (src/llama-vocab.cpp) ---------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#: GPT-2 (case LLAMA_VOCAB_PRE_TYPE_GPT2 / MPT / OLMO / JAIS / TRILLION / GRANITE_DOCLING); custom splitter
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
#: LLAMA3 / DBRX / SMAUG, "adapted" from (?i:...) in llama.cpp; custom splitter
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
#: QWEN2 / STABLELM2 / HUNYUAN / SOLAR_OPEN (and GROK_2, LAGUNA's second); custom splitter
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
#: QWEN35; custom splitter
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: the casing-aware word rule GPT4O / MINIMAX_M2 (llama.cpp's lookahead form of \p{Lu}* \p{Ll}+)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
)
_DEEPSEEK_LETTERS = (  # non-ASCII as escapes: the literal characters would not survive NFC normalisation
    "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_PUNCT_THEN_LETTERS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: AFMOE's \p{AFMoE_digits} and TINY_AYA's \d{1,3}(?=(?:\d{3})*\b): llama.cpp runs both through
#: unicode_regex_split_custom_afmoe (runs of \p{N} cut into a 1-2 digit head and groups of three)
_AFMOE_DIGITS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"

REGEXES: dict[str, tuple[str, ...]] = {
    "LLAMA3": (_LLAMA3,),
    "JAIS2": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "DBRX": (_LLAMA3,),
    "SMAUG": (_LLAMA3,),
    "DEEPSEEK_LLM": (
        "[\r\n]",
        r"\s?" + _DEEPSEEK_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    ),
    "DEEPSEEK3_LLM": (r"\p{N}{1,3}", _CJK_KANA, _PUNCT_THEN_LETTERS),
    "SPARK2_5": (
        r"\p{N}{1,3}",
        _CJK_KANA,
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    ),
    "YOUTU": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+"
        "|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        _CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "DEEPSEEK_CODER": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "FALCON": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        "[0-9][0-9][0-9]",
    ),
    "STARCODER": (r"\p{N}", _GPT2),
    "GPT2": (_GPT2,),
    "QWEN2": (_QWEN2,),
    "QWEN35": (_QWEN35,),
    "PORO": (_PORO,),
    "CHATGLM4": (_LLAMA3,),
    "VIKING": (_PORO, r"\p{N}"),
    "TEKKEN": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "CHAMELEON": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ),
    "GPT4O": (_GPT4O,),
    "GRANITE_EMB_MULTI": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "TINY_AYA": (
        _AFMOE_DIGITS,
        _CASED_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "SUPERBPE": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "BAILINGMOE": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "SEED_CODER": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "UFAKZEKA": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "GROK_2": (_QWEN2,),
    "AFMOE": (
        _AFMOE_DIGITS,
        # as in llama.cpp's source, U+8C48 (not U+F900) begins the third range
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
        "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        _PUNCT_THEN_LETTERS,
    ),
    "LAGUNA": ("[^\\n]+|[\\n]+", _QWEN2),
    "EXAONE_MOE": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "MINICPM5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # SPM-style BPE on raw UTF-8 (byte_encode = false): spaces become U+2581 first, newline runs split off
    "GEMMA4": ("[^\\n]+|[\\n]+",),
    "SARVAM_MOE": ("[^\\n]+|[\\n]+",),
    # default: in llm_tokenizer_bpe, for a missing tokenizer.ggml.pre or "default"
    "DEFAULT": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        "[0-9][0-9][0-9]",
    ),
}
for _alias, _same in (
    ("HUNYUAN_DENSE", "DEEPSEEK3_LLM"),
    ("JOYAI_LLM", "DEEPSEEK3_LLM"),
    ("HY_V4", "DEEPSEEK3_LLM"),
    ("REFACT", "STARCODER"),
    ("COMMAND_R", "STARCODER"),
    ("SMOLLM", "STARCODER"),
    ("CODESHELL", "STARCODER"),
    ("EXAONE", "STARCODER"),
    ("MINERVA", "STARCODER"),
    ("MELLUM2", "STARCODER"),
    ("MPT", "GPT2"),
    ("OLMO", "GPT2"),
    ("JAIS", "GPT2"),
    ("TRILLION", "GPT2"),
    ("GRANITE_DOCLING", "GPT2"),
    ("STABLELM2", "QWEN2"),
    ("HUNYUAN", "QWEN2"),
    ("SOLAR_OPEN", "QWEN2"),
    ("BLOOM", "PORO"),
    ("GPT3_FINNISH", "PORO"),
    ("MINIMAX_M2", "GPT4O"),
):
    REGEXES[_alias] = REGEXES[_same]

#: the regexes llama.cpp runs through hand-written splitters (unicode_regex_split_custom); their
#: semantics are those of the regex itself with llama.cpp's code point flags, so they go to onig unchanged
_CUSTOM_SPLIT = frozenset({_GPT2, _LLAMA3, _QWEN2, _QWEN35, _AFMOE_DIGITS})


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """One row of the table: what ``tokenizer.ggml.pre`` selects.

    Attributes:
        pre: the ``tokenizer.ggml.pre`` value ('' when the key is absent).
        type: llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_*`` name without the prefix.
        regexes: the split regexes in llama.cpp's form, applied in order.
        clean_spaces: llama.cpp's ``clean_spaces`` (the detokenizer drops the space before ``?!.,``...).
        ignore_merges: a pre-token that is itself a token is not merged (llama.cpp's ``ignore_merges``).
        add_bos: the default of "add BOS" before ``tokenizer.ggml.add_bos_token`` overrides it.
        no_bos: llama.cpp clears the BOS id (chatglm-bpe, glm4, glm5).
        byte_encode: GPT-2 byte-level BPE; False for the SPM-style BPE of gemma4 and sarvam-moe (raw
            UTF-8, ``▁`` for spaces, ``<0xXX>`` byte fallback: llama.cpp's ``escape_whitespaces``).
    """

    pre: str
    type: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False
    byte_encode: bool = True


# tokenizer.ggml.pre -> (type, clean_spaces, ignore_merges, add_bos, no_bos), in the order of the
# if/else chain of llama_vocab::impl::load (src/llama-vocab.cpp)
_T = True
_F = False
_PRE_TABLE: dict[str, tuple[str, bool, bool, bool, bool]] = {
    "": ("DEFAULT", _T, _F, _F, _F),  # missing key: llama.cpp warns "GENERATION QUALITY WILL BE DEGRADED"
    "default": ("DEFAULT", _T, _F, _F, _F),
    "minicpm5": ("MINICPM5", _T, _T, _F, _F),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        ("LLAMA3", _T, _T, _T, _F),
    ),
    "deepseek-llm": ("DEEPSEEK_LLM", _F, _F, _F, _F),
    "deepseek-coder": ("DEEPSEEK_CODER", _F, _F, _F, _F),
    "deepseek-v3": ("DEEPSEEK3_LLM", _F, _F, _F, _F),
    "spark2_5": ("SPARK2_5", _F, _F, _F, _F),
    "youtu": ("YOUTU", _F, _T, _F, _F),
    "falcon": ("FALCON", _T, _F, _F, _F),
    "mpt": ("MPT", _T, _F, _F, _F),
    "starcoder": ("STARCODER", _T, _F, _F, _F),
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
        ),
        ("GPT2", _T, _F, _F, _F),
    ),
    "jais-2": ("JAIS2", _T, _F, _F, _F),
    "refact": ("REFACT", _T, _F, _F, _F),
    "command-r": ("COMMAND_R", _F, _F, _F, _F),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), ("QWEN2", _F, _F, _F, _F)),
    "qwen35": ("QWEN35", _F, _F, _F, _F),
    "stablelm2": ("STABLELM2", _T, _F, _F, _F),
    "olmo": ("OLMO", _T, _F, _F, _F),
    "dbrx": ("DBRX", _T, _F, _F, _F),
    "smaug-bpe": ("SMAUG", _T, _F, _F, _F),
    "poro-chat": ("PORO", _F, _F, _F, _F),
    "chatglm-bpe": ("CHATGLM4", _T, _F, _F, _T),
    "glm4": ("CHATGLM4", _T, _T, _F, _T),
    "glm5": ("CHATGLM4", _T, _T, _F, _T),
    "viking": ("VIKING", _F, _F, _F, _F),
    "jais": ("JAIS", _T, _F, _F, _F),
    "tekken": ("TEKKEN", _F, _T, _T, _F),
    "smollm": ("SMOLLM", _F, _F, _F, _F),
    "codeshell": ("CODESHELL", _T, _F, _F, _F),
    "bloom": ("BLOOM", _T, _F, _F, _F),
    "gpt3-finnish": ("GPT3_FINNISH", _T, _F, _F, _F),
    "exaone": ("EXAONE", _T, _F, _F, _F),
    "exaone-moe": ("EXAONE_MOE", _T, _F, _F, _F),
    "chameleon": ("CHAMELEON", _F, _F, _T, _F),
    "minerva-7b": ("MINERVA", _T, _F, _F, _F),
    "megrez": ("QWEN2", _T, _F, _F, _F),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), ("GPT4O", _F, _F, _F, _F)),
    "granite-embed-multi-97m": ("GRANITE_EMB_MULTI", _F, _T, _F, _F),
    "tiny_aya": ("TINY_AYA", _F, _F, _F, _F),
    "cohere2moe": ("TINY_AYA", _F, _F, _F, _F),
    "superbpe": ("SUPERBPE", _F, _F, _F, _F),
    "trillion": ("TRILLION", _F, _F, _F, _F),
    "granite-docling": ("GRANITE_DOCLING", _F, _F, _F, _F),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), ("BAILINGMOE", _F, _F, _F, _F)),
    "seed-coder": ("SEED_CODER", _F, _F, _F, _F),
    "hunyuan": ("HUNYUAN", _F, _F, _F, _F),
    "hunyuan-dense": ("HUNYUAN_DENSE", _F, _F, _F, _F),
    "hy_v4": ("HY_V4", _F, _F, _F, _F),
    "joyai-llm": ("JOYAI_LLM", _F, _F, _F, _F),
    "ufakzeka": ("UFAKZEKA", _F, _F, _F, _F),
    "grok-2": ("GROK_2", _F, _F, _F, _F),
    "afmoe": ("AFMOE", _F, _F, _F, _F),
    "laguna": ("LAGUNA", _F, _F, _F, _F),
    "minimax-m2": ("MINIMAX_M2", _F, _F, _F, _F),
    "solar-open": ("SOLAR_OPEN", _F, _F, _F, _F),
    "mellum2": ("MELLUM2", _T, _F, _F, _F),
    # tokenizer.ggml.model "gemma4" sets tokenizer_pre = "gemma4"; llama.cpp then forces add_bos on
    "gemma4": ("GEMMA4", _T, _F, _T, _F),
    "granite-embed-multi-311m": ("GEMMA4", _T, _F, _T, _F),
    "sarvam-moe": ("SARVAM_MOE", _F, _F, _F, _F),
}

#: values llama.cpp knows that need splitting or tokenizing code of their own: refused by name
UNSUPPORTED_PRE: dict[str, str] = {
    "kimi-k2": "llama.cpp splits it with a hand-written Han-aware splitter and no merges",
    "whitespace": "the whitespace tokenizer of jina embeddings",
}


def lookup_pre(pre: str | None) -> PreTokenizer | None:
    """The table row for a ``tokenizer.ggml.pre`` value (None: absent), or None when llama.cpp does not know it.

    Args:
        pre: the value, or None when the key is absent (llama.cpp then uses ``default``).

    Returns:
        The row, or None for a value neither llama.cpp's table nor :data:`UNSUPPORTED_PRE` holds.
    """
    row = _PRE_TABLE.get(pre or "")
    if row is None:
        return None
    type_, clean, ignore, add_bos, no_bos = row
    raw = type_ in ("GEMMA4", "SARVAM_MOE")
    return PreTokenizer(pre or "", type_, REGEXES[type_], clean, ignore, add_bos, no_bos, byte_encode=not raw)


def known_pre_values() -> list[str]:
    """Every ``tokenizer.ggml.pre`` value the table maps (for docs and error messages)."""
    return sorted(k for k in _PRE_TABLE if k)


_CASE_CLASSES = re.compile(r"\\p\{L[ultmo]\}")


def onig_pattern(regex: str) -> str:
    """The Oniguruma regex that splits like llama.cpp's use of ``regex`` (see the module docstring).

    Args:
        regex: one regex of :data:`REGEXES`.

    Returns:
        The pattern for ``tokenizers.pre_tokenizers.Split``.
    """
    if regex in _CUSTOM_SPLIT:
        return regex
    out = _CASE_CLASSES.sub(r"\\p{L}", regex)
    out = out.replace(r"\d", "[0-9]")
    if out.endswith("$"):
        out = out[:-1] + r"\z"
    return out
