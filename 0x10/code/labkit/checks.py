"""Input validation shared by every module: one wording for every ValueError the lab raises.

Pure Python (no torch). Every message names the offending value and what would be valid, e.g.
``tp=3 does not divide n_heads=32; valid tp: 1, 2, 4, 8, 16, 32``.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The largest count (sequence length, heads, layers, GPUs, micro-batches, ...) any check accepts: 2**40
#: (about 1.1e12, far beyond any real run). Bounded-time rule: a search over divisors takes ~sqrt(n) steps, so
#: at this bound it takes 2**20 steps (~0.1 s); anything larger is refused at once instead of hanging.
MAX_COUNT = 2**40


def shown(value) -> str:
    """``repr(value)``, but a huge integer as ``a 400-digit integer`` (Python refuses str() of > 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {value.bit_length() * 30103 // 100000 + 1}-digit integer"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_magnitude(name: str, value: int, maximum: int = MAX_COUNT) -> int:
    """Raise ValueError when ``value`` exceeds ``maximum`` (default :data:`MAX_COUNT` = 2**40), naming both."""
    if value > maximum:
        k = maximum.bit_length() - 1
        pow2 = f" (2**{k})" if maximum == 1 << k else ""
        raise ValueError(f"{name}={shown(value)} is too large: labkit accepts at most {maximum}{pow2} for a count "
                         "like this")
    return value


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order. Raises ValueError for n < 1 or n > :data:`MAX_COUNT`
    (the search takes ~sqrt(n) steps: bounded at 2**20)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {shown(n)}")
    check_magnitude("n", n)
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def positive_int(name: str, value, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Return ``value`` as int if it is an integer >= ``minimum`` (and <= ``maximum`` when given); else ValueError
    naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name}={shown(value)} must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={shown(value)} must be an integer >= {minimum}")
    if maximum is not None:
        check_magnitude(name, value, maximum)
    return value


def positive_float(name: str, value, *, allow_zero: bool = False) -> float:
    """Return ``value`` as float if it is a number > 0 (or >= 0 with allow_zero); else ValueError naming it (a
    string such as ``"1e12"`` is refused: a caller that checks and goes on using its own value would pass the
    string on)."""
    if isinstance(value, (str, bytes, bool)):
        raise ValueError(f"{name}={shown(value)} must be a finite number, not a {type(value).__name__}")
    try:
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}={shown(value)} must be a finite number") from None
    if f != f or f in (float("inf"), float("-inf")) or f < 0 or (f == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={shown(value)} must be a finite number {bound}")
    return f


def check_divides(degree_name: str, degree: int, size_name: str, size: int, *, hint: str = "") -> None:
    """Raise ValueError unless ``degree`` divides ``size``; the message lists the valid degrees.

    Example message: ``tp=3 does not divide n_heads=32; valid tp: 1, 2, 4, 8, 16, 32``.
    """
    degree = positive_int(degree_name, degree)
    size = positive_int(size_name, size)
    if size % degree:
        check_magnitude(size_name, size)
        valid = ", ".join(str(d) for d in divisors(size))
        extra = f"; {hint}" if hint else ""
        raise ValueError(
            f"{degree_name}={degree} does not divide {size_name}={size}; valid {degree_name}: {valid}{extra}"
        )


def check_choice(name: str, value, choices: Iterable) -> None:
    """Raise ValueError unless ``value`` is one of ``choices`` (listed in the message)."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")
