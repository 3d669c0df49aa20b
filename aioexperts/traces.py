"""Routing traces and what they tell about a cache: replays, hit rates, slot counts.

A :class:`~aioexperts.RoutingTrace` records which experts each token chose in each MoE layer
(``MoERunner(store, record_trace=True)``, ``aioexperts-trace``); the functions here replay it
through a simulated slab of ``n`` slots under each eviction policy and Belady's offline optimum
(:data:`BELADY`), without reading a byte. ``aioexperts-trace`` prints the same figures.
"""

from ._predict.simulate import BELADY as BELADY
from ._predict.simulate import REPLAY_POLICY_NAMES as REPLAY_POLICY_NAMES
from ._predict.simulate import ReplayResult as ReplayResult
from ._predict.simulate import expert_frequencies as expert_frequencies
from ._predict.simulate import format_bytes as format_bytes
from ._predict.simulate import format_replay_table as format_replay_table
from ._predict.simulate import replay as replay
from ._predict.simulate import replay_fractions as replay_fractions
from ._predict.simulate import slot_table as slot_table
from ._predict.simulate import slots_for_hit_rate as slots_for_hit_rate
from ._predict.simulate import slots_for_hit_rates as slots_for_hit_rates
from ._predict.trace import RoutingTrace as RoutingTrace
from ._predict.trace import skewed_random_trace as skewed_random_trace
from ._predict.trace import uniform_random_trace as uniform_random_trace

__all__ = (
    "BELADY",
    "REPLAY_POLICY_NAMES",
    "ReplayResult",
    "RoutingTrace",
    "expert_frequencies",
    "format_bytes",
    "format_replay_table",
    "replay",
    "replay_fractions",
    "skewed_random_trace",
    "slot_table",
    "slots_for_hit_rate",
    "slots_for_hit_rates",
    "uniform_random_trace",
)
