"""poprun-lite's answers before anything starts: the program and the files the options
name are checked first, one line each naming the flag or the file (issue 39); the
options of torchrun, horovodrun and PopRun that mean nothing here are refused with what
to use instead, and ``-np`` is ``--num-replicas``; the ``--help`` text. No mpirun runs:
the checks come before it is even looked for."""

import os
import re
import subprocess
import sys

import pytest

from popdist_lite_launcher import cli
from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.core.options import REFUSED_OPTIONS
from popdist_lite_launcher.launch.command import check_program
from popdist_lite_launcher.slurm import preempt

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A working directory with ``train.py`` (not executable) and ``run.sh`` (executable)."""
    (tmp_path / "train.py").write_text("print('ran')\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "run.sh").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("program, args, message", [
    ("train.py", [], "train.py is not a command on PATH: did you mean `python train.py`?"),
    ("./train.py", [], "./train.py is not executable: did you mean `python ./train.py`?"),
    ("run.sh", [], "run.sh is not a command on PATH: did you mean `./run.sh`?"),
    ("nonexist", [], "program nonexist: not found on PATH"),
    ("./nonexist.py", [], "program ./nonexist.py: no such file"),
    ("python", ["nonexist.py"], "python nonexist.py: no such file (in {cwd})"),
    ("python3", ["-u", "-W", "ignore", "nonexist.py", "--steps", "3"], "python3 nonexist.py: no such file (in {cwd})"),
    (sys.executable, ["."], f"{os.path.basename(sys.executable)} .: is a directory (in {{cwd}})"),
])
def test_a_program_that_cannot_start_is_named(folder, program, args, message):
    with pytest.raises(LauncherError) as info:
        check_program(program, args)
    assert str(info.value) == message.format(cwd=folder)


@pytest.mark.parametrize("program, args", [
    ("python", ["train.py", "--steps", "3"]), ("./run.sh", []), ("true", []),
    ("python", ["-m", "nonexistent_module"]), ("python", ["-c", "print(1)"]), ("python", ["-u", "train.py"]),
    (sys.executable, ["-X", "dev", "train.py"]),
])
def test_a_program_that_starts_passes(folder, program, args):
    check_program(program, args)


def poprun(*args, cwd=None):
    return subprocess.run([*LAUNCHER, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, message", [
    (["--num-replicas", "2", "train.py"], "train.py is not a command on PATH: did you mean `python train.py`?"),
    (["--num-replicas", "2", "python", "nonexist.py"], "python nonexist.py: no such file (in {cwd})"),
    (["--hostfile", "nofile", "python", "train.py"], "--hostfile nofile: no such file or directory"),
    (["--host-discovery-script", "./nofile", "python", "train.py"], "--host-discovery-script ./nofile: no such file"),
    (["--host-discovery-script", "./train.py", "python", "train.py"],
     "--host-discovery-script ./train.py is not executable (chmod +x ./train.py)"),
    (["--timeline", "nodir/t.json", "python", "train.py"], "--timeline nodir/t.json: no such directory nodir"),
    (["--host-discovery-script", "no-such-command", "python", "train.py"],
     "--host-discovery-script no-such-command: not found on PATH (./no-such-command for a file here)"),
    (["--num-replicas", "2", "-H", "a,b", "--launch-agent", "no-such-agent -p 2", "python", "train.py"],
     "--launch-agent 'no-such-agent -p 2': no-such-agent not found on PATH"),
])
def test_checks_before_launch_are_one_line_naming_the_flag(folder, args, message):
    """Through poprun-lite: exit code 2, one line, before mpirun (nothing ran)."""
    proc = poprun(*args, cwd=folder)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"poprun-lite: error: {message.format(cwd=folder)}\n"
    assert proc.stdout == ""


@pytest.mark.parametrize("flags, value, hint", REFUSED_OPTIONS)
def test_other_launchers_options_are_refused_with_a_hint(flags, value, hint, capsys):
    for flag in flags:
        given = [flag, "2"] if value is True else [flag]
        with pytest.raises(SystemExit) as info:
            cli.parse_args([*given, "python", "train.py"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        shown = " ".join(given)
        assert err == f"poprun-lite: error: {shown}: {hint.format(value='2' if value is True else 'N')}\n"


def test_the_torchrun_habit_gets_the_issues_answer(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--nproc-per-node", "2", "train.py"])
    assert capsys.readouterr().err == (
        "poprun-lite: error: --nproc-per-node 2: poprun-lite starts one process per replica: use "
        "--num-replicas 2 (with -H or a Slurm allocation for several hosts)\n")
    with pytest.raises(SystemExit):
        cli.parse_args(["--nproc_per_node=4", "train.py"])
    assert "use --num-replicas 4" in capsys.readouterr().err


def test_np_is_num_replicas_and_program_options_stay_the_programs():
    opts = cli.parse_args(["-np", "3", "python", "-m", "pkg", "-np", "5", "--nnodes", "2"])
    assert opts.num_replicas == 3 and opts.program == "python"
    assert opts.args == ["-m", "pkg", "-np", "5", "--nnodes", "2"]
    # a value that starts like an option of another launcher is still the value
    opts = cli.parse_args(["--mpi-local-args", "-x FOO", "--mpi-global-args", "-p 1", "prog"])
    assert opts.mpi_local_args == ["-x FOO"] and opts.mpi_global_args == ["-p 1"]


def test_what_exists_passes(folder):
    """A discovery command on PATH, a launch agent needed by no host (this one)."""
    opts = cli.parse_args(["--num-replicas", "2", "--host-discovery-script", "true", "python", "train.py"])
    cli.check_files(opts)
    opts = cli.parse_args(["--num-replicas", "2", "-H", "localhost", "--launch-agent", "no-such-agent",
                           "--timeline", "t.json", "python", "train.py"])
    cli.check_files(opts)


def test_a_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--no-such-flag", "prog"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("poprun-lite: error: unrecognized arguments: --no-such-flag "
                                       "(poprun-lite --help lists the options)\n")


def test_help_keeps_each_example_on_its_lines():
    text = cli.build_parser().format_help()
    lines = text.splitlines()
    continued = [i for i, line in enumerate(lines) if line.rstrip().endswith("\\")]
    assert continued, "the epilog's continued examples"
    for i in continued:  # a continued example's next line starts indented, with its arguments
        assert lines[i + 1].startswith("      ") and not lines[i + 1].strip().startswith("poprun-lite"), lines[i:i + 2]
    assert not any(re.search(r"hosts\.sh\s+python3", line) for line in lines)


def test_grace_period_help_says_what_the_code_does():
    action = next(a for a in cli.build_parser()._actions if "--grace-period" in a.option_strings)
    text = " ".join(action.help.split())
    assert "after SIGTERM" in text
    assert f"KillWait, read with `scontrol show config`, less {preempt.REPORT_SECONDS:g} s" in text
    assert "at least half of KillWait" in text and f"{preempt.DEFAULT_GRACE_SECONDS:g} when KillWait" in text
