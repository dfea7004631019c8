"""Calibration and validation kept apart: which rows may fit a profile's free parameters, and the fitting.

Pure Python (no torch, no pandas, no yaml). A row is a dict (one line of a CSV in the published schema, or one
row of a ``labkit record`` recording) with a ``role`` column:

* ``calibration``: used to fit the free parameters;
* ``validation``: never used in fitting, only to report how far the fitted model lands from it.

:func:`split_roles` is the one gate: every fit in the lab reads :func:`calibration_rows` and nothing else, so a
validation row cannot influence a fit (tests/test_calibrate.py perturbs the validation rows and asserts the
fitted parameters do not move).
"""

from __future__ import annotations

#: the roles a row may carry
ROLES = ("calibration", "validation")


def _row_name(row: dict, index: int) -> str:
    """A short name of a row for an error message: its source/op/bytes if it has them, else its index."""
    keys = ("source", "run", "op", "shape", "bytes", "model")
    parts = [f"{k}={row[k]!r}" for k in keys if row.get(k) not in (None, "")]
    return f"row {index} ({', '.join(parts)})" if parts else f"row {index}"


def split_roles(rows) -> tuple[list[dict], list[dict]]:
    """Split ``rows`` (an iterable of dicts) by their ``role`` column into ``(calibration, validation)``, each
    in the input order.

    Raises ValueError naming the first row whose ``role`` is missing, empty or not one of :data:`ROLES`
    (``'calibration'`` or ``'validation'``; surrounding spaces and case are ignored).
    """
    calibration: list[dict] = []
    validation: list[dict] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {i} is {type(row).__name__} {row!r}; each row must be a dict with a 'role' column")
        role = str(row.get("role") or "").strip().lower()
        if role == "calibration":
            calibration.append(row)
        elif role == "validation":
            validation.append(row)
        else:
            raise ValueError(
                f"{_row_name(row, i)} has role={row.get('role')!r}; each row's role must be one of {ROLES}"
            )
    return calibration, validation


def calibration_rows(rows) -> list[dict]:
    """The rows whose ``role`` is ``calibration`` (the only rows a fit may read); raises ValueError as
    :func:`split_roles` does for a row without a valid role."""
    return split_roles(rows)[0]


def validation_rows(rows) -> list[dict]:
    """The rows whose ``role`` is ``validation`` (never fitted on); raises ValueError as :func:`split_roles`."""
    return split_roles(rows)[1]
