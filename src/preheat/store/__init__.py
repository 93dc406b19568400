"""The node-local content-addressed model store.

from preheat.store import NodeStore
store = NodeStore("/var/lib/preheat/node-a", capacity=200 * 2**30)
result = store.pull("https://origin/models/llama/preheat-manifest.json")
store.lease(result.manifest_digest, "replica-1")
"""

from preheat.store.evict import EvictionPlan, SnapshotInfo, plan_eviction
from preheat.store.store import NodeStore, PullResult, Usage, VerifyReport

__all__ = [
    "EvictionPlan",
    "NodeStore",
    "PullResult",
    "SnapshotInfo",
    "Usage",
    "VerifyReport",
    "plan_eviction",
]
