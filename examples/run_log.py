"""What the examples (Shakespeare's and DLRM's) tell their user, from replica 0: a first
line before the slow start-up (MPI, the framework's import, the data, the tables), a tqdm
progress bar on a terminal, step lines with the loss (and the example's other metrics,
DLRM's AUC), a rate and an ETA, a line per checkpoint (path, size, seconds), and the
final loss (and metrics) on the last line; with ``--log-dir DIR`` the same lines in
``DIR/log.txt`` and the loss curve in ``DIR/loss.png`` (matplotlib, the ``[plot]`` extra;
without it, a one-line note).

The bar goes to stdout with the step lines written through it (``tqdm.write``), so the
two keep their order in one stream. Under poprun-lite a rank's stdout is a terminal
whose size Open MPI leaves at 0 x 0, where tqdm alone draws nothing (a blank line): the
bar then takes ``$COLUMNS`` x ``$LINES``, or 80 x 24 (:func:`bar_size`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Whether an MPI launcher started us, read when this module is imported (before
# popdist_lite.init(): initialising MPI as a singleton makes Open MPI set these variables
# in our own environment).
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "POPDIST_NUM_TOTAL_REPLICAS")
UNDER_LAUNCHER = any(v in os.environ for v in _LAUNCHER_VARS)

import popdist_lite  # noqa: E402  (importing it starts no MPI)

#: A bar's terminal size (columns, lines) when it is unknown and ``$COLUMNS``/``$LINES`` unset.
DEFAULT_SIZE = (80, 24)
#: The loss curve beside the log (``--log-dir``).
LOG_NAME, CURVE_NAME = "log.txt", "loss.png"


def add_log_dir_argument(parser) -> None:
    """The examples' ``--log-dir DIR`` option."""
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                        help="write what replica 0 prints to DIR/log.txt and the loss curve to DIR/loss.png "
                             "(matplotlib: pip install 'popdist-lite[plot]')")


def first_replica_before_init(environ=None) -> bool:
    """Whether this process is replica 0, from the launcher's variables, before
    ``popdist_lite.init()`` (which takes a second or more: MPI starts there): poprun-lite's
    ``POPDIST_LITE_ROLE`` and ``POPDIST_REPLICA_INDEX_OFFSET``, else an MPI launcher's
    rank (Open MPI, PMIx, MPICH's PMI, Slurm's srun), else a single process."""
    environ = os.environ if environ is None else environ
    if environ.get("POPDIST_LITE_ROLE", "replica") != "replica":
        return False  # a host feed process
    for name in ("POPDIST_REPLICA_INDEX_OFFSET", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value) == 0
    return True


_early: list[str] = []  # the lines of starting(), for the log file


def starting(script: str, doing: str) -> None:
    """Print ``script: doing ...`` at once on replica 0 (:func:`first_replica_before_init`):
    the first line, before the slow start-up it names (a :class:`RunLog` made later puts
    it in its log file too)."""
    if first_replica_before_init():
        line = f"{Path(script).name}: {doing} ..."
        print(line, flush=True)
        _early.append(line)


def stdout_is_terminal() -> bool:
    """Whether a progress bar makes sense on stdout.

    Under an MPI launcher ``isatty()`` is unreliable: Open MPI hands each rank a pseudo-
    terminal even when the launcher's own output is a pipe or a file.  There we trust
    ``POPDIST_LITE_STDOUT_ISATTY`` (``1``/``0``) if the launcher sets it, else no bar.
    """
    if not sys.stdout.isatty():
        return False
    if UNDER_LAUNCHER:
        return os.environ.get("POPDIST_LITE_STDOUT_ISATTY", "0") == "1"
    return True


def bar_size(stream) -> dict:
    """tqdm's ``ncols`` and ``nrows`` for a bar on ``stream``: none (tqdm measures them)
    when the stream is a terminal of known size, else ``$COLUMNS`` and ``$LINES`` or
    :data:`DEFAULT_SIZE` (a pty of size 0 x 0, as Open MPI gives its ranks, where tqdm
    takes -1 rows and draws nothing; or no terminal at all)."""
    try:
        size = os.get_terminal_size(stream.fileno())
        if size.columns > 0 and size.lines > 0:
            return {}
    except (AttributeError, OSError, ValueError):
        pass
    size = {}
    for key, name, default in (("ncols", "COLUMNS", DEFAULT_SIZE[0]), ("nrows", "LINES", DEFAULT_SIZE[1])):
        value = os.environ.get(name, "")
        size[key] = int(value) if value.isdigit() and int(value) > 0 else default
    return size


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def directory_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (a checkpoint)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


class RunLog:
    """Replica 0's account of a training run (every other replica's calls do nothing).

    Args:
        lead: whether this is replica 0.
        bar: whether to draw a progress bar (stdout is the user's terminal).
        log_dir: where to write ``log.txt`` and ``loss.png`` (None: nowhere).
    """

    def __init__(self, lead: bool, *, bar: bool = False, log_dir: Path | None = None):
        self.lead, self.want_bar, self.log_dir = lead, bar, log_dir
        self.bar = None
        self.losses: list[tuple[int, float]] = []  # (step, loss) of every step line
        self.metrics: dict[str, float] = {}  # the other metrics of the last step line
        self.total: int | None = 0
        self.first = 0
        self._mark: tuple[int, float] | None = None  # (step, perf_counter) of the last step line
        self._file = None
        if lead and log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(log_dir) / LOG_NAME, "w", encoding="utf-8")
            self._file.writelines(line + "\n" for line in _early)

    def say(self, line: str) -> None:
        """A line on stdout (above the bar, if any) and in the log file."""
        if not self.lead:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def start(self, first: int, total: int | None) -> None:
        """Training runs from step ``first`` to ``total`` (exclusive; ``None``: until the
        data end, a count unknown: a bar without a percentage, step lines without an
        ETA): open the bar."""
        self.first, self.total = first, total
        if self.lead and self.want_bar and (total is None or total > first):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=first, unit="step", file=sys.stdout, **bar_size(sys.stdout))

    def advance(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def loss(self, step: int, value: float, metrics: dict[str, float] | None = None) -> None:
        """``Step N, loss = X`` (then ``, NAME = V`` for each of ``metrics``), with the
        steps per second since the previous such line and the time left at that rate
        (tqdm's format; no ETA when the step count is unknown)."""
        if not self.lead:
            return
        now = time.perf_counter()
        self.metrics = dict(metrics or {})
        text = f"Step {step}, loss = {value:.4f}" + "".join(f", {k} = {v:.4f}" for k, v in self.metrics.items())
        if self._mark is not None and step > self._mark[0] and now > self._mark[1]:
            rate = (step - self._mark[0]) / (now - self._mark[1])
            from tqdm import tqdm

            text += f", {rate:.1f} steps/s"
            if self.total is not None:
                text += f", ETA {tqdm.format_interval(max(self.total - step - 1, 0) / rate)}"
        self._mark = (step, now)
        self.losses.append((step, value))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{value:.4f}", refresh=False)
        self.say(text)

    def checkpoint(self, step: int, path, seconds: float, background: bool = False) -> None:
        """``checkpoint step N saved (path, size, seconds)`` (``background``: the seconds
        are the training loop's, the files were written by a background thread)."""
        if not self.lead:
            return
        how = f"{seconds:.2f} s in the training loop, written in the background" if background \
            else f"{seconds:.2f} s"
        self.say(f"checkpoint step {step} saved ({path}, {format_size(directory_bytes(path))}, {how})")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, line: str, title: str) -> None:
        """End the run: close the bar, draw the loss curve (with ``log_dir``), and print
        ``line`` with the final loss (and the last step line's other metrics) as the
        last line."""
        if not self.lead:
            return
        self.close_bar()
        if self.log_dir is not None and self.losses:
            self.say(self.draw_curve(title))
        if self.losses:
            line += f"; final loss {self.losses[-1][1]:.4f}" + "".join(f", {k} {v:.4f}"
                                                                     for k, v in self.metrics.items())
        self.say(line)
        if self._file is not None:
            self._file.close()
            self._file = None

    def draw_curve(self, title: str) -> str:
        """Write ``log_dir/loss.png`` (the loss of every step line against its step);
        returns the line that says so, or why not (matplotlib missing)."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            return "no loss curve: matplotlib is not installed (pip install 'popdist-lite[plot]')"
        path = Path(self.log_dir) / CURVE_NAME
        fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
        ax = fig.subplots()
        steps, values = zip(*self.losses)
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set(xlabel="step", ylabel="loss (mean over replicas)", title=title)
        ax.grid(alpha=0.3)
        fig.savefig(path)
        return f"loss curve: {path}"


class Checkpoints:
    """``popdist_lite.save_checkpoint`` with a line for each checkpoint saved, on the
    timeline as a ``checkpoint`` span: at once for a blocking save, once committed for a
    background one (``background``; :meth:`committed` waits and says so).

    Args:
        run: the :class:`RunLog` that says it.
        directory, keep, background: ``save_checkpoint``'s directory, ``keep`` and
            ``not blocking``.
    """

    def __init__(self, run: RunLog, directory, keep: int, background: bool):
        self.run, self.directory, self.keep, self.background = run, directory, keep, background
        self._pending: list[tuple[int, Path, float]] = []  # background saves not yet reported

    def save(self, state: dict, step: int) -> None:
        """Save ``state`` as checkpoint ``step`` (collective)."""
        begin = time.perf_counter()
        with popdist_lite.timeline.span("checkpoint"):
            path = popdist_lite.save_checkpoint(self.directory, state, step=step, keep=self.keep,
                                                blocking=not self.background)
        self._pending.append((step, path, time.perf_counter() - begin))
        if not self.background:
            self.run.checkpoint(*self._pending.pop())

    def resume(self, state: dict) -> int:
        """Load the newest checkpoint in the directory into ``state`` (collective; a
        ``"step"`` entry among them) and return the step to start from: 0, said so, when
        there is none."""
        latest = popdist_lite.latest_checkpoint(self.directory)
        if latest is None:
            self.run.say(f"no checkpoint in {self.directory}; starting from step 0")
            return 0
        popdist_lite.load_checkpoint(latest, state)
        self.run.say(f"resumed from {latest} (step {state['step']})")
        return state["step"]

    def committed(self) -> None:
        """Wait for a background save, if any, then say it is saved."""
        popdist_lite.wait_checkpoint()
        while self._pending:
            self.run.checkpoint(*self._pending.pop(0), background=True)
