"""``revoke``/``unrevoke``: the store-level revocation list from the command line.

One list serves images and model revisions (docs/images.md): ``preheat cache
revoke|unrevoke`` and ``preheat image revoke|unrevoke`` are the same commands, built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from preheat.cli.store_options import click_errors, open_store, store_option

__all__ = ["revoke_command", "unrevoke_command"]


# One store-level revocation list serves images and model revisions (docs/images.md);
# ``preheat image revoke|unrevoke`` are the same commands.
def revoke_command(what: str) -> click.Command:
    """``revoke KEY``: the store-level revocation list (also ``preheat cache revoke``)."""

    @click.command(name="revoke")
    @click.argument("key", metavar="DIGEST" if what == "image" else "REVISION")
    @store_option
    @click.option("--reason", default="", help="Why (kept with the entry, shown in refusals).")
    @click.option("--json", "as_json", is_flag=True, help="Print what was removed as JSON.")
    def revoke(
        key: str,
        store_dir: Path,
        capacity: str | None,
        high_watermark: float,
        reason: str,
        as_json: bool,
    ) -> None:
        """Revoke KEY (an image, layer, blob or snapshot digest, or a model revision):
        remove it from the store and refuse every new pull of it until `unrevoke`.
        Snapshots a replica or endpoint still holds are kept for it and listed."""
        from preheat.store.revoke import revoke as do_revoke

        with click_errors():
            store = open_store(store_dir, capacity, high_watermark)
            rep = do_revoke(store._db, store._space, key, reason)
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "key": rep.key,
                        "removed": list(rep.removed),
                        "kept": [{"snapshot": s, "holders": list(h)} for s, h in rep.kept],
                        "blobs": list(rep.blobs),
                    }
                )
            )
            return
        click.echo(
            f"revoked {rep.key}: removed {len(rep.removed)} snapshot(s), {len(rep.blobs)} blob(s)"
        )
        for s, holders in rep.kept:
            click.echo(f"kept {s[:16]} for {', '.join(holders)} (release them to remove it)")

    revoke.help = (revoke.help or "").replace("KEY", "DIGEST" if what == "image" else "REVISION")
    return revoke


def unrevoke_command(what: str) -> click.Command:
    @click.command(name="unrevoke")
    @click.argument("key", metavar="DIGEST" if what == "image" else "REVISION")
    @store_option
    def unrevoke(key: str, store_dir: Path, capacity: str | None, high_watermark: float) -> None:
        """Take KEY off the store's revocation list: pulls of it are allowed again."""
        from preheat.store.revoke import unrevoke as do_unrevoke

        with click_errors():
            store = open_store(store_dir, capacity, high_watermark)
            was = do_unrevoke(store._db, key)
        click.echo("unrevoked" if was else f"{key} was not revoked")

    return unrevoke
