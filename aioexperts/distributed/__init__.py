"""Expert parallelism on Ray: shards that own and compute a share of the experts (docs/distributed.md).

Each :class:`ExpertShard` (a Ray actor, one per node or per SSD) opens the model with its own store
and serves only the experts a :class:`Placement` gives it; a :class:`ShardedRunner` (an
:class:`aioexperts.MoERunner`) routes locally and sends each layer's rows to the owners of the
selected experts, one call per owner per layer. Only activations cross the network.

Placements are made from routing traces (:func:`round_robin_placement`,
:func:`frequency_balanced_placement`, :func:`coactivation_placement`) and saved as JSON;
:func:`simulate_shards` replays a trace against one without Ray. Ray is the optional extra
``aioexperts[ray]``; importing this package does not import it (only starting or calling shards does).
"""

from .placement import PLACEMENT_FORMAT as PLACEMENT_FORMAT
from .placement import PLACEMENT_METHODS as PLACEMENT_METHODS
from .placement import Placement as Placement
from .placement import coactivation_placement as coactivation_placement
from .placement import frequency_balanced_placement as frequency_balanced_placement
from .placement import make_placement as make_placement
from .placement import round_robin_placement as round_robin_placement
from .runner import DEFAULT_CALL_TIMEOUT as DEFAULT_CALL_TIMEOUT
from .runner import ShardedRunner as ShardedRunner
from .shard import DEFAULT_MAX_RESTARTS as DEFAULT_MAX_RESTARTS
from .shard import ExpertShard as ExpertShard
from .shard import expert_shard_actor as expert_shard_actor
from .shard import start_shards as start_shards
from .simulate import ShardSimulation as ShardSimulation
from .simulate import calls_per_step as calls_per_step
from .simulate import simulate_shards as simulate_shards

__all__ = (
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_MAX_RESTARTS",
    "PLACEMENT_FORMAT",
    "PLACEMENT_METHODS",
    "ExpertShard",
    "Placement",
    "ShardSimulation",
    "ShardedRunner",
    "calls_per_step",
    "coactivation_placement",
    "expert_shard_actor",
    "frequency_balanced_placement",
    "make_placement",
    "round_robin_placement",
    "simulate_shards",
    "start_shards",
)
