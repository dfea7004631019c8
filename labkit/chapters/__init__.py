"""One module per chapter notebook (``chNN_topic.py`` beside ``notebooks/NN_topic.ipynb``): the chapter's
parameter check (``check_chapter``, run before any launch), its entry points, the sentences it prints
(findings written from the numbers of the run) and its tables. :mod:`common` holds what several chapters
share.
"""
