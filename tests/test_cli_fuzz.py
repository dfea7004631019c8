"""Property test over CLI argument lists (issue 17, kind 6): for every command, random and absurd values for every
option it has (read from the parser itself, so a new option is fuzzed too) end with exit status 0, 1 or 2; a 2
prints exactly one line on stderr; nothing prints a traceback; every call takes < 5 s.

Nothing is started: the process spawn behind every launch (``RankSet``) and the notebook runner
(``run_chapters``) are replaced by a stub that stops the call once the input has been accepted (counted as
"accepted"). So doctor's and bench's validation up to the spawn, and run's up to executing notebooks, are what
is exercised; launches themselves are covered by test_launch.py / test_hardening.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit.cli import build_parser, main

PER_CALL_S = 5.0
ABSURD = ["0", "-1", "1", "2", "3", "4", "8", "64", "1e308", "1e999", "-1e308", "1e-320", "nan", "inf", "-inf",
          "9" * 320, "1" + "0" * 18, str(2**64 + 1), str(2**40 + 1), "-" + "9" * 30, "x", "", " ", "[1,", "{", "]",
          ": :", "1.5", "0x10", "ü", "∞", "--", "-", "1,2", ",,", "1,0", "1K", "4G", "999999999999G", "-3M", "a=b",
          "world_size=1000", "world_size=[1,", "world_size=", "=", "null", "true", "/proc/forbidden/x", "00", "99",
          "'", '"', "\\", "%s", "{}", "a" * 300, "1e18", "0.0", "-0", "1_000", "²"]
BASE = {  # a valid start, so that random options reach the code behind the parser
    ("plan",): ["--model", "llama-3-8b", "--gpus", "64", "--global-batch", "64"],
    ("memory",): ["--model", "llama-3-8b"],
    ("doctor",): ["--no-probe"],
    ("run",): ["--chapters", "00"],
    ("bench", "collectives"): ["--max-size", "4K"],
}


class _Accepted(BaseException):
    """Raised by the stubs: the input got as far as starting processes / executing notebooks."""


def _commands() -> dict[tuple, argparse.ArgumentParser]:
    found = {}

    def walk(parser, prefix):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and prefix:
            found[tuple(prefix)] = parser
        for a in subs:
            for name, sp in a.choices.items():
                walk(sp, [*prefix, name])

    walk(build_parser(), [])
    return found


COMMANDS = _commands()


def _argv(command: tuple, parser: argparse.ArgumentParser):
    options = [a for a in parser._actions if a.option_strings and "-h" not in a.option_strings]

    def one(action):
        flag = st.sampled_from(action.option_strings)
        if action.nargs == 0:
            return flag.map(lambda f: [f])
        values = st.sampled_from(ABSURD) | st.text(st.characters(blacklist_categories=("Cs",),
                                                                 blacklist_characters="\x00"), max_size=12)
        if action.choices:
            values = st.sampled_from(list(action.choices)) | values
        return st.tuples(flag, values).map(lambda fv: [f"{fv[0]}={fv[1]}"] if fv[1].startswith("-") else list(fv))

    picks = st.lists(st.sampled_from(options).flatmap(one), max_size=6) if options else st.just([])
    base = st.sampled_from([[], BASE.get(command, [])])
    junk = st.lists(st.sampled_from(ABSURD), max_size=1)
    return st.tuples(base, picks, junk).map(lambda t: [*command, *t[0], *(x for p in t[1] for x in p), *t[2]])


@pytest.fixture(scope="module")
def stubbed(tmp_path_factory):
    """Nothing gets started: the spawn and the notebook runner stop the call once input is accepted. The calls
    run in a temporary folder: a fuzzed ``labkit notebooks DEST`` writes a lab folder there, not into the
    checkout (it once left 30 such folders, named " ", "0", "1e308", ..., in the repository)."""
    import labkit.notebooks
    import labkit.runtime.launcher as launcher

    def refuse(*args, **kwargs):
        raise _Accepted()

    mp = pytest.MonkeyPatch()
    mp.chdir(tmp_path_factory.mktemp("cli_fuzz_cwd"))
    mp.setattr(launcher, "RankSet", refuse)
    mp.setattr(labkit.notebooks, "run_chapters", refuse)
    import torch  # noqa: F401 - imported once here, not inside a timed call

    for command in COMMANDS:  # import each command's modules outside the timed calls
        _call([*command, "--help"])
    _call(["run", "--chapters", "00", "-p", "not_declared=1"])  # papermill and nbformat, once
    yield
    mp.undo()


def _call(argv: list[str]) -> tuple[int | str, str, float]:
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
        except _Accepted:
            rc = "accepted"
    return rc, err.getvalue(), time.perf_counter() - t0


OUTCOMES: dict[tuple, dict] = {}


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=lambda c: "-".join(c))
def test_any_argument_list_ends_in_one_line_or_success(command, stubbed):
    outcomes = OUTCOMES.setdefault(command, {})

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_argv(command, COMMANDS[command]))
    def check(argv):
        rc, err, seconds = _call(argv)
        outcomes[rc] = outcomes.get(rc, 0) + 1
        outcomes["max_s"] = round(max(outcomes.get("max_s", 0.0), seconds), 3)
        assert "Traceback" not in err, (argv, err)
        assert rc in (0, 1, 2, "accepted"), (argv, rc, err)
        if rc == 2:
            assert len(err.strip().splitlines()) == 1, (argv, err)
        assert seconds < PER_CALL_S, (argv, seconds)

    check()
    assert sum(v for k, v in outcomes.items() if k != "max_s") >= 60
    print(f"{' '.join(command)}: {outcomes}")
