"""How the command-line tools talk to a person: one home for the rich Console, the argparse
parser whose usage errors are one sentence, the exit statuses, and the preset list of --help.

Why a shared module: rich sizes every table to the console's width, and a console that writes
to a pipe or a file is 80 columns wide, so ``chameleon-sim > out.txt`` used to cut header
cells to ``through…``. Each tool deciding for itself is how that happened; here the decision
is made once (:func:`make_console`) for ``chameleon-plan``, ``chameleon-sim`` and the
benchmarks that print tables. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "PIPE_WIDTH",
    "CliParser",
    "help_epilog",
    "make_console",
    "preset_lines",
    "usage_error",
]

#: The work was done.
EXIT_OK = 0
#: The request was well formed but the work could not be done (the planner found no plan, an
#: output could not be written).
EXIT_FAILURE = 1
#: The request itself is wrong (unknown flag, preset or policy, bad number, unreadable file);
#: argparse's own status for usage errors, kept for the errors found after parsing too.
EXIT_USAGE = 2

#: Width of a console that does not write to a terminal. Nobody reads a pipe or a file at a
#: fixed width, so tables get the width their cells need and lines are not folded: a header
#: stays whole, ``grep`` finds a row on one line. Large enough never to bind, small enough
#: that a stray full-width renderable cannot produce megabytes.
PIPE_WIDTH = 4096


def make_console(*, stderr: bool = False) -> Console:
    """A rich Console for stdout (or stderr): on a terminal exactly rich's default (terminal
    width, colours); anywhere else :data:`PIPE_WIDTH` columns wide and without colours.

    rich's own test for a terminal decides (``isatty``, ``FORCE_COLOR``, ``TTY_COMPATIBLE``),
    so forcing colours in CI also keeps the terminal look. ``COLUMNS`` only applies on a
    terminal: exported by a shell, it would otherwise cut tables in a pipe all over again.
    """
    from rich.console import Console

    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


def _one_sentence(message: str) -> str:
    return message.strip().rstrip(".")


def usage_error(prog: str, message: str) -> NoReturn:
    """The one line of a usage error, and argparse's exit status for it (also for parsers
    built elsewhere, such as torch's, which chameleon-run extends)."""
    sys.stderr.write(f"{prog}: error: {_one_sentence(message)}; see {prog} --help\n")
    raise SystemExit(EXIT_USAGE)


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: the problem, then where to read more.

    argparse prints its whole usage block (up to a dozen wrapped lines of flags) before the
    message, which buries the one line that says what to fix. Errors found after parsing (an
    unknown preset, a device that is not live) go through :meth:`error` too, so every usage
    error looks alike and exits :data:`EXIT_USAGE`.
    """

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, message)

    def failure(self, message: str) -> int:
        """Report that well-formed work could not be done, in one line, and return
        :data:`EXIT_FAILURE` (no --help hint: the flags were right)."""
        print(f"{self.prog}: error: {message.strip()}", file=sys.stderr)
        return EXIT_FAILURE


def help_epilog(examples: Sequence[tuple[str, str]], policy_heading: str,
                policies: Sequence[tuple[str, str]], notes: Sequence[str],
                statuses: Sequence[tuple[int, str]]) -> str:
    """The end of every command's --help, in one layout: examples (command, what it shows),
    the presets (from their files), the policies (name, one line), free notes and the exit
    statuses (a status's text may continue on lines of its own, indented)."""
    pad = max((len(n) for n, _ in policies), default=0)
    width = max((len(str(c)) for c, _ in statuses), default=1)
    return "\n".join([
        "examples (run from the repository root):",
        *(line for cmd, what in examples for line in (f"  {cmd}", f"      {what}")),
        "",
        "presets (--preset NAME):",
        *preset_lines(),
        "",
        policy_heading,
        *(f"  {n:<{pad}}  {text}".rstrip() for n, text in policies),
        "",
        *([*notes, ""] if notes else []),
        "exit status:",
        *(f"  {code:<{width}}  {text}" for code, text in statuses),
    ])


def preset_lines(indent: str = "  ") -> list[str]:
    """One line per built-in preset for --help, read from the presets themselves (so the
    list cannot go stale): its name, what its file's first comment line says it is (text
    before the first colon), and the shape it runs."""
    from importlib import resources

    from .spec import JobSpec, preset_names

    names = preset_names()
    pad = max((len(n) for n in names), default=0)
    lines = []
    for name in names:
        spec = JobSpec.preset(name)
        text = resources.files("chameleon_elastic.presets").joinpath(f"{name}.toml").read_text()
        first = text.lstrip().splitlines()[0] if text.strip() else ""
        what = first.lstrip("#").split(":", 1)[0].strip().rstrip(".") if first.startswith(
            "#") else ""
        c, t = spec.cluster, spec.training
        unit = f" x tp {t.tp}" if t.tp > 1 else ""
        cards = "cards" if t.tp > 1 else "devices"
        shape = f"{c.devices} {cards}, pp {t.pp} x dp {t.dp}{unit}, {spec.model.layers} layers"
        lines.append(f"{indent}{name:<{pad}}  {what + '; ' if what else ''}{shape}")
    return lines
