# `python -m labkit` puts the working directory first on sys.path: run again with -P before importing more
from labkit.runtime.safepath import reexec_without_cwd

reexec_without_cwd("labkit")

from labkit.cli import main  # noqa: E402

raise SystemExit(main())
