"""Extension point: eviction policies of the expert cache.

Give a policy by name (``CacheOptions(policy="lfuda")``) or as an instance of a subclass of
:class:`EvictionPolicy` (one instance per store). The cache calls the policy on the event-loop
thread: ``admit`` when an expert becomes resident, ``access`` on every hit, ``victim`` to choose
what to evict among the keys it allows, ``remove`` when a key leaves.
"""

from ._cache.eviction import LFU as LFU
from ._cache.eviction import LFUDA as LFUDA
from ._cache.eviction import LRU as LRU
from ._cache.eviction import POLICY_NAMES as POLICY_NAMES
from ._cache.eviction import EvictionPolicy as EvictionPolicy
from ._cache.eviction import Key as Key
from ._cache.eviction import make_policy as make_policy

__all__ = ("LFU", "LFUDA", "LRU", "POLICY_NAMES", "EvictionPolicy", "Key", "make_policy")
