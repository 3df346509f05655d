"""functopt on DTensor and FSDP2 params: 2 and 4 gloo ranks on the CPU.

One launch of the ranks per world size runs every check of ``tests/distributed/checks.py``
(see its docstring for the model, the shards and the tolerances); each check is one test
here. A launch forks the ranks from this process and is killed after ``LAUNCH_TIMEOUT_S``,
so a hang cannot eat the CI budget.
"""

from __future__ import annotations

import pytest
from distributed import checks, harness

LAUNCH_TIMEOUT_S = 150.0


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, str | None]]:
    return harness.run_ranks(checks.run_all, request.param, timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", list(checks.CHECKS))
def test_check(results: list[dict[str, str | None]], name: str) -> None:
    failures = [f"rank {rank}:\n{r[name]}" for rank, r in enumerate(results) if r[name]]
    assert not failures, "\n".join(failures)
