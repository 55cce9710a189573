"""Shared test configuration: hypothesis profiles chosen by HYPOTHESIS_PROFILE.

- ``dev`` (default): quick, randomized, for the edit-test loop.
- ``ci``: derandomized (the same examples every run), enough examples to mean something.
- ``nightly``: many more examples, no deadline.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=200,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
