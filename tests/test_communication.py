"""The collectives per step of each strategy against the formulas of docs/sharded-state.md:
2 and 4 gloo ranks, one launch per world size (see ``tests/distributed/comm_checks.py``)."""

from __future__ import annotations

import pytest
from distributed import comm_checks, harness

LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, str | None]]:
    return harness.run_ranks(comm_checks.run_all, request.param, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(comm_checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name]]
    assert not failures, "\n".join(failures)
