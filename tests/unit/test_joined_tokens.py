"""JoinedTokens: a prompt's shared head and its own tail behave as their concatenation."""

from __future__ import annotations

import pickle

import pytest

from preheat.engine.core.scheduler import Scheduler
from preheat.engine.core.tokens import JoinedTokens
from preheat.timing import get_profile


def test_it_reads_as_the_concatenated_tuple() -> None:
    """len, indexing, every slice (a tuple), iteration, ``in``, equality and pickling match
    ``head + tail`` (a tuple head, a list tail as the simulator gives)."""
    head, tail = tuple(range(10, 30)), [7, 8, 9]
    j, ref = JoinedTokens(head, tail), (*head, *tail)
    assert len(j) == len(ref) and list(j) == list(ref) and j == ref and hash(j) == hash(ref)
    for i in range(-len(ref), len(ref)):
        assert j[i] == ref[i]
    for a in range(-2, len(ref) + 2):
        for b in range(-2, len(ref) + 2):
            assert type(j[a:b]) is tuple and j[a:b] == ref[a:b], (a, b)
    assert j[::2] == ref[::2] and j[::-1] == ref[::-1]
    assert 8 in j and 11 in j and 99 not in j
    assert pickle.loads(pickle.dumps(j)) == ref
    with pytest.raises(IndexError):
        j[len(ref)]


def test_the_scheduler_keeps_it_without_a_copy() -> None:
    """A JoinedTokens prompt is kept as it is, like a tuple (no per-request copy)."""
    sched = Scheduler(get_profile("tiny"))
    toks = JoinedTokens(tuple(range(100, 140)), (1, 2, 3))
    seq = sched.add_request("a", toks, 4, 0.0)
    assert seq.prompt_tokens is toks and seq.num_prompt_tokens == 43
    _, outs = sched.run_until_idle()
    assert outs[-1].finished and outs[-1].num_output_tokens == 4
