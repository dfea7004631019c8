"""Old path of :mod:`labkit.runtime.worker` (kept for one release), so ``torchrun -m labkit.worker`` and
``import labkit.worker`` keep working."""
import importlib
import sys

if __name__ == "__main__":
    from labkit.runtime.worker import main

    sys.exit(main())
sys.modules[__name__] = importlib.import_module("labkit.runtime.worker")
