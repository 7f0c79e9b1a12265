"""Skip or fail a test whose external service (PostgreSQL, Chromium) is missing.

``PAVEJAX_REQUIRE_SERVICES=1`` (set by CI) turns the skip into a failure, so a missing server
never passes silently."""

import os

import pytest


def services_required() -> bool:
    """Whether ``PAVEJAX_REQUIRE_SERVICES=1`` is set."""
    return os.environ.get("PAVEJAX_REQUIRE_SERVICES") == "1"


def require_or_skip(reason: str) -> None:
    """``pytest.skip(reason)``, or ``pytest.fail(reason)`` when the services are required."""
    if services_required():
        pytest.fail(f"{reason} (PAVEJAX_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(reason)
