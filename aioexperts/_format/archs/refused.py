"""The MoE architectures of llama.cpp's src/llama-arch.cpp that are refused, each with what is missing.

The reason is the message of the :class:`~aioexperts._errors.UnsupportedTypeError` that
``MoEHParams.from_metadata`` raises for it; the first three name what their graphs
(src/models/arctic.cpp, smallthinker.cpp, grovemoe.cpp) do that the executor does not.
"""

from aioexperts._format.archs._base import Architecture

_NOT_REVIEWED = "its MoE graph has not been reviewed against llama.cpp's source"

ARCHS = (
    Architecture(
        "arctic",
        # arctic.cpp
        refused="arctic adds a parallel dense FFN (ffn_up/gate/down on ffn_norm) residual to the MoE block, which "
        "reads its own norm (ffn_norm_exps) of the attention input",
    ),
    Architecture(
        "smallthinker",
        # smallthinker.cpp
        refused="smallthinker routes on the block input before attention while its experts read the FFN "
        "input, and uses ReLU-gated experts",
    ),
    # grovemoe.cpp
    Architecture("grovemoe", refused="grovemoe routes through adjugate expert groups (ffn_*_chexps)"),
    Architecture("nomic-bert-moe", refused=_NOT_REVIEWED + " (an encoder)"),
    Architecture("jamba", refused=_NOT_REVIEWED),
    Architecture("cohere2moe", refused=_NOT_REVIEWED),
    Architecture("deepseek2-ocr", refused=_NOT_REVIEWED),
    Architecture("deepseek32", refused=_NOT_REVIEWED),
    Architecture("glm-dsa", refused=_NOT_REVIEWED),
    Architecture("nemotron_h_moe", refused=_NOT_REVIEWED + " (latent experts, squared-ReLU without a gate)"),
    *(
        Architecture(name, refused=_NOT_REVIEWED)
        for name in (
            "exaone-moe",
            "granitehybrid",
            "afmoe",
            "laguna",
            "hy_v3",
            "hunyuan_vl",
            "lfm2moe",
            "llada-moe",
            "rnd1",
            "mimo2",
            "step35",
            "kimi-linear",
            "mistral4",
            "paddleocr",
            "mellum",
            "minicpm",
            "refact",
            "mistral3",
            "llama-embed",
            "gemma4",
        )
    ),
)
