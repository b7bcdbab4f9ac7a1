#!/usr/bin/env python3
"""Draw the documentation's diagrams from their Graphviz source, here, into docs/images/:

- ``parts.svg``: launcher/'s parts, who imports whom, and the processes they become
  (docs/launcher.md; the modules of each part read from launcher/);
- ``processes.svg``: what runs where in a poprun-lite job (docs/launcher.md): the
  launcher (its collector, stall inspector and report), mpirun and the MPI daemons on
  other hosts, an agent per rank, the replicas and their host feed processes, and what
  each pair says to each other;
- ``token-encoding.svg``: how a ``[t, e]`` host embedding is split over the replicas by
  the TOKEN and ENCODING strategies of the TF-IPU host-embedding guide, and the
  collectives that move a lookup's indices and rows (docs/library.md).

Needs Graphviz's ``dot`` (Debian: ``apt-get install graphviz``)::

    scripts/draw_docs.py            # every drawing
    scripts/draw_docs.py --check    # exit 1 if a drawing differs from its source
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "images"
FONT = 'fontname="Helvetica,Arial,sans-serif"'
REPLICA = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]  # one colour per replica
LIGHT = ["#c6d6ea", "#fcd9b6", "#c9e4c5", "#f6c6c7"]

PROCESSES = f"""
digraph processes {{
  graph [{FONT}, fontsize=12, rankdir=TB, nodesep=0.35, ranksep=0.55, newrank=true,
         label="poprun-lite --num-replicas 2 -H node0,node1 --feeders-per-replica 1 python train.py",
         labelloc=t];
  node [{FONT}, fontsize=11, shape=box, style="rounded,filled", fillcolor=white];
  edge [{FONT}, fontsize=9, color="#555555"];

  subgraph cluster_node0 {{
    label="node0 (where poprun-lite runs)"; style="rounded,dashed"; color="#888888";
    launcher [label=<<b>poprun-lite</b><br/><font point-size="9">attempts loop, collector (TCP),<br/>stall inspector, failure report</font>>,
              fillcolor="#eeeeee"];
    mpirun [label=<<b>mpirun</b><br/><font point-size="9">Open MPI or MPICH, one MPMD command</font>>];
    agent0 [label="agent\\nrank 0"]; agent2 [label="agent\\nrank 2"];
    replica0 [label=<<b>replica 0</b><br/><font point-size="9">train.py + popdist_lite</font>>,
              fillcolor="{LIGHT[0]}", color="{REPLICA[0]}"];
    feeder0 [label=<<b>feeder 0 of replica 0</b><br/><font point-size="9">train.py: make_dataset</font>>,
             fillcolor="{LIGHT[0]}", color="{REPLICA[0]}", style="rounded,filled,dashed"];
  }}
  subgraph cluster_node1 {{
    label="node1"; style="rounded,dashed"; color="#888888";
    daemon [label=<<b>MPI daemon</b><br/><font point-size="9">prted / hydra_pmi_proxy</font>>];
    agent1 [label="agent\\nrank 1"]; agent3 [label="agent\\nrank 3"];
    replica1 [label=<<b>replica 1</b><br/><font point-size="9">train.py + popdist_lite</font>>,
              fillcolor="{LIGHT[1]}", color="{REPLICA[1]}"];
    feeder1 [label=<<b>feeder 0 of replica 1</b><br/><font point-size="9">train.py: make_dataset</font>>,
             fillcolor="{LIGHT[1]}", color="{REPLICA[1]}", style="rounded,filled,dashed"];
  }}

  launcher -> mpirun [label=" starts, signals"];
  mpirun -> daemon [label=" launch agent (ssh,\\n or srun under Slurm)"];
  mpirun -> agent2 [label=" starts"]; mpirun -> agent0;
  daemon -> agent1; daemon -> agent3 [label=" starts"];
  agent2 -> feeder0 [label=" starts, forwards\\n signals, keeps\\n stderr's tail"]; agent0 -> replica0;
  agent1 -> replica1; agent3 -> feeder1;
  {{rank=same; agent2 -> agent0 -> agent1 -> agent3 [style=invis];}}
  {{rank=same; replica0; replica1;}}

  agent0 -> launcher [dir=both, style=dashed, color="#999999", constraint=false];
  agent2 -> launcher [dir=both, style=dashed, color="#999999", constraint=false];
  agent1 -> launcher [dir=both, style=dashed, color="#999999", constraint=false];
  agent3 -> launcher [dir=both, style=dashed, color="#999999", constraint=false,
                      label=<<font point-size="9">records: one authenticated TCP<br/>connection per agent (hello, heartbeat,<br/>error, exit, progress; requests back)</font>>];

  feeder0 -> replica0 [color="{REPLICA[0]}", penwidth=1.6,
                       xlabel=<<font point-size="9">batches<br/>(feed comm)</font>>];
  replica0 -> replica1 [dir=both, penwidth=2.2, color="#333333", minlen=2,
                        xlabel=<<b>MPI collectives</b><br/><font point-size="9">(replica_comm)</font>>];
  replica1 -> feeder1 [dir=back, color="{REPLICA[1]}", penwidth=1.6];
  replica0 -> agent0 [style=dotted, color="#777777", constraint=false,
                      label=<<font point-size="9">error record,<br/>progress slot,<br/>stacks</font>>];
  replica1 -> agent1 [style=dotted, color="#777777", constraint=false];
}}
"""


def _grid(rows: list[int], cols: int, colour) -> str:
    """An HTML-like table of ``len(rows) x cols`` cells, cell ``(i, j)`` coloured
    ``colour(i, j)``, each row labelled with its global row number."""
    width, height = 16 * cols + 14, 12 * len(rows)
    return (f'<table border="0" cellborder="1" cellspacing="0" cellpadding="0" fixedsize="true" '
            f'width="{width}" height="{height}">' + "".join(
        "<tr>" + "".join(f'<td bgcolor="{colour(i, j)}" width="16" height="12" fixedsize="true"></td>'
                         for j in range(cols))
        + f'<td border="0" width="14" fixedsize="true"><font point-size="8">{i}</font></td></tr>' for i in rows)
        + "</table>")


def _table(title: str, rows: int, cols: int, owner, note: str) -> str:
    """The whole table, each cell in the colour of the replica that owns it."""
    return (f'<<table border="0" cellspacing="2"><tr><td><b>{title}</b></td></tr>'
            f'<tr><td>{_grid(list(range(rows)), cols, lambda i, j: LIGHT[owner(i, j)])}</td></tr>'
            f'<tr><td><font point-size="9">{note}</font></td></tr></table>>')


def _shard(title: str, rows: list[int], cols: list[int], replica: int) -> str:
    """One replica's partition: its rows (global numbers) and its columns."""
    return (f'<<table border="0" cellspacing="2"><tr><td><font color="{REPLICA[replica]}"><b>{title}</b></font>'
            f'</td></tr><tr><td>{_grid(rows, len(cols), lambda i, j: LIGHT[replica])}</td></tr></table>>')


def token_encoding() -> str:
    t, e, r = 8, 6, 2
    c = -(-e // r)
    out = [f"""
digraph token_encoding {{
  graph [{FONT}, fontsize=12, rankdir=LR, nodesep=0.3, ranksep=0.5, ordering=out,
         label="A [t, e] = [{t}, {e}] host embedding on r = {r} replicas (the TF-IPU host-embedding guide, section 15.3.1)",
         labelloc=t];
  node [{FONT}, fontsize=10, shape=plaintext];
  edge [{FONT}, fontsize=9, color="#555555"];
"""]
    for strategy, owner, shards, note, lookup in reversed((
            ("TOKEN", lambda i, j: i % r,
             [(f"replica {k}: rows i with i % {r} == {k}", list(range(k, t, r)), list(range(e))) for k in range(r)],
             f"row i on replica i % r, local row i // r:<br/>ceil(t/r) = {-(-t // r)} whole rows each",
             "lookup, sparse exchange (the default): all-to-all of counts,<br/>all-to-all-v of the distinct IDs to "
             "their owners,<br/>all-to-all-v of the rows back<br/>"
             "exchange=&quot;dense&quot; (the guide's): all-gather the indices,<br/>gather owned rows, zeros "
             "elsewhere,<br/>reduce-scatter-sum<br/>update: the same exchanges, transposed;<br/>each owner applies "
             "the optimizer once per row"),
            ("ENCODING", lambda i, j: j // c,
             [(f"replica {k}: columns [{k * c}, {min(e, (k + 1) * c)})", list(range(t)), list(range(k * c, (k + 1) * c)))
              for k in range(r)],
             f"columns [k*c, (k+1)*c) on replica k, c = ceil(e/r) = {c}:<br/>every row, {c} columns each",
             "lookup: all-gather the indices,<br/>gather every index's c columns,<br/>all-to-all the column slices "
             "to the replica<br/>that asked, transpose, flatten, slice e<br/>update: all-to-all the gradients' "
             "column slices<br/>to their owners, who apply the optimizer"))):  # rankdir=LR: drawn bottom up
        name = strategy.lower()
        out.append(f'  subgraph cluster_{name} {{ label=<<b>{strategy}</b>>; style="rounded"; color="#999999";')
        out.append(f'    {name}_table [label={_table("the table", t, e, owner, note)}];')
        for k, (title, rows, cols) in reversed(list(enumerate(shards))):
            out.append(f'    {name}_shard{k} [label={_shard(title, rows, cols, k)}];')
            out.append(f'    {name}_table -> {name}_shard{k} [color="{REPLICA[k]}"];')
        lookup = lookup.replace("<br/>", '<br align="left"/>') + '<br align="left"/>'
        out.append(f'    {name}_moves [shape=note, style=filled, fillcolor="#f7f7f7", fontsize=9, '
                   f'label=<{lookup}>];')
        out.append(f'    {name}_shard0 -> {name}_moves [style=invis];')
        out.append("  }")
    out.append("}")
    return "\n".join(out)


#: The launcher's parts: name -> (what it is, where it runs). Their modules and scripts
#: are read from launcher/ when the drawing is made, so a new module shows up in it.
PARTS = {
    "cli": ("the command line; wires the parts", "launcher"),
    "attempts": ("the attempts loop", "launcher"),
    "membership": ("which hosts each attempt runs on", "launcher"),
    "ssh": ("backend: mpirun over --launch-agent", "launcher"),
    "slurm": ("backend: mpirun through Slurm", "launcher"),
    "launch": ("the mpirun launch both backends share", "launcher"),
    "supervise": ("what watches the job", "launcher"),
    "node": ("what runs on a rank's host", "host"),
    "core": ("the vocabulary: every part imports it, it imports no other part", "everywhere"),
    "testing": ("test hosts and a Slurm cluster, for tests only", "tests"),
}
#: Who imports whom (besides core, which every part imports): tests/test_imports.py's ALLOWED.
IMPORTS = [("cli", "attempts"), ("cli", "membership"), ("cli", "ssh"), ("cli", "slurm"),
           ("attempts", "launch"), ("attempts", "supervise"), ("membership", "launch"), ("membership", "supervise"),
           ("ssh", "launch"), ("slurm", "launch"), ("slurm", "membership"), ("slurm", "node"), ("slurm", "supervise"),
           ("launch", "supervise"), ("launch", "node")]
PART_FILL = {"launcher": "#dde7f3", "host": "#dcefd9", "everywhere": "#f2e6f5", "tests": "#eeeeee"}


def _modules(part: str) -> str:
    """The modules and scripts of a part of launcher/, for its box (a top-level module
    stands for itself)."""
    directory = ROOT / "launcher" / part
    if not directory.is_dir():
        return f'{part}.py<br align="left"/>'

    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != "__init__.py"
                   and (p.suffix == ".py" or "-" in p.name))
    lines, line = [], ""
    for name in names:
        if line and len(line) + len(name) > 42:
            lines.append(line)
            line = ""
        line += ("" if not line else "  ") + name
    return '<br align="left"/>'.join([*lines, line]) + '<br align="left"/>'


def parts() -> str:
    """The drawing of launcher/'s parts, who imports whom, and the processes they become."""
    out = [f"""
digraph parts {{
  graph [{FONT}, fontsize=12, rankdir=TB, nodesep=0.3, ranksep=0.45, newrank=true,
         label="launcher/ (popdist_lite_launcher): its parts, who imports whom, and the processes they become",
         labelloc=t];
  node [{FONT}, fontsize=10, shape=box, style="rounded,filled"];
  edge [{FONT}, fontsize=9];"""]
    clusters = {"launcher": "in poprun-lite's process, on the launcher's host", "host": "on every rank's host"}
    for where, title in clusters.items():
        out.append(f'  subgraph cluster_{where} {{ label="{title}"; style="rounded,dashed"; color="#888888";')
        out += [_part_box(name) for name, (_, at) in PARTS.items() if at == where and name != "core"]
        out.append("  }")
    out += [_part_box("core"), _part_box("testing")]
    out.append("""
  { rank=same; part_cli; part_attempts; }
  { rank=same; part_membership; part_ssh; part_slurm; }
  { rank=same; part_supervise; part_node; }""")
    out += [f'  part_{a} -> part_{b} [color="#333333"];' for a, b in IMPORTS]
    out += [f'  part_{a} -> part_core [color="#333333"];' for a in ("supervise", "node")]
    out.append("""
  { rank=same; part_core; part_testing; }
  subgraph cluster_processes {
    label="the processes they become"; style="rounded,dashed"; color="#b07020"; fontcolor="#b07020";
    node [shape=note, style=filled, fillcolor="#fff7e6", fontsize=9];
    mpirun [label=<<b>mpirun</b>, one per attempt (launch/mpirun.py runs it),<br/>and the MPI daemons on the other hosts>];
    agent [label=<<b>an agent per rank</b>: python -m popdist_lite_launcher.node.agent<br/>(its program, the replica or feeder, beneath it)>];
    commands [label=<<b>commands on other hosts</b> through the launch agent:<br/>python -m popdist_lite_launcher.node.probe, .node.keys, .node.cleanup<br/>(ssh/attempt-agent or slurm/srun-agent in front)>];
    held [label=<<b>the held signals</b> (preemption): MPI daemons started through<br/>node/hold_signals.py (slurm/srun-held for MPICH); under Slurm,<br/>the watch step, hold_signals.py --watch>];
  }
  part_core -> mpirun [style=invis];
  part_launch -> mpirun [style=dashed, color="#b07020", label=" starts", constraint=false];
  mpirun -> agent [style=dashed, color="#b07020", label=" starts"];
  part_launch -> commands [style=dashed, color="#b07020", label=" runs", constraint=false];
  part_node -> agent [style=dashed, color="#2e7d32", label=" becomes", constraint=false];
  part_node -> commands [style=dashed, color="#2e7d32", constraint=false];
  part_node -> held [style=dashed, color="#2e7d32", constraint=false];
  { rank=same; mpirun -> agent -> commands -> held [style=invis]; }
}
""")
    return "\n".join(out)


def _part_box(name: str) -> str:
    what, where = PARTS[name]
    style = ', style="rounded,filled,dashed"' if where == "tests" else ""
    return (f'    part_{name} [fillcolor="{PART_FILL[where]}"{style}, label=<<b>{name}/</b> '
            f'<font point-size="9">{what}</font><br/><font point-size="8">{_modules(name)}</font>>];')

DRAWINGS = {"parts.svg": parts(), "processes.svg": PROCESSES, "token-encoding.svg": token_encoding()}


def render(source: str) -> bytes:
    dot = shutil.which("dot")
    if dot is None:
        raise SystemExit("draw_docs.py: Graphviz's dot is not on PATH (Debian: apt-get install graphviz)")
    return subprocess.run([dot, "-Tsvg"], input=source.encode(), capture_output=True, check=True).stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a drawing differs from what its source gives")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    stale = []
    for name, source in DRAWINGS.items():
        svg = render(source)
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_bytes() != svg:
                stale.append(name)
            continue
        path.write_bytes(svg)
        print(f"wrote {path.relative_to(ROOT)} ({len(svg)} bytes)")
    if stale:
        print(f"draw_docs.py: out of date: {', '.join(stale)} (run scripts/draw_docs.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
