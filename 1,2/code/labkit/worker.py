"""Old path of :mod:`labkit.runtime.worker` (kept for one release), so ``torchrun -m labkit.worker`` and
``import labkit.worker`` keep working."""
if __name__ == "__main__":  # torchrun starts ranks as `python -m`: the working directory is on sys.path
    from labkit.runtime.safepath import reexec_without_cwd

    reexec_without_cwd("labkit.worker")

import importlib  # noqa: E402
import sys  # noqa: E402

if __name__ == "__main__":
    from labkit.runtime.worker import main

    sys.exit(main())
sys.modules[__name__] = importlib.import_module("labkit.runtime.worker")
