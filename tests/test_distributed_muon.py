"""Muon on DTensor / FSDP2 params: 2 and 4 gloo ranks.

One launch of the ranks per world size runs every check of
``tests/distributed/muon_checks.py`` (see its docstring); each check is one test here.
"""

from __future__ import annotations

import pytest
from distributed import harness, muon_checks

LAUNCH_TIMEOUT_S = 180.0


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, str | None]]:
    return harness.run_ranks(muon_checks.run_all, request.param, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(muon_checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name]]
    assert not failures, "\n".join(failures)
