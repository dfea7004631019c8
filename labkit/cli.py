"""The ``labkit`` command line: one subcommand per module in ``labkit/commands/``.

Each command module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Bad input (a ValueError from labkit, or an OSError for a path) is printed as one line
on stderr and exits 2; a launch that fails (LaunchError) prints its first line and exits 1; a closed pipe
(``| head``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import labkit.commands


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def command_modules() -> list:
    mods = []
    for info in pkgutil.iter_modules(labkit.commands.__path__):
        if not info.name.startswith("_"):
            mods.append(importlib.import_module(f"labkit.commands.{info.name}"))
    return sorted(mods, key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="labkit", description="LLM Parallelism Lab: run chapters, measure, predict.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod in command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def run_main(name: str, fn) -> int:
    """Call ``fn()`` (a command or a benchmark's main) and turn what users cause into one line on stderr and an
    exit status: ValueError or OSError (bad input, an unusable path) -> 2; a failed or timed-out launch
    (labkit.runtime.launcher.LaunchError) -> 1; Ctrl-C -> 130; a closed stdout (``... --json | head``) -> 0, quietly.
    Anything else is a bug and keeps its traceback. Returns ``fn()``'s status (None -> 0)."""
    try:
        return int(fn() or 0)
    except BrokenPipeError:
        # the reader went away (`labkit memory --json | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as e:
        print(f"{name}: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except RuntimeError as e:
        from labkit.runtime.launcher import LaunchError

        if not isinstance(e, LaunchError):
            raise
        # a launch that failed or timed out: its first line says which rank and why
        print(f"{name}: error: {e}".splitlines()[0], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return run_main(f"labkit {args.command}", lambda: args._run(args))


if __name__ == "__main__":
    raise SystemExit(main())
