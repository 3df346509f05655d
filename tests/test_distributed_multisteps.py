"""``MultiSteps`` on the fast paths with DTensor params: 2 gloo ranks.

One launch of the ranks runs every check of ``tests/distributed/multisteps_checks.py`` (see
its docstring); each check is one test here.
"""

from __future__ import annotations

import pytest
from distributed import harness, multisteps_checks

LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    return harness.run_ranks(multisteps_checks.run_all, 2, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def slow_results() -> list[dict[str, str | None]]:
    return harness.run_ranks(multisteps_checks.run_slow, 2, timeout_s=LAUNCH_TIMEOUT_S)


def _failures(results: list[dict[str, str | None]], name: str) -> str:
    return "\n".join(f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name])


@pytest.mark.parametrize("name", list(multisteps_checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    assert not _failures(results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(multisteps_checks.SLOW_CHECKS))
def test_slow_check(slow_results: list[dict[str, str | None]], name: str) -> None:
    assert not _failures(slow_results, name)
