"""The supervisor's pure part: the restart backoff."""

from __future__ import annotations

from backend.ganesha.supervisor import RestartBackoff


def test_backoff_doubles_up_to_its_maximum() -> None:
    backoff = RestartBackoff(initial=0.5, maximum=30, stable_after=60)
    assert [backoff.delay(uptime=1.0) for _ in range(9)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        30.0,
        30.0,
        30.0,
    ]


def test_backoff_resets_once_a_start_stayed_up() -> None:
    backoff = RestartBackoff(initial=0.5, maximum=30, stable_after=60)
    for _ in range(5):
        backoff.delay(uptime=0.0)
    assert backoff.delay(uptime=59.9) == 16.0
    assert backoff.delay(uptime=60.0) == 0.5
    assert backoff.delay(uptime=0.0) == 1.0
