"""Start JupyterLab headless on 127.0.0.1 for the browser test, and find the Chromium to drive it with.

JupyterLab runs with no token or password, on a free port of the loopback interface only, with
``--allow-root`` when this process is root (containers), the notebook's windowing off (every cell is in the
DOM, so every figure can be found) and the app exposed to the page (``window.jupyterapp``) so the test can
read the notebook model the way the frontend holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

#: Chromium flags for a sandboxed, offline, headless run (a fresh --user-data-dir is given by the caller)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def find_chromium() -> str | None:
    """``$LABKIT_CHROMIUM``, else Debian's /usr/bin/chromium, else chromium / chromium-browser on PATH."""
    for cand in (os.environ.get("LABKIT_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(root: Path, settings: Path, *, timeout_s: float = 90.0, log: Path | None = None):
    """Run ``jupyter lab`` serving ``root``; yields its base URL; stops it (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    settings.mkdir(parents=True, exist_ok=True)
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True, exist_ok=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    notes = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notes.parent.mkdir(parents=True, exist_ok=True)
    notes.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))  # no news toast over figures
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--port-retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
           f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={settings}",
           f"--LabApp.workspaces_dir={settings / 'workspaces'}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--expose-app-in-browser"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(settings / "config")}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with status {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer on {url} within {timeout_s:g} s; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        if log:
            out.close()
