"""The exception tree of preheat.

    PreheatError
    ├── ConfigError(PreheatError, ValueError)        bad user input at an edge (CLI, YAML, HTTP body)
    ├── CacheError                                   node store
    │   ├── DigestMismatch(CacheError, ValueError)   bytes do not match the manifest digest
    │   ├── UnsafePath(CacheError, ValueError)       manifest path escapes the store root
    │   ├── InsufficientSpace(CacheError, OSError)   not enough room even after eviction
    │   │   └── WarmupDeferred(InsufficientSpace)    warm-up: room only by evicting unused warmed copies
    │   ├── SnapshotNotFound(CacheError, KeyError)
    │   ├── SnapshotInUse(CacheError)                leased: cannot be deleted
    │   ├── RevisionChanged(CacheError)              ref moved away from a pinned revision
    │   ├── GitBlobMismatch(DigestMismatch)          hf:// git file differs from its blob id
    │   ├── Revoked(CacheError, PermissionError)     digest/revision on the store's revocation list
    │   └── ImageInUse(CacheError)                   image referenced by an endpoint: not removed
    ├── FetchError                                   talking to an origin
    │   ├── OriginUnavailable(FetchError, ConnectionError)
    │   ├── ObjectNotFound(FetchError, FileNotFoundError)
    │   ├── TruncatedBody(FetchError, IOError)
    │   ├── RangeNotSupported(FetchError)            origin ignores Range: one stream per file
    │   ├── OriginChanged(FetchError)                bytes changed at the origin mid-fill
    │   ├── HubRepoNotFound(ObjectNotFound)          hf://: no such repo (or private, no access)
    │   ├── HubRevisionNotFound(ObjectNotFound)      hf://: no such branch, tag or commit
    │   ├── HubAccessDenied(FetchError, PermissionError)  hf://: gated, or the token is invalid
    │   └── RegistryError(FetchError)                OCI registry (images)
    │       ├── ImageNotFound(RegistryError, FileNotFoundError)  unknown repository/tag/digest
    │       ├── UnsupportedMediaType(RegistryError, ValueError)  manifest/config/layer type
    │       ├── ImageDigestMismatch(RegistryError, ValueError)   manifest bytes != digest
    │       ├── NoModelFiles(UnsupportedMediaType)         oci:// image without /models
    │       └── RegistryAuthError(RegistryError, PermissionError)
    │           └── CredentialHelperError(RegistryAuthError)  docker-credential-<name> failed
    ├── EngineError                                  simulated engine
    │   ├── PromptTooLong(EngineError, ValueError)   prompt + max_tokens exceed context / KV
    │   └── EngineUnavailable(EngineError, ConnectionError)
    ├── RouterError                                  router
    │   └── NoHealthyInstance(RouterError)
    └── ControlError                                 controller / fleet

Each area adds its own subclasses below its heading; third-party errors are translated
with ``raise ... from exc`` so callers only ever catch preheat's tree (or a builtin).
"""

from __future__ import annotations


class PreheatError(Exception):
    """Base of every error preheat raises on purpose."""


class ConfigError(PreheatError, ValueError):
    """Invalid user input; the message names the bad value and the fix."""


# --- node store -------------------------------------------------------------------------


class CacheError(PreheatError):
    """A node store operation failed."""


class DigestMismatch(CacheError, ValueError):
    """Fetched bytes do not match the digest the manifest promised."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(
            f"digest mismatch for {path!r}: expected sha256:{expected}, got sha256:{actual}"
        )
        self.path = path
        self.expected = expected
        self.actual = actual


class UnsafePath(CacheError, ValueError):
    """A manifest path would escape the store (absolute, '..', or a link)."""


class InsufficientSpace(CacheError, OSError):
    """The store cannot hold a fill even after evicting everything evictable.

    ``need``, ``free`` and ``evictable`` carry the numbers (bytes) when the store raised it.
    """

    need: int = 0
    free: int = 0
    evictable: int = 0


class WarmupDeferred(InsufficientSpace):
    """A warm-up would have to evict another warm-up's copy that no replica has used yet
    (``runtime.warm_room``); it is retried later, not given up."""


class SnapshotNotFound(CacheError, KeyError):
    """No snapshot with that revision or digest is in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SnapshotInUse(CacheError):
    """The snapshot is leased by a replica and cannot be deleted."""


class RevisionChanged(CacheError):
    """The ref no longer resolves to the revision the caller pinned (nothing was fetched)."""


class GitBlobMismatch(DigestMismatch):
    """A Hub file without LFS does not hash to the git blob id the Hub listed for it."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        CacheError.__init__(
            self,
            f"git blob id mismatch for {path!r}: the Hub lists {expected}, the bytes fetched "
            f"hash to {actual}; nothing of it was published",
        )
        self.path = path
        self.expected = expected
        self.actual = actual


# --- origins ----------------------------------------------------------------------------


class FetchError(PreheatError):
    """Fetching from an origin failed."""


class OriginUnavailable(FetchError, ConnectionError):
    """The origin could not be reached, or kept failing after retries."""


class ObjectNotFound(FetchError, FileNotFoundError):
    """The origin answered that the object does not exist."""


class TruncatedBody(FetchError, IOError):
    """The origin closed the body before the promised length."""


class RangeNotSupported(FetchError):
    """The origin answered a ranged GET with the whole body; the fill falls back to one
    stream per file."""


class OriginChanged(FetchError):
    """A file changed at the origin after ``resolve`` saw it (another ETag, version,
    inode, size or mtime), so its ranges would mix old and new bytes; nothing of it is
    published and a later pull resolves the new revision. Not retried."""


# hf:// (the Hugging Face Hub source), mapped from the Hub's X-Error-Code header


class HubRepoNotFound(ObjectNotFound):
    """The Hub has no such repo, or it is private and the token (if any) may not read it."""


class HubRevisionNotFound(ObjectNotFound):
    """The repo has no such branch, tag or commit."""


class HubAccessDenied(FetchError, PermissionError):
    """A gated repo without a granted token, or a token the Hub refuses as invalid."""


# --- images (OCI registries, the node image cache) -------------------------------------


class Revoked(CacheError, PermissionError):
    """The digest or revision is on the store's revocation list: removed, and refused
    until ``unrevoke``."""


class ImageInUse(CacheError):
    """An image still referenced by an endpoint cannot be removed."""


class RegistryError(FetchError):
    """An OCI registry answered something the image client cannot use."""


class ImageNotFound(RegistryError, FileNotFoundError):
    """The registry does not know the repository, tag or digest."""


class UnsupportedMediaType(RegistryError, ValueError):
    """A manifest, config or layer has a media type preheat does not pull."""


class ImageDigestMismatch(RegistryError, ValueError):
    """A manifest's bytes do not hash to the digest it was asked for (or announced)."""


class RegistryAuthError(RegistryError, PermissionError):
    """The registry or its token service refused the credentials."""


# ocifmt (issue 11): oci:// modelcars and docker credential helpers
class NoModelFiles(UnsupportedMediaType):
    """An ``oci://`` image is neither a ModelPack model nor a modelcar (no ``/models``)."""


class CredentialHelperError(RegistryAuthError):
    """A docker credential helper (``credsStore``/``credHelpers``) is missing or failed."""


# --- engine -----------------------------------------------------------------------------


class EngineError(PreheatError):
    """The simulated engine could not do what was asked."""


class PromptTooLong(EngineError, ValueError):
    """A request can never fit the engine (context length or KV capacity)."""


class EngineUnavailable(EngineError, ConnectionError):
    """An engine did not answer, or did not become healthy in time."""


# --- router -----------------------------------------------------------------------------


class RouterError(PreheatError):
    """The router could not do what was asked."""


class NoHealthyInstance(RouterError):
    """No instance of the variant is healthy and below its limits."""


# --- controller -------------------------------------------------------------------------


class ControlError(PreheatError):
    """The controller could not reconcile an endpoint."""
