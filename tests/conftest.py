"""Shared test settings. In CI (CI set in the environment) hypothesis draws the same examples every run, so a
red build is reproducible; locally it explores new examples each time."""

import os
import re

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def assert_emulated_label():
    """``check(label, prefix, most_unpriced=15)``: an emulated label names the profile and model (``prefix``,
    without its closing parenthesis); where the emulator says part of a rank's time went unpriced
    (``"; incomplete: N% of rank r's time unpriced"``, labkit.runtime.emulate), that share is at most
    ``most_unpriced`` percent."""

    def check(label: str, prefix: str, most_unpriced: int = 15) -> None:
        m = re.fullmatch(re.escape(prefix) + r"(?:; incomplete: (\d+)% of rank \d+'s time unpriced)?\)", label)
        assert m, label
        assert m.group(1) is None or int(m.group(1)) <= most_unpriced, label

    return check
