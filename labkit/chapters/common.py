"""What several chapters share: the checks a chapter runs on its parameters before anything launches, and
the exercise self-check.
"""

from __future__ import annotations

from labkit.checks import positive_int
from labkit.runtime.probes import available_memory_bytes

#: the most training steps a chapter parameter takes: a chapter is a few steps per configuration, and a run of
#: more would outlast the cell timeout before it said anything
MAX_STEPS = 10_000


def check_steps(name: str, value) -> int:
    """``value`` as an int in 1..:data:`MAX_STEPS`; ValueError naming ``name``, the value and the range."""
    return positive_int(name, value, maximum=MAX_STEPS)


def check_world_size(chapter: str, world_size, *, minimum: int = 2, why: str = "") -> int:
    """Return ``world_size`` as int; ValueError "chapter NN needs world_size >= minimum ..." (with ``why``)
    when it is smaller or not a positive integer."""
    n = positive_int("world_size", world_size)
    if n < minimum:
        raise ValueError(f"chapter {chapter} needs world_size >= {minimum}, got world_size={n}"
                         + (f": {why}" if why else "") + f"; use world_size={minimum} or more")
    return n


def check_fits_in_memory(spec, world_size: int, *, copies: int = 2, what: str = "this run") -> None:
    """Raise ValueError (before any launch) when ``world_size`` ranks, each holding ``copies`` full fp32 copies
    of ``spec``'s model states (4 + 4 + 8 bytes per parameter: weights, gradients, AdamW moments), would need
    more than half of this machine's available memory (MemAvailable, /proc/meminfo; no check where it cannot
    be read). The message names the model, the bytes (GB = 1e9) and the lab's CPU-sized presets."""
    from labkit.theory.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    need = 16 * spec.n_params() * positive_int("copies", copies) * positive_int("world_size", world_size)
    avail = available_memory_bytes()
    if avail is not None and need > avail / 2:
        raise ValueError(f"model={spec.name!r} ({spec.n_params():.3g} parameters) needs about {need / 1e9:.1f} GB "
                         f"for {what} on {world_size} ranks (16 bytes per parameter x {copies} copies per rank), "
                         f"more than half of the {avail / 1e9:.1f} GB available; choose a CPU-sized preset: "
                         "lab-tiny-llama, lab-tiny-gpt, lab-small-llama")


def check_exercise(answer, reference: float, *, hint: str, wrong: str, rel_tol: float = 1e-6,
                   abs_tol: float = 0.0) -> None:
    """A chapter exercise's self-check, printed. ``answer`` None: prints "not attempted yet" and ``hint`` —
    never the reference (CI runs the chapters unattended, and a reader should not see the answer before
    trying). Otherwise checks that ``answer`` is within ``rel_tol`` (relative) or ``abs_tol`` (absolute) of
    ``reference`` and prints "correct". Raises AssertionError with ``wrong`` (a hint, not the answer) when it
    is not."""
    import math

    if answer is None:
        print(f"not attempted yet — hint: {hint}")
        return
    ok = math.isclose(float(answer), float(reference), rel_tol=rel_tol, abs_tol=abs_tol)
    assert ok, f"{answer!r} is not right. Hint: {wrong}"
    print("correct")


def compare_prediction(my_prediction, *, measured=None, predicted=None, what: str, unit: str = "",
                       measured_label: str = "measured", predicted_label: str = "predicted") -> dict | None:
    """After a chapter's run: print how far the reader's guess (the ``my_prediction`` parameter) was from what
    the run gave (``measured``, labelled ``measured_label``: "measured" or "emulated (<profile>)") and from
    theory (``predicted``, labelled ``predicted_label``). ``my_prediction`` None (CI, or a reader who did not
    guess) prints one line saying so and returns None; the numbers themselves are shown by the chapter's own
    table or figure, never here first.

    ``my_prediction``, ``measured`` and ``predicted`` may be numbers or dicts of numbers with the same keys
    (several guesses at once). Returns ``{key: {"yours", "measured", "predicted", "off_measured",
    "off_predicted"}}`` with ``off_*`` = yours / that value (a ratio; 1.0 is spot on). Raises ValueError for a
    guess that is not a finite number, or a dict whose keys the run does not have (naming the valid keys)."""
    import math

    if my_prediction is None:
        print(f"my_prediction is None: set it before the run to compare your guess for {what}.")
        return None
    guesses = my_prediction if isinstance(my_prediction, dict) else {what: my_prediction}
    meas = measured if isinstance(measured, dict) else {what: measured}
    pred = predicted if isinstance(predicted, dict) else {what: predicted}
    unknown = sorted(set(guesses) - set(meas) - set(pred))
    if unknown:
        raise ValueError(f"my_prediction has keys {unknown} that this chapter does not measure; valid keys: "
                         f"{', '.join(sorted(set(meas) | set(pred)))}")
    out = {}
    for key, guess in guesses.items():
        try:
            g = float(guess)
        except (TypeError, ValueError):
            raise ValueError(f"my_prediction[{key!r}]={guess!r} must be a number") from None
        if not math.isfinite(g):
            raise ValueError(f"my_prediction[{key!r}]={guess!r} must be a finite number")
        row = {"yours": g, "measured": meas.get(key), "predicted": pred.get(key)}
        parts = []
        for name, label in (("measured", measured_label), ("predicted", predicted_label)):
            v = row[name]
            ratio = g / v if v not in (None, 0) else None
            row[f"off_{name}"] = ratio
            if ratio is not None:
                parts.append(f"{ratio:.2f}x the {label} {float(v):.4g}{unit and ' ' + unit}")
        out[key] = row
        print(f"{key}: your {g:.4g}{unit and ' ' + unit} is " + " and ".join(parts) if parts else
              f"{key}: your {g:.4g}{unit and ' ' + unit} (nothing to compare it with in this run)")
    return out


def as_emulate(emulate):
    """A chapter's ``emulate`` parameter as ``launch(..., emulate=...)`` takes it: None when emulation is off —
    None, False, or the strings ``"None"``, ``"none"``, ``"null"``, ``"off"`` and ``""`` (a notebook or a caller
    that passes the word) — else the value unchanged (a profile name, a Cluster or a dict, checked by
    :func:`labkit.runtime.emulate.resolve`)."""
    if emulate is None or emulate is False:
        return None
    off = isinstance(emulate, str) and emulate.strip().lower() in ("none", "null", "off", "")
    return None if off else emulate


def check_prediction(my_prediction, *, what: str, keys: tuple[str, ...] | None = None, default_key: str | None = None,
                     above: float | None = None, at_least: float | None = None, at_most: float | None = None,
                     choices: tuple[str, ...] | None = None):
    """Every chapter's check of its ``my_prediction`` parameter, before anything runs; returns it normalised.

    * None (the default: CI, or a reader who does not guess) is always accepted and returned;
    * ``choices`` given: one of those strings (e.g. ``("replicas", "tp")``);
    * otherwise one finite number (a bool is not a number), within ``above`` (exclusive), ``at_least`` and
      ``at_most`` where given, returned as float — or, when ``keys`` is given, a dict of such numbers whose keys
      are among ``keys`` (``keys=()``: any keys), returned as a dict; a plain number then becomes
      ``{default_key: number}`` when ``default_key`` is given.

    Raises ValueError ``my_prediction=<value> must be None or <what>`` (``what`` says what the chapter asks
    for, with an example), or naming the key that is not one the chapter measures."""
    import math

    if my_prediction is None:
        return None
    if choices is not None:
        if isinstance(my_prediction, str) and my_prediction in choices:
            return my_prediction
        raise ValueError(f"my_prediction={my_prediction!r} must be None or {what}")

    def _number(v, name: str) -> float:
        try:
            x = float(v) if not isinstance(v, (bool, str)) else math.nan
        except (TypeError, ValueError):
            x = math.nan
        in_range = (math.isfinite(x) and (above is None or x > above) and (at_least is None or x >= at_least)
                    and (at_most is None or x <= at_most))
        if not in_range:
            raise ValueError(f"{name}={v!r} must be None or {what}")
        return x

    if isinstance(my_prediction, dict):
        if keys is None:
            raise ValueError(f"my_prediction={my_prediction!r} must be None or {what}")
        for k in my_prediction:
            if keys and k not in keys:
                raise ValueError(f"my_prediction key {k!r} is not one this chapter measures; valid keys: "
                                 f"{', '.join(keys)}")
        return {k: _number(v, f"my_prediction[{k!r}]") for k, v in my_prediction.items()}
    x = _number(my_prediction, "my_prediction")
    return {default_key: x} if keys is not None and default_key is not None else x


def charged_emulation_plan(emulate, emulated_ranks, *, charge_as: str, charged_seq_len, model: str,
                           lab_seq_len: int, what: str) -> dict:
    """The ``emulate=`` dict of a chapter's emulated run (docs/emulation.md): cluster ``emulate``, the ranks'
    ``model`` at ``lab_seq_len`` charged as ``charge_as`` at ``charged_seq_len``, one sequence for one. Checked
    before anything runs: ValueError for ``emulated_ranks`` outside 2..16 (``what`` says why, e.g. "chapter 03's
    emulated sweep runs 2..16 ranks ...; use emulated_ranks=8"), and from labkit.runtime.emulate.resolve naming
    the valid profiles, world sizes or presets."""
    from labkit.checks import positive_int
    from labkit.runtime.emulate import resolve

    n = positive_int("emulated_ranks", emulated_ranks)
    if not 2 <= n <= 16:
        raise ValueError(f"emulated_ranks={n}: {what}")
    plan = {"cluster": emulate, "model": charge_as, "seq_len": positive_int("charged_seq_len", charged_seq_len),
            "micro_batch_size": 1, "lab_model": model, "lab_seq_len": lab_seq_len, "lab_micro_batch_size": 1}
    resolve(plan, n)
    return plan


def span(lo: float, hi: float, fmt: str = ".2f", unit: str = "") -> str:
    """A range as a sentence states it: ``"1.08-1.09x"``, or one number (``"1.08x"``) when both ends print the
    same at ``fmt`` — a sentence never says "1.08-1.08x". ``unit`` follows the number(s)."""
    a, b = format(lo, fmt), format(hi, fmt)
    return f"{a}{unit}" if a == b else f"{a}-{b}{unit}"
