"""Run and measure: :func:`launcher.launch` starts ranks, :class:`rank.RankContext` is what a rank knows,
:mod:`timeline` and :mod:`commlog` record what it did, :mod:`records` keeps runs with their identity,
:mod:`measure` counts live tensor bytes, :mod:`training` is the training-step loop experiments share,
:mod:`emulate` times a run as a named GPU cluster would (``launch(..., emulate="dgx-h100")``).
"""
