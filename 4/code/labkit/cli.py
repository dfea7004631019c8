"""The ``labkit`` command line: one subcommand per module in ``labkit/commands/``.

Each command module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Every command and every benchmark goes through :func:`run_main`, the one place that
turns what a user can cause into one line on stderr: bad input (ValueError, TypeError, OverflowError and other
ArithmeticErrors, a YAML syntax error, an OSError for a path, a MemoryError from an absurd size) exits 2; a
launch that fails (LaunchError) prints its first line and exits 1; a closed pipe (``| head``) ends quietly.
Argument parsing errors are one line and exit 2 as well (:class:`_Parser`).
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


def _is_yaml_error(e: BaseException) -> bool:
    return any(t.__module__.split(".")[0] == "yaml" and t.__name__ == "YAMLError" for t in type(e).__mro__)


def _one_line(name: str, e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - e.g. an int too long to print
        text = type(e).__name__
    lines = [ln for ln in f"{name}: error: {text or type(e).__name__}".splitlines() if ln.strip()]
    return lines[0] if lines else f"{name}: error"


def run_main(name: str, fn) -> int:
    """Call ``fn()`` (a command or a benchmark's main) and turn what users cause into one line on stderr and an
    exit status: ValueError, TypeError, ArithmeticError (OverflowError from 1e308-scale numbers...), a YAML error,
    MemoryError or OSError (bad input, an unusable path) -> 2; a failed or timed-out launch
    (labkit.runtime.launcher.LaunchError) -> 1; Ctrl-C -> 130; a closed stdout (``... --json | head``) -> 0, quietly.
    Anything else is a bug and keeps its traceback. Returns ``fn()``'s status (None -> 0)."""
    try:
        return int(fn() or 0)
    except BrokenPipeError:
        # the reader went away (`labkit memory --json | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, TypeError, ArithmeticError, MemoryError, OSError) as e:
        print(_one_line(name, e), file=sys.stderr)
        return 2
    except RuntimeError as e:
        from labkit.runtime.launcher import LaunchError

        if not isinstance(e, LaunchError):
            raise
        # a launch that failed or timed out: its first line says which rank and why
        print(_one_line(name, e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_yaml_error(e):
            raise
        print(_one_line(name, e), file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return run_main(f"labkit {args.command}", lambda: args._run(args))


if __name__ == "__main__":
    raise SystemExit(main())
