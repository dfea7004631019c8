"""Shipping a rank function to the ranks: pickled by value with cloudpickle, with the first piece that
cannot be pickled named when it fails (used by launcher.py and pool.py)."""

from __future__ import annotations

import inspect

import cloudpickle


class ShipError(ValueError):
    """The function, an argument or a keyword argument cannot be pickled to send to the ranks."""


# ------------------------------------------------------------------------------------------------------
# shipping the function by value
# ------------------------------------------------------------------------------------------------------
def _pickle_error(obj) -> Exception | None:
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception as e:  # noqa: BLE001
        return e


def _find_unpicklable(obj, path: str, depth: int = 0, seen=None) -> tuple[str, object, Exception] | None:
    """Walk into containers, closures and referenced globals to name the innermost unpicklable piece."""
    err = _pickle_error(obj)
    if err is None:
        return None
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return path, obj, err
    seen.add(id(obj))
    children: list[tuple[str, object]] = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif inspect.isfunction(obj):
        try:
            cv = inspect.getclosurevars(obj)
            children = [(f"{path} captures {k!r}", v) for k, v in cv.nonlocals.items()]
            children += [(f"{path} uses global {k!r}", v) for k, v in cv.globals.items()]
        except (TypeError, ValueError):
            children = []
        children += [(f"{path} default {i}", v) for i, v in enumerate(obj.__defaults__ or ())]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    for child_path, child in children:
        found = _find_unpicklable(child, child_path, depth + 1, seen)
        if found is not None:
            return found
    return path, obj, err


def _by_value_modules():
    """Register the caller's working-directory modules (safepath.cwd_modules) to travel by value; returns the
    ones registered here, to unregister after pickling."""
    from labkit.runtime.safepath import cwd_modules, shipped_sys_path

    already = getattr(getattr(cloudpickle, "cloudpickle", None), "_PICKLE_BY_VALUE_MODULES", set())
    mods = [m for m in cwd_modules(shipped_sys_path()) if m.__name__ not in already]
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    return mods


def ship(fn, args: tuple, kwargs: dict) -> bytes:
    """Pickle ``(fn, args, kwargs)`` by value with cloudpickle (a function defined in a notebook cell or
    ``__main__`` travels by value; one from an importable module by reference; one from a module the caller
    imported from its working directory — a helper file next to the notebook — by value too, because the
    ranks never have the working directory on their path: labkit.runtime.safepath).

    Raises :class:`ShipError` naming the first piece that cannot be pickled, e.g.
    ``fn uses global 'lock' (a _thread.lock) cannot be pickled``.
    """
    mods = _by_value_modules()
    try:
        return _ship(fn, args, kwargs)
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)


def _ship(fn, args: tuple, kwargs: dict) -> bytes:
    payload = {"fn": fn, "args": tuple(args), "kwargs": dict(kwargs)}
    try:
        return cloudpickle.dumps(payload)  # once: pickling a by-value function scans sys.modules (~10 ms)
    except Exception:  # noqa: BLE001 - any pickling failure: find the piece to name below
        pass
    found = (_find_unpicklable(fn, "fn") or _find_unpicklable(tuple(args), "args")
             or _find_unpicklable(dict(kwargs), "kwargs"))
    if found is None:  # the parts pickle one by one but not together: report the whole
        found = ("(fn, args, kwargs)", payload, _pickle_error(payload))
    path, obj, err = found
    raise ShipError(
        f"cannot ship to the ranks: {path} (a {type(obj).__module__}.{type(obj).__qualname__}) cannot be "
        f"pickled ({type(err).__name__}: {err}). Create it inside the rank function, or pass plain data."
    )
