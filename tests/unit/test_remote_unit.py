"""Pure parts of `llmd_supervisor.adapters.nodes.remote`: backoff schedule and settings checks."""

from __future__ import annotations

import pytest

from llmd_supervisor.adapters.nodes.remote import (
    BACKOFF_CAP_S,
    BACKOFF_FIRST_S,
    SshSettings,
    backoff_delay,
)


@pytest.mark.parametrize(
    ("failures", "low", "high"),
    [(0, 0.0, 0.0), (1, 0.1, 0.2), (2, 0.2, 0.4), (3, 0.4, 0.8), (6, 2.5, 5.0), (500, 2.5, 5.0)],
)
def test_backoff_is_jittered_exponential_and_capped(failures: int, low: float, high: float) -> None:
    assert backoff_delay(failures, lambda: 0.0) == pytest.approx(low)
    assert backoff_delay(failures, lambda: 1.0) == pytest.approx(high)
    assert low <= backoff_delay(failures) <= high


def test_backoff_constants() -> None:
    assert (BACKOFF_FIRST_S, BACKOFF_CAP_S) == (0.2, 5.0)


def test_host_keys_are_verified_unless_explicitly_disabled() -> None:
    with pytest.raises(ValueError, match="insecure_accept_any_host_key"):
        SshSettings("u", ("k",), None)
    insecure = SshSettings("u", ("k",), None, insecure_accept_any_host_key=True)
    assert insecure.known_hosts is None
    assert SshSettings("u", ("k",), "/etc/ssh/known").insecure_accept_any_host_key is False
