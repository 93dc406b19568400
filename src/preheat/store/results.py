"""What the store's operations return: frozen records for callers and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preheat.store.repair import Repair


@dataclass(frozen=True)
class PullResult:
    snapshot: Path
    revision: str
    manifest_digest: str
    bytes_fetched: int
    bytes_reused: int
    seconds: float
    bytes_resumed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "snapshot": str(self.snapshot),
            "revision": self.revision,
            "manifest_digest": self.manifest_digest,
            "bytes_fetched": self.bytes_fetched,
            "bytes_reused": self.bytes_reused,
            "bytes_resumed": self.bytes_resumed,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class Usage:
    capacity: int | None
    high_watermark: float
    used: int
    reserved: int
    disk_free: int
    free: int


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    bytes: int
    corrupt: tuple[tuple[str, str], ...]  # (expected digest, actual digest)
    removed_snapshots: tuple[str, ...]
    missing_snapshots: tuple[str, ...]
    seconds: float
    cleaned_tmp: int = 0
    repairs: tuple[Repair, ...] = ()  # what became of each corrupt blob a snapshot uses

    @property
    def ok(self) -> bool:
        """False when anything was corrupt or missing (even if it was repaired)."""
        return not self.corrupt and not self.missing_snapshots

    @property
    def unrepaired(self) -> tuple[Repair, ...]:
        return tuple(r for r in self.repairs if not r.repaired)
