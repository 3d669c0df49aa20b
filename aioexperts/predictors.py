"""Extension point: next-layer expert predictors, which choose what an MoE runner prefetches.

Give a predictor by name (``PrefetchOptions(predictor="previous")``) or as an instance of a
subclass of :class:`Predictor`. :mod:`aioexperts.predictors` also has the built-in ones and the
registry :data:`PREDICTORS`.
"""

from ._predict.predictors import PREDICTORS as PREDICTORS
from ._predict.predictors import FrequencyPredictor as FrequencyPredictor
from ._predict.predictors import NextRouterPredictor as NextRouterPredictor
from ._predict.predictors import NullPredictor as NullPredictor
from ._predict.predictors import Predictor as Predictor
from ._predict.predictors import PreviousTokenPredictor as PreviousTokenPredictor
from ._predict.predictors import make_predictor as make_predictor
from ._predict.predictors import observe_skipped as observe_skipped

__all__ = (
    "PREDICTORS",
    "FrequencyPredictor",
    "NextRouterPredictor",
    "NullPredictor",
    "PreviousTokenPredictor",
    "Predictor",
    "make_predictor",
    "observe_skipped",
)
