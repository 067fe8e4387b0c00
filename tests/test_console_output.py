"""What a person sees from chameleon-plan, chameleon-sim and the table benchmarks.

Tables piped into a file stay whole (a header cell is never cut to "through…" or folded over
two lines), tables on a terminal keep rich's look at the terminal's width, --help teaches
(examples that run, presets, policies, exit statuses), and a usage error is one line that
says what to fix and where to read more. Every case runs the real command in a subprocess.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from chameleon_elastic.console import EXIT_USAGE, PIPE_WIDTH, make_console
from chameleon_elastic.planning import cli as plan_cli
from chameleon_elastic.planning.search import PolicyChoice
from chameleon_elastic.sim import cli as sim_cli
from chameleon_elastic.sim.policies import POLICY_NAMES
from chameleon_elastic.spec import preset_names

REPO = Path(__file__).resolve().parents[1]
MODULES = {"chameleon-plan": "chameleon_elastic.planning.cli",
           "chameleon-sim": "chameleon_elastic.sim.cli"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TIMEOUT_S = 90

#: Small and quick: 8 devices, one simulated hour, two seeds, in this process.
SIM_FAST = ("--preset", "llama2-7b-910b", "--hours", "1", "--failure-rate", "0.5", "--seeds", "2",
            "--jobs", "1", "--no-progress")
PLAN_HEADERS = [["pipeline", "devices (stage order)", "layers per stage", "micro-batches", "recompute"],
                ["source", "receiver", "layers", "size"]]
SIM_HEADERS = [["policy", "throughput (samples/s)", "vs fault-free", "paused (s)",
                "lost work (s)", "working at end", "decide (ms, mean)"]]
LATENCY_HEADERS = [["devices", "tree", "cold decide", "warm decide", "cold replan",
                     "warm replan"],
                   ["devices", "cold search", "paper search", "cache warm", "classes",
                    "cached lookup", "cached decide", "chosen"]]

#: (command after the interpreter, the header rows its tables must show)
TABLE_COMMANDS = {
    "plan": (["-m", MODULES["chameleon-plan"], "--preset", "tiny-cpu", "--fail", "1,3"],
             PLAN_HEADERS),
    "sim": (["-m", MODULES["chameleon-sim"], *SIM_FAST, "--policies", "chameleon,oobleck"],
            SIM_HEADERS),
    "planner_latency": (["benchmarks/planner_latency.py", "--scales", "8"], LATENCY_HEADERS),
}


def _env(**extra: str) -> dict[str, str]:
    """This environment without anything that forces rich's terminal detection either way."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "COLUMNS", "LINES")}
    env.update(extra)
    return env


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(**env),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def _cells(line: str, sep: str) -> list[str]:
    return [c.strip() for c in line.strip().strip(sep).split(sep)]


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header lines, body rows as cells) of every rich table (heavy-head box) in ``text``."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("┏"):
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("┡"))
        bottom = next(j for j in range(end + 1, len(lines)) if lines[j].lstrip().startswith("└"))
        found.append((lines[i + 1:end], [_cells(r, "│") for r in lines[end + 1:bottom]]))
    return found


@pytest.mark.parametrize("name", sorted(TABLE_COMMANDS))
def test_piped_tables_keep_every_header_whole(name: str) -> None:
    # COLUMNS=80, as a shell may export it, must not cut tables that go to a pipe.
    args, headers = TABLE_COMMANDS[name]
    proc = _run(args, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert not ANSI.search(out), "colour codes in a pipe"
    assert "…" not in out, "a cell was cut"
    tables = _tables(out)
    assert len(tables) == len(headers)
    for (head_lines, rows), expected in zip(tables, headers):
        assert len(head_lines) == 1, f"header folded over lines: {head_lines}"
        assert _cells(head_lines[0], "┃") == expected
        assert rows and all(len(r) == len(expected) for r in rows)
    assert max(len(line) for line in out.splitlines()) > 80  # wider than COLUMNS where needed


def test_piped_text_lines_are_not_folded() -> None:
    # The summary of a failure is one line a script can grep, not folded at 80 columns.
    proc = _run(list(TABLE_COMMANDS["plan"][0]), COLUMNS="80")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("failure of [1, 3]"))
    assert "layers 4-7 was lost: they come from in-memory snapshots" in line
    assert line.endswith("(--policy replan or auto).")


def test_make_console_off_a_terminal_is_wide(capsys: pytest.CaptureFixture[str]) -> None:
    # capsys replaces stdout with a non-terminal, as a pipe does.
    assert make_console().width == PIPE_WIDTH
    assert make_console(stderr=True).width == PIPE_WIDTH


def _script(args: list[str], columns: int) -> subprocess.CompletedProcess[str]:
    """Run under a pseudo-terminal (util-linux script); its size is 0x0, so rich reads COLUMNS."""
    if shutil.which("script") is None:
        pytest.skip("util-linux 'script' is not installed: no pseudo-terminal to test on")
    cmd = shlex.join([sys.executable, *args])
    return subprocess.run(["script", "-qec", cmd, "/dev/null"], cwd=REPO,
                          env=_env(COLUMNS=str(columns), TERM="xterm-256color"),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


@pytest.mark.parametrize("name", ["plan", "sim"])
def test_terminal_keeps_richs_look_at_the_terminal_width(name: str) -> None:
    args, headers = TABLE_COMMANDS[name]
    for columns in (160, 80):
        proc = _script(args, columns)
        assert proc.returncode == 0, proc.stdout
        assert ANSI.search(proc.stdout), "no colours: not treated as a terminal"
        text = ANSI.sub("", proc.stdout)
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= columns, "wider than the terminal"
        tables = _tables(text)
        assert len(tables) == len(headers)
        for (head_lines, rows), expected in zip(tables, headers):
            assert all(len(_cells(h, "┃")) == len(expected) for h in head_lines)
            assert rows and all(len(r) == len(expected) for r in rows)
            if columns == 160:  # room for everything: whole headers, one per cell
                assert [_cells(h, "┃") for h in head_lines] == [expected]
        if name == "sim":  # each policy in its own cell, not glued to a number
            assert [r[0] for r in tables[0][1] if r[0]] == ["chameleon", "oobleck"]


def _help(prog: str) -> str:
    proc = _run(["-m", MODULES[prog], "--help"])
    assert proc.returncode == 0 and not proc.stderr
    return proc.stdout


def _section(text: str, title: str) -> list[str]:
    """The lines under the epilog heading that starts with ``title`` (up to a blank line)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title) and ln.endswith(":"))
    body = []
    for ln in lines[start + 1:]:
        if not ln.strip():
            break
        body.append(ln)
    return body


@pytest.mark.parametrize("prog, policies, policy_help", [
    ("chameleon-plan", get_args(PolicyChoice), plan_cli.POLICY_HELP),
    ("chameleon-sim", POLICY_NAMES, sim_cli.POLICY_HELP),
])
def test_help_lists_examples_presets_policies_and_exit_statuses(
        prog: str, policies: tuple[str, ...], policy_help: dict[str, str]) -> None:
    text = _help(prog)
    assert set(policy_help) == set(policies), "a policy without its line in --help"
    examples = [ln.strip() for ln in _section(text, "examples") if ln.startswith(f"  {prog} ")]
    assert len(examples) >= 3
    presets = {ln.split()[0]: ln for ln in _section(text, "presets")}
    assert set(presets) == set(preset_names())
    assert all(len(ln.split()) > 3 for ln in presets.values()), "a preset without a description"
    listed = {ln.split()[0]: ln for ln in _section(text, "policies (")}
    assert set(listed) == set(policies)
    for name in policies:
        assert policy_help[name] in " ".join(listed[name].split())
    statuses = {ln.split()[0] for ln in _section(text, "exit status") if ln.startswith("  ")
                and ln.split()[0].isdigit()}
    assert statuses == {"0", "1", "2"}


@pytest.mark.parametrize("prog", sorted(MODULES))
def test_every_help_example_runs_from_the_repository_root(prog: str, tmp_path: Path) -> None:
    examples = [ln.strip() for ln in _section(_help(prog), "examples")
                if ln.startswith(f"  {prog} ")]
    for example in examples:
        argv = shlex.split(example)[1:]
        if "--out" in argv:  # keep the working tree clean
            argv[argv.index("--out") + 1] = str(tmp_path / "out")
        if prog == "chameleon-sim":  # same report in one process, minus a pool's start-up
            argv += ["--jobs", "1", "--no-progress"]
        proc = _run(["-m", MODULES[prog], *argv])
        assert proc.returncode == 0, f"{example}: {proc.stderr}"
        assert proc.stdout.strip()


@pytest.mark.parametrize("prog, argv, words", [
    ("chameleon-plan", ["--preset", "tiny-cpu", "--bogus"], "unrecognized arguments: --bogus"),
    ("chameleon-plan", ["--preset", "tiny-cpu", "--policy", "fast"], "invalid choice: 'fast'"),
    ("chameleon-plan", ["--preset", "nope"], "unknown preset 'nope'"),
    ("chameleon-plan", ["--preset", "tiny-cpu", "--fail", "9"], "device 9 cannot fail"),
    ("chameleon-sim", ["--preset", "tiny-cpu", "--bogus"], "unrecognized arguments: --bogus"),
    ("chameleon-sim", ["--preset", "tiny-cpu", "--seeds", "x"], "invalid int value: 'x'"),
    ("chameleon-sim", ["--preset", "tiny-cpu", "--policies", "bamboo"], "unknown policy 'bamboo'"),
    ("chameleon-sim", ["--preset", "tiny-cpu", "--seeds", "0"], "--seeds 0 is invalid"),
])
def test_usage_error_is_one_line_with_the_help_hint(prog: str, argv: list[str],
                                                    words: str) -> None:
    proc = _run(["-m", MODULES[prog], *argv])
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == ""
    err = proc.stderr
    assert "Traceback" not in err and "usage:" not in err
    assert len(err.splitlines()) == 1  # one sentence, not the usage block
    assert err.startswith(f"{prog}: error: ") and words in err
    assert err.rstrip().endswith(f"see {prog} --help")
