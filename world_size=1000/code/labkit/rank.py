"""Old path of :mod:`labkit.runtime.rank` (kept for one release): importing it gives that module itself."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("labkit.runtime.rank")
