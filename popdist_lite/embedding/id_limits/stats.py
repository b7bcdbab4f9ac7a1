"""Per-step ID statistics of limited tables, and a recorder that suggests limits
(the feedback-directed optimisation, FDO, of the SparseCore minibatching guide, done by
hand).

Every lookup and update of a table created with ID limits (or
``track_id_stats=True``; see :mod:`popdist_lite.embedding.id_limits.settings`) publishes one record::

    {"table": "user_table", "op": "lookup" | "update",
     "max_ids_per_partition": 320,          # observed, over every (sender, owner) partition
     "max_unique_ids_per_partition": 97,    # observed, the same partitions deduplicated
     "max_ids_partition": [1, 0],           # (sender, owner) of the first maximum
     "max_unique_ids_partition": [1, 0],
     "num_minibatches": 1,                  # 1 without minibatching
     "dropped_ids": 0}                      # positions this replica dropped

The observed maxima are global (every replica gets the same values); ``dropped_ids``
is this replica's. :func:`last_id_stats` returns the latest record per ``(table, op)``;
:class:`IdLimitRecorder` keeps them across steps and suggests limits.
"""

from __future__ import annotations

import json
import math

_last: dict[tuple[str, str], dict] = {}
_recorders: list["IdLimitRecorder"] = []


def publish(record: dict) -> None:
    """Store ``record`` (without its private ``_`` keys) as the latest of its ``(table, op)``
    and give it to every open recorder."""
    record = {k: v for k, v in record.items() if not k.startswith("_")}
    _last[(record["table"], record["op"])] = record
    for rec in _recorders:
        rec._add(record)


def last_id_stats(table: str | None = None) -> dict:
    """The latest record of every ``(table, op)``: ``{"table/op": record}``, only ``table``'s
    when given. Local (no communication)."""
    return {f"{t}/{op}": dict(r) for (t, op), r in sorted(_last.items()) if table is None or t == table}


class IdLimitRecorder:
    """Records every limited table's per-call statistics across steps, suggests limits.

    Usage::

        rec = popdist_lite.IdLimitRecorder()      # starts recording
        for step in range(n):
            ... emb.lookup(...); emb.apply_gradients(...) ...
            rec.end_step()                        # optional: groups records by step
        rec.close()
        print(rec.to_json())                      # steps, per-table maxima, suggestions

    Suggestion (per table): the largest observed value over the recorded calls times
    ``headroom``, rounded up to a multiple of ``multiple`` (at least ``multiple``), for
    both limits. Local: every replica sees the same observed maxima, hence the same
    suggestion.

    Args:
        headroom: factor over the observed maximum (default 1.25).
        multiple: round suggestions up to a multiple of this (default 8).
    """

    def __init__(self, headroom: float = 1.25, multiple: int = 8):
        if headroom < 1 or multiple < 1:
            raise ValueError(f"expected headroom >= 1 and multiple >= 1, got {headroom}, {multiple}")
        self.headroom, self.multiple = float(headroom), int(multiple)
        self.steps: list[list[dict]] = [[]]
        _recorders.append(self)

    def _add(self, record: dict) -> None:
        self.steps[-1].append(dict(record))

    def end_step(self) -> None:
        """Close the current step; later records belong to the next one."""
        self.steps.append([])

    def close(self) -> None:
        """Stop recording (idempotent)."""
        if self in _recorders:
            _recorders.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def records(self) -> list[dict]:
        """Every record, each with its ``"step"`` number."""
        return [dict(r, step=i) for i, step in enumerate(self.steps) for r in step]

    def summary(self) -> dict:
        """Per table: calls, observed maxima, most minibatches, total dropped IDs."""
        out: dict = {}
        for r in self.records():
            s = out.setdefault(r["table"], {"calls": 0, "max_ids_per_partition": 0,
                                             "max_unique_ids_per_partition": 0, "max_num_minibatches": 0,
                                             "dropped_ids": 0})
            s["calls"] += 1
            s["max_ids_per_partition"] = max(s["max_ids_per_partition"], r["max_ids_per_partition"])
            s["max_unique_ids_per_partition"] = max(s["max_unique_ids_per_partition"],
                                                    r["max_unique_ids_per_partition"])
            s["max_num_minibatches"] = max(s["max_num_minibatches"], r["num_minibatches"])
            s["dropped_ids"] += r["dropped_ids"]
        return out

    def suggest(self) -> dict:
        """``{table: {"max_ids_per_partition": n, "max_unique_ids_per_partition": m}}``."""
        def up(v):
            return max(self.multiple, self.multiple * math.ceil(v * self.headroom / self.multiple))
        return {t: {"max_ids_per_partition": up(s["max_ids_per_partition"]),
                    "max_unique_ids_per_partition": up(s["max_unique_ids_per_partition"])}
                for t, s in self.summary().items()}

    def to_dict(self) -> dict:
        return {"headroom": self.headroom, "multiple": self.multiple, "records": self.records(),
                "summary": self.summary(), "suggested_limits": self.suggest()}

    def to_json(self, path=None, indent: int | None = 1) -> str:
        """The records, the summary and the suggested limits as JSON; also written to
        ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text
