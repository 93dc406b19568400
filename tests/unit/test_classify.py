"""Every event class, and the precedence between them, from the pure classifier."""

from __future__ import annotations

import pytest

from preheat.telemetry.classify import EventClass, StartContext, StartReason, classify_start


@pytest.mark.parametrize(
    ("ctx", "expected"),
    [
        # A replica process restarted in place.
        (
            StartContext(
                StartReason.RESTART, node_had_revision=True, same_replica_on_node_before=True
            ),
            EventClass.WARM_RESTART,
        ),
        # Initial deployment onto a node whose store was warmed first.
        (StartContext(StartReason.INITIAL, node_had_revision=True), EventClass.COLD_POD_WARM_NODE),
        # A node that joined after the endpoint started gets its first replica.
        (
            StartContext(StartReason.INITIAL, node_had_revision=True, node_is_new=True),
            EventClass.NEW_NODE,
        ),
        # Cold fallback placement: the node holds no copy of the revision.
        (StartContext(StartReason.INITIAL, node_had_revision=False), EventClass.NEW_NODE),
        # A version change starts replicas of the new revision.
        (StartContext(StartReason.ROLLOUT, node_had_revision=True), EventClass.NEW_VERSION),
        # A replacement for a replica lost with its node.
        (
            StartContext(StartReason.NODE_LOSS, node_had_revision=True),
            EventClass.NODE_LOSS_RECOVERY,
        ),
        # Scale-out onto an existing node, warm or not.
        (StartContext(StartReason.SCALE_OUT, node_had_revision=True), EventClass.SCALE_OUT),
        (StartContext(StartReason.SCALE_OUT, node_had_revision=False), EventClass.SCALE_OUT),
    ],
)
def test_each_class_for_its_scenario(ctx: StartContext, expected: EventClass) -> None:
    """Each scenario maps to its class."""
    assert classify_start(ctx) is expected


def test_every_class_is_reachable() -> None:
    """Across all inputs, every EventClass is produced by some context."""
    seen = {
        classify_start(StartContext(reason, had, new, same))
        for reason in StartReason
        for had in (False, True)
        for new in (False, True)
        for same in (False, True)
    }
    assert seen == set(EventClass)


def test_precedence_cause_before_node_state() -> None:
    """Restart-in-place, node loss and rollout win over a new node; new node wins over scale-out."""
    new = {"node_is_new": True, "node_had_revision": False}
    assert (
        classify_start(StartContext(StartReason.RESTART, same_replica_on_node_before=True, **new))
        is EventClass.WARM_RESTART
    )
    assert (
        classify_start(StartContext(StartReason.NODE_LOSS, **new)) is EventClass.NODE_LOSS_RECOVERY
    )
    assert classify_start(StartContext(StartReason.ROLLOUT, **new)) is EventClass.NEW_VERSION
    assert classify_start(StartContext(StartReason.SCALE_OUT, **new)) is EventClass.NEW_NODE


def test_restart_on_another_node_is_not_warm() -> None:
    """A crashed replica started again elsewhere is classed by that node's state."""
    assert (
        classify_start(StartContext(StartReason.RESTART, node_had_revision=True))
        is EventClass.COLD_POD_WARM_NODE
    )
    assert classify_start(StartContext(StartReason.RESTART)) is EventClass.NEW_NODE


def test_reason_strings_are_accepted_and_bad_ones_named() -> None:
    """A reason given as a string is converted; an unknown one names the choices."""
    assert StartContext("scale_out").reason is StartReason.SCALE_OUT  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reboot.*use one of initial"):
        StartContext("reboot")  # type: ignore[arg-type]
