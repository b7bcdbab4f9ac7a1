"""The feed position's arithmetic (popdist_lite/infeed/position.py) against a plain-Python
reference: the global batches an epoch's sessions take, at replica and feeder counts that
change from session to session (an elastic job), for a dataset sharded as tf.data's
``shard``. With an ``offset`` parameter every batch is taken exactly once; without one,
none twice and fewer than R' skipped at each change. The sessions are composed from the
library's own pieces: feed_shard (which shard each feeder or thread reads),
session_start, feeder_skip and open_dataset, and the round robin of the replica's
receiver (step s from feeder s % F)."""

from __future__ import annotations

import json

from helpers import run_python, timeout_for
from hypothesis import given, settings
from hypothesis import strategies as st

from popdist_lite.infeed import feed_shard
from popdist_lite.infeed.position import feeder_skip, open_dataset, session_start, takes_offset

pytestmark = timeout_for(1)

N = 10_000


def numbered(shard, shards):
    return iter(range(shard, N, shards))


def numbered_offset(shard, shards, offset=0):
    return iter(range(offset + shard, N, shards))


def session(make_dataset, position, replicas, feeders, steps):
    """``(batches taken by each replica, position after)`` of one session of ``steps``
    steps that continues after ``position``."""
    exact = takes_offset(make_dataset)
    first_step, offset = session_start(position, replicas, exact)
    taken = []
    for r in range(replicas):
        if feeders == 0:
            it = open_dataset(make_dataset, r, replicas, first_step, offset)
            taken.append([next(it) for _ in range(steps)])
            continue
        streams = [open_dataset(make_dataset, *feed_shard(r, replicas, feeders, k),
                                feeder_skip(first_step, feeders, k), offset) for k in range(feeders)]
        taken.append([next(streams[s % feeders]) for s in range(first_step, first_step + steps)])
    start = position if exact else first_step * replicas
    return taken, start + steps * replicas


sessions = st.lists(st.tuples(st.integers(1, 5), st.integers(0, 3), st.integers(1, 7)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(sessions)
def test_exact_datasets_take_every_batch_once(plan):
    position, taken = 0, []
    for replicas, feeders, steps in plan:
        parts, position = session(numbered_offset, position, replicas, feeders, steps)
        for r, part in enumerate(parts):  # replica r's step s is global batch start + s*R + r
            assert part == [part[0] + s * replicas for s in range(steps)]
        taken += [g for part in parts for g in part]
    assert sorted(taken) == list(range(sum(r * s for r, _, s in plan)))
    assert position == len(taken)


@settings(max_examples=300, deadline=None)
@given(sessions)
def test_step_datasets_repeat_nothing_and_skip_fewer_than_r(plan):
    position, taken, previous = 0, set(), None
    for replicas, feeders, steps in plan:
        before = position
        parts, position = session(numbered, position, replicas, feeders, steps)
        got = [g for part in parts for g in part]
        assert not taken & set(got) and len(set(got)) == len(got)
        skipped = min(got) - before  # the batches between the old position and the session's first
        if previous in (None, replicas):
            assert skipped == 0
        else:
            assert 0 <= skipped < replicas
        assert sorted(got) == list(range(min(got), min(got) + len(got)))
        taken |= set(got)
        previous = replicas


def test_session_start():
    assert session_start(10, 3, exact=True) == (0, 10)
    assert session_start(10, 3, exact=False) == (4, None)  # ceil(10 / 3): skips batches 10, 11
    assert session_start(12, 3, exact=False) == (4, None)
    assert session_start(0, 2, exact=False) == (0, None)


def test_infeed_position_state_and_the_older_form():
    """One replica: position and state_dict as it takes batches; a state of the older form
    (no position) loads as steps * replicas; seek refuses bad arguments."""
    proc = run_python("""
import json
import numpy as np
import popdist_lite as pl

def offset_data(shard, shards, offset=0):
    return ({"g": np.array([g])} for g in range(offset + shard, 100, shards))

feed = pl.infeed(offset_data)
assert feed.exact and feed.position == 0
got = [int(next(feed)["g"][0]) for _ in range(3)]
assert got == [0, 1, 2] and feed.position == 3, (got, feed.position)
assert feed.state_dict() == {"position": 3, "steps": 3, "replicas": 1, "feeders": 0}, feed.state_dict()
older = pl.infeed(offset_data)      # a new session (the first one is closed)
older.load_state_dict({"steps": 7, "replicas": 2, "feeders": 1})  # saved at 2 replicas: 14 batches
assert [int(next(older)["g"][0]) for _ in range(2)] == [14, 15] and older.position == 16
plain = pl.infeed(lambda shard, shards: ({"g": np.array([g])} for g in range(shard, 100, shards)))
assert not plain.exact
plain.seek(position=5)
assert plain.steps == 5 and [int(next(plain)["g"][0])] == [5] and plain.position == 6
errors = []
for kwargs in ({}, {"step": 1, "position": 1}, {"position": -1}, {"step": 1.5}, {"position": True}):
    try:
        pl.infeed(offset_data).seek(**kwargs)
    except ValueError as exc:
        errors.append(str(exc))
print(json.dumps(errors))
""")
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout)
    assert errors == ["Infeed.seek: give exactly one of step and position"] * 2 + [
        "Infeed.seek: argument position: expected an integer >= 0, got -1",
        "Infeed.seek: argument step: expected an integer >= 0, got 1.5",
        "Infeed.seek: argument position: expected an integer >= 0, got True"]
