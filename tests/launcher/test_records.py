"""The record schema (popdist_lite/records.py) and the line buffer, and fuzz tests of the
decoder, the validator, the collector and the failure report: whatever bytes arrive,
nothing raises but ValueError from the decoder, and the report formats every record the
schema accepts (hypothesis, plus a seeded stream of a few thousand lines through a real
collector)."""

from __future__ import annotations

import gc
import json
import os
import random
import socket

import pytest
from hypothesis import example, given, settings, strategies as st

from popdist_lite import records
from popdist_lite_launcher.supervise import report
from popdist_lite_launcher.supervise.collector import KEPT_DEFAULT, KEPT_PER_RANK, Collector
from peers import AgentConnection, address, wait_for

# ---------------------------------------------------------------- strategies

_TEXT_SIZES = {"name": records.MAX_NAME_CHARS, "message": 300, "text": 300}


def value_of(kind: str):
    """Values of a schema type (text shortened: its limit is tested separately)."""
    base = kind.rstrip("?")
    if base == "count":
        values = st.integers(0, 2 ** 63 - 1)
    elif base == "number":
        values = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2 ** 53, 2 ** 53)
    elif base == "flag":
        values = st.booleans()
    elif base == "nonce":
        values = st.text("0123456789abcdef", min_size=64, max_size=64)
    elif base == "signal":
        values = st.sampled_from(records.REQUEST_SIGNALS)
    elif base == "lane":
        values = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True) | st.text(max_size=20)
    elif base == "events":
        values = st.lists(trace_events, max_size=4)
    else:
        values = st.text(max_size=_TEXT_SIZES[base])
    return st.none() | values if kind.endswith("?") else values


trace_events = st.fixed_dictionaries({
    "name": st.text(max_size=20), "cat": st.sampled_from(records.TRACE_CATEGORIES), "ph": st.just("X"),
    "pid": st.integers(0, 2 ** 20), "tid": st.integers(0, 2 ** 20),
    "ts": st.floats(0, 2e15), "dur": st.floats(0, 1e9),
    "args": st.dictionaries(st.text(max_size=8), st.integers(0, 2 ** 40) | st.text(max_size=8) | st.none(),
                            max_size=3)})


def valid_record(kinds=tuple(records.SCHEMA)):
    return st.sampled_from(kinds).flatmap(lambda kind: st.fixed_dictionaries(
        {"kind": st.just(kind), **{name: value_of(t) for name, t in records.SCHEMA[kind].items()}}))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
field_names = st.sampled_from(sorted({f for fields in records.SCHEMA.values() for f in fields} | {"x"}))
kinds = st.sampled_from([*records.SCHEMA, "custom"]) | json_values


@st.composite
def record_like(draw):
    """A valid record with some fields replaced, removed or added."""
    record = dict(draw(valid_record()))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["replace", "remove", "add", "kind"]))
        name = draw(field_names)
        if action == "replace" and name in record:
            record[name] = draw(json_values)
        elif action == "remove":
            record.pop(name, None)
        elif action == "add":
            record[name] = draw(json_values)
        else:
            record["kind"] = draw(kinds)
    return record


failure_records = valid_record(records.FAILURE_KINDS)


# ---------------------------------------------------------------- the schema

def sample(kind: str) -> dict:
    ident = records.identity(rank=1, replica=1, pid=7)
    fields = {"error": dict(exception="E", message="m", traceback="t"),
              "exit": dict(exitcode=3, signal=None, stderr_tail="", terminated=False),
              "lost": dict(reason="r", terminated=True),
              "progress": dict(lane="main", call=4, op="all_reduce", since=2.5),
              "stack": dict(request=3, text="")}
    return records.make(kind, ident, **fields[kind])


@pytest.mark.parametrize("kind", ["error", "exit", "lost", "progress", "stack"])
def test_every_kind_made_by_make_is_valid(kind):
    record = sample(kind)
    assert records.validate(record, [kind]) is record
    assert records.decode(records.encode(record), [kind]) == record


@pytest.mark.parametrize("change, message", [
    ({"rank": "1"}, "field 'rank' is not count?"),
    ({"rank": True}, "field 'rank' is not count?"),         # a bool is not an int here
    ({"rank": -1}, "field 'rank' is not count?"),
    ({"time": float("nan")}, "field 'time' is not number"),
    ({"exitcode": 2.0}, "field 'exitcode' is not count?"),
    ({"terminated": 1}, "field 'terminated' is not flag"),
    ({"signal": ["SIGKILL"]}, "field 'signal' is not name?"),
    ({"host": "h" * (records.MAX_NAME_CHARS + 1)}, "field 'host' is not name"),
    ({"stderr_tail": "x" * (records.MAX_TEXT_CHARS + 1)}, "field 'stderr_tail' is not text"),
    ({"stderr_tail": "\ud800"}, "field 'stderr_tail' is not text"),  # cannot be printed
    ({"extra": 1}, "1 unknown field"),
])
def test_wrong_types_and_sizes_are_refused_without_echoing(change, message):
    record = {**sample("exit"), **change}
    with pytest.raises(ValueError, match=message) as info:
        records.validate(record)
    assert "SIGKILL" not in str(info.value) and "hhhh" not in str(info.value)


@pytest.mark.parametrize("lane", ["jax" * 6, "Main", "", "9lanes", "a b", "lane\n", "\u00e9t\u00e9", 1, None, ["main"]])
def test_progress_lanes_are_bounded_names(lane):
    """A lane is a short lowercase name (popdist_lite.progress.LANE_NAME): anything else,
    a longer one included, is refused."""
    with pytest.raises(ValueError, match="field 'lane' is not lane"):
        records.validate({**sample("progress"), "lane": lane}, records.FROM_AGENT)
    assert records.validate({**sample("progress"), "lane": "checkpoint_16chr"}, records.FROM_AGENT)


def test_missing_fields_and_kinds_not_accepted():
    with pytest.raises(ValueError, match="exit record without field.s. terminated"):
        records.validate({k: v for k, v in sample("exit").items() if k != "terminated"})
    with pytest.raises(ValueError, match="not accepted here"):
        records.validate(sample("lost"), records.FROM_AGENT)  # only the collector makes these
    with pytest.raises(ValueError, match="not accepted here"):
        records.validate({"kind": "custom", "x": 1}, records.FROM_AGENT)
    assert records.validate({"kind": "custom", "x": 1}) == {"kind": "custom", "x": 1}
    with pytest.raises(ValueError, match="field 'signal' is not signal"):  # not an allowed one
        records.validate({"kind": "signal", "signal": "SIGSTOP"}, records.TO_AGENT)
    # a program reports its own error, its replicas' agreement to stop for a resize and its
    # save after it, and its timeline events; nothing that speaks for its agent or the
    # launcher (exit, lost, progress, heartbeat, signalled)
    assert records.FROM_PROGRAM == ("error", "resize_stop", "checkpoint_saved", "timeline") \
        and "lost" not in records.FROM_AGENT


EVENT = {"name": "all_reduce", "cat": "collective", "ph": "X", "pid": 1, "tid": 1, "ts": 1.5e15, "dur": 12.5,
         "args": {"bytes_sent": 16, "bytes_received": 16, "table": "items"}}


@pytest.mark.parametrize("change", [
    {"ph": "B"}, {"cat": "gpu"}, {"pid": -1}, {"tid": 1.0}, {"ts": float("inf")}, {"dur": -1.0},
    {"name": "x" * (records.MAX_NAME_CHARS + 1)}, {"args": {"k": [1]}}, {"args": {str(i): i for i in range(17)}},
    {"args": "x"}, {"extra": 1}, {"ph": "M"},
])
def test_timeline_events_are_checked(change):
    """A ``timeline`` record carries at most MAX_TIMELINE_EVENTS Chrome-trace events of
    the timeline's own shapes; an event of any other shape or size refuses the record."""
    ident = records.identity(rank=1, replica=1, pid=7)
    good = records.make("timeline", ident, events=[EVENT, {**EVENT, "ph": "C", "cat": "counter", "dur": None},
                                                  {"name": "thread_name", "ph": "M", "pid": 1, "tid": 100001,
                                                   "args": {"name": "replica 1: loader"}}])
    good["events"][1].pop("dur")
    assert records.decode(records.encode(good), records.FROM_PROGRAM) == good
    with pytest.raises(ValueError, match="field 'events' is not events"):
        records.validate({**good, "events": [{**EVENT, **change}]}, records.FROM_PROGRAM)
    with pytest.raises(ValueError, match="field 'events' is not events"):
        records.validate({**good, "events": [EVENT] * (records.MAX_TIMELINE_EVENTS + 1)}, records.FROM_PROGRAM)


@pytest.mark.parametrize("line", [
    b"[" * 100_000,                      # RecursionError inside json
    b'{"kind": "exit", "rank": ' + b"9" * 5000 + b"}",   # int longer than Python converts
    b"\xff\xfe{}",                       # not UTF-8
    b"x" * (records.MAX_LINE_BYTES + 1),
    b"NaN", b"[]", b'{"kind": 3}', b"",
])
def test_decode_raises_only_value_error(line):
    with pytest.raises(ValueError):
        records.decode(line, records.FROM_AGENT)


def test_fit_cuts_strings_to_the_schema():
    long = "".join(f"line {i}\n" for i in range(20_000))
    record = records.fit(records.make("error", records.identity(rank=0, replica=0, host="h" * 999),
                                      exception="E" * 999, message="m" * 99_999, traceback=long))
    records.validate(record)
    assert record["traceback"] == long[-records.MAX_TEXT_CHARS:]      # the end, where the error is
    assert record["message"] == "m" * records.MAX_MESSAGE_CHARS        # the start
    assert len(record["host"]) == len(record["exception"]) == records.MAX_NAME_CHARS
    assert records.fit(records.make("error", exception="\ud800", message="", traceback=""))[
        "exception"] == "?"
    worst = records.fit(records.make("error", records.identity(rank=0, replica=0),
                                     exception="E", message="\U0001F600" * 99_999,
                                     traceback="\U0001F600" * 99_999))
    assert len(records.encode(worst)) <= records.MAX_LINE_BYTES  # even escaped as \\uXXXX pairs


# ---------------------------------------------------------------- the line buffer

@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=20),
       st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 30))
def test_line_buffer_splits_like_bytes_split(lines, cuts, limit):
    stream = b"".join(line + b"\n" for line in lines)
    buffer = records.LineBuffer(max_line=limit)
    got, start, k = [], 0, 0
    while start < len(stream):
        got += buffer.feed(stream[start:start + cuts[k % len(cuts)]])
        start += cuts[k % len(cuts)]
        k += 1
    assert got == [line for line in lines if len(line) <= limit]
    assert buffer.overlong == sum(len(line) > limit for line in lines)
    assert buffer.pending == 0


def test_line_buffer_keeps_the_pieces_of_a_partial_line_and_drops_runaway_lines():
    buffer = records.LineBuffer(max_line=1000)
    for _ in range(100):  # pieces are kept, not re-concatenated on every read
        assert buffer.feed(b"0123456789") == []
    assert len(buffer._pieces) == 100 and buffer.pending == 1000
    assert buffer.feed(b"\nnext") == [b"0123456789" * 100]
    buffer.feed(b"x" * 5000)          # over the limit: dropped up to its newline, not kept
    assert buffer.pending == 0 and buffer.overlong == 1
    assert buffer.feed(b"y" * 100 + b"\nok\n") == [b"ok"]


# ---------------------------------------------------------------- fuzz

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_decode_raises_only_value_error(line):
    try:
        record = records.decode(line, records.FROM_AGENT)
    except ValueError:
        return
    assert record["kind"] in records.FROM_AGENT


@settings(max_examples=500, deadline=None)
@given(record_like())
def test_fuzz_validate_refuses_or_accepts_exactly_the_schema(record):
    try:
        records.validate(record, tuple(records.SCHEMA))
    except ValueError:
        return
    schema = records.SCHEMA[record["kind"]]
    assert set(record) == {"kind", *schema}


#: Ranks whose roles read as a number, a word or a digit int() cannot read ('²'): the
#: stopped ranks' names must still sort (what two fuzz runs found).
_ODD_ROLES = [{"kind": "lost", "rank": None, "replica": 0, "role": role, "feeder": None, "host": "",
               "pid": 0, "time": 0.0, "reason": "", "terminated": True} for role in ("0", "", "\u00b2")]


@settings(max_examples=300, deadline=None)
@given(st.lists(failure_records, max_size=8), st.integers(-300, 300), st.booleans())
@example(_ODD_ROLES, 1, True)
def test_fuzz_report_formats_every_valid_record(recs, mpirun_code, stalled):
    failures = report.merge_records(recs)
    code = report.exit_code_for(failures, mpirun_code)
    assert 1 <= code <= 255
    text = report.format_report(failures, code, reason=None, mpirun_tail="tail",
                                cause="root cause: stall" if stalled else None)
    assert text.startswith("poprun-lite: job failed")
    assert isinstance(report.summary(failures, stalled=stalled), str)
    for failure in failures:
        assert 1 <= failure.launcher_exit_code() <= 255


def test_fuzz_collector_with_a_seeded_stream_of_lines():
    """3000 lines (valid, mutated and random frames, JSON and bytes) through one
    authenticated connection and through strangers' connections: the collector passes
    on only valid records of its agent, keeps the latest of each kind (its bound),
    counts the rest, raises nothing, and the report formats what it kept."""
    rng = random.Random(19)
    with Collector(ranks=1) as collector:
        passed = []
        for kind in records.FROM_AGENT:
            collector.subscribe(kind, passed.append)
        agent = AgentConnection(collector, 0)
        sent_valid = 0
        for i in range(3000):
            kind = rng.choice(["error", "exit", "progress", "stack", "heartbeat"])
            record = records.make(kind, **({} if kind == "heartbeat" else
                                           {k: v for k, v in sample(kind).items() if k != "kind"}))
            if kind != "heartbeat":
                record.update(rank=0, replica=0, pid=1000)
            choice = rng.random()
            if choice < 0.4:
                agent.sock.sendall(agent.session.seal(record))
                sent_valid += kind != "heartbeat"
            elif choice < 0.6:  # an authentic frame carrying a mutated record
                name = rng.choice([k for k in record if k != "kind"] or ["x"])
                record[name] = rng.choice([None, -1, 2 ** 70, "x" * 300, [1], {"a": 1}, 1.5, True])
                agent.sock.sendall(agent.session.seal(record))
                sent_valid += _still_valid(record) and kind != "heartbeat"
            elif choice < 0.8:  # a frame with a flipped byte
                frame = bytearray(agent.session.seal(record))
                agent.session.sent -= 1  # not sent: the next frame reuses its number
                frame[rng.randrange(len(frame) - 1)] ^= 1 << rng.randrange(8)
                agent.sock.sendall(bytes(frame).replace(b"\n", b"") + b"\n")
            else:  # random bytes or JSON, no frame
                junk = rng.randbytes(rng.randrange(1, 200)) if rng.random() < 0.5 else \
                    json.dumps(record).encode()
                agent.sock.sendall(junk.replace(b"\n", b"") + b"\n")
        agent.send("heartbeat")
        stranger_lines = [json.dumps(sample("error")).encode(), b'{"kind": "lost"}', b"\x00" * 100]
        for line in stranger_lines:
            with socket.create_connection(address(collector)) as sock:
                sock.sendall(line + b"\n")
        wait_for(lambda: len(passed) >= sent_valid, what="the valid records")
        refused, dropped = collector.ignored()
        kept = collector.records()
        assert len(passed) == sent_valid  # every valid record, nothing else
        assert [r["kind"] for r in collector.records("hello")] == ["hello"]
        for kind in ("error", "exit", "progress", "stack"):  # the latest of each kind, in order
            latest = [r for r in passed if r["kind"] == kind][-KEPT_PER_RANK.get(kind, KEPT_DEFAULT):]
            assert latest and collector.records(kind) == latest
        assert [r["received"] for r in kept] == sorted(r["received"] for r in kept)
        assert not [r for r in list(refused) + list(dropped) if "collector error" in r]
        failures = report.merge_records(collector.failure_records())
        report.format_report(failures, report.exit_code_for(failures, 0))
        agent.close()


def _still_valid(record: dict) -> bool:
    try:
        records.validate(record, records.FROM_AGENT)
    except ValueError:
        return False
    return record.get("rank", 0) == 0  # its connection's rank


def _rss_bytes() -> int:
    """This process's resident set size (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_collector_memory_is_bounded_per_rank():
    """200,000 progress records through the real channel (a rank at 5 records/s for 11
    hours) grow the process hosting the collector by less than 10 MiB: the collector
    keeps the latest few per rank (every one reaches the subscribers)."""
    with Collector(ranks=1) as collector:
        count = {"n": 0}

        def counted(record):
            count["n"] += 1
        collector.subscribe("progress", counted)
        agent_connection = AgentConnection(collector, 0)
        agent_connection.sock.settimeout(120)

        def send(first: int, n: int) -> None:
            for start in range(first, first + n, 1000):
                frames = b"".join(agent_connection.session.seal(records.make(
                    "progress", agent_connection.ident, lane="main", call=call, op="all_reduce", since=1.0))
                    for call in range(start, min(start + 1000, first + n)))
                agent_connection.sock.sendall(frames)
            wait_for(lambda: count["n"] == first + n, timeout=600, what=f"{first + n} records")

        send(0, 20_000)  # warm-up: the collector's buffers, the allocator's arenas
        gc.collect()
        before = _rss_bytes()
        send(20_000, 200_000)
        gc.collect()
        after = _rss_bytes()
        kept = collector.records("progress")
        agent_connection.close()
    assert (after - before) < 10 * 2 ** 20, f"RSS grew by {(after - before) / 2 ** 20:.1f} MiB"
    assert [r["call"] for r in kept] == list(range(220_000 - KEPT_PER_RANK["progress"], 220_000))
