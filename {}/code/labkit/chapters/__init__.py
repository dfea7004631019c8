"""One module per chapter notebook (``chNN_topic.py`` beside ``notebooks/NN_topic.ipynb``): the chapter's
parameter check (``check_chapter``, run before any launch), its entry points, the sentences it prints
(findings written from the numbers of the run) and its tables. :mod:`common` holds what several chapters
share.
"""

from labkit.runtime import zygote as _zygote

_zygote.prestart()  # every chapter launches ranks: their template imports torch while the kernel imports plotly
