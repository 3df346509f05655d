"""Each param counted once in a global norm under tensor, expert and pipeline parallelism:
2 and 4 gloo ranks, one launch per world size (see ``tests/distributed/replication_checks.py``).
"""

from __future__ import annotations

import pytest
from distributed import harness, replication_checks

LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, str | None]]:
    return harness.run_ranks(replication_checks.run_all, request.param,
                             timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(replication_checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name]]
    assert not failures, "\n".join(failures)
