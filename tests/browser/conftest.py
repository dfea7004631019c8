"""The browser test runs only when asked for (``make test-browser`` sets LABKIT_BROWSER=1): it needs Chromium and
Playwright and takes minutes, so ``make test`` leaves it out."""

import os

collect_ignore_glob = [] if os.environ.get("LABKIT_BROWSER") == "1" else ["test_*.py"]
