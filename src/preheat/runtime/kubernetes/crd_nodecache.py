"""The ``NodeCache`` status schema: one node store's inventory as its agent writes it.

Capacity and use, the revisions held (state, bytes, progress, leases), eviction order,
images, and the agent's peer fields (``status.peer``: URL, blobs, fill progress) and
last warm-ups. Its kind, spec and printer columns are in :mod:`crds`.
"""

from __future__ import annotations

from preheat.runtime.kubernetes.crd_schema import (
    Schema,
    array,
    boolean,
    integer,
    number,
    obj,
    string,
)

__all__ = ["nodecache_status_props"]


def nodecache_status_props() -> dict[str, Schema]:
    """``status`` properties of a NodeCache (``crds`` adds the conditions)."""
    return {
        "capacityBytes": integer(minimum=0),
        "usedBytes": integer(minimum=0),
        "freeBytes": integer(minimum=0),
        "revisionCount": integer(minimum=0),
        "revisions": array(
            obj(
                {
                    "revision": string(),
                    "source": string("Redacted source ref (no credentials)."),
                    "bytes": integer(minimum=0),
                    "state": string(enum=["Filling", "Ready", "Failed", "Evicting"]),
                    "pinned": boolean(),
                    "leases": integer(minimum=0),
                    "lastUsed": string(format="date-time"),
                    "readyAt": string("When the snapshot arrived.", format="date-time"),
                    "reason": string(
                        "Why a Failed fill failed: NoRoom when the store cannot make room "
                        "now (pinned, leased or reserved copies hold it; retried)."
                    ),
                },
                required=("revision", "state"),
            )
        ),
        "images": array(
            obj(
                {
                    "image": string("registry/repository:tag (or @digest), normalised."),
                    "digest": string("What the tag resolved to (resolved once)."),
                    "bytes": integer(minimum=0),
                    "state": string(enum=["Pulling", "Ready", "Failed"]),
                    "readyAt": string("When the pull finished.", format="date-time"),
                    "references": integer(minimum=0),
                    "message": string("Why the last pull failed (redacted)."),
                },
                required=("image", "state"),
            ),
            "Images the node store holds or pulls (ModelImageCache pre-pulls).",
        ),
        "evictionOrder": array(string(), "Next eviction candidates, first evicted first."),
        "revocations": array(
            obj({"key": string(), "reason": string()}, required=("key",)),
            "Revocation keys this agent applied to the node store.",
        ),
        "lastFailure": obj(
            {"time": string(format="date-time"), "reason": string(), "message": string()}
        ),
        # peers (docs/peers.md): where this node serves its blobs, which it holds
        "peer": obj(
            {
                "url": string("The agent's peer blob server (token from a Secret)."),
                "blobs": array(string(), "sha256 of the blobs of held revisions."),
                "filling": array(
                    obj(
                        {
                            "blob": string("sha256 of a blob this node is filling."),
                            "pieces": integer(minimum=1),
                            "landed": integer("Pieces landed and verified.", minimum=0),
                            "verified": string("Those pieces' indices, e.g. 0-11,13."),
                        },
                        required=("blob",),
                    ),
                    "Fill progress peers follow (bounded; written at most every second).",
                ),
            }
        ),
        "warmups": array(
            obj(
                {
                    "revision": string(),
                    "mode": string(enum=["origin", "peer", "cache"]),
                    "seconds": number(minimum=0),
                    "bytesFrom": obj(
                        {
                            "origin": integer(minimum=0),
                            "peer": integer(minimum=0),
                            "cache": integer(minimum=0),
                        }
                    ),
                },
                required=("revision", "mode"),
            ),
            "The last finished warm-ups and where their bytes came from.",
        ),
    }
