"""Test configuration: hypothesis profiles, and torch's generator seeded per test.

``ci`` (the default) is derandomized and bounded so that every run of `make test` sees the
same examples; ``dev`` explores randomly; ``deep`` runs many examples (by hand:
``HYPOTHESIS_PROFILE=deep make test``).
"""

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker process per core: one intra-op thread each, or the
    # workers' OpenMP threads contend for the cores (the examples the suite runs set one
    # thread in-process anyway).
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def float64_default() -> Iterator[None]:
    """float64 as torch's default dtype for the test: torch.optim keeps its scalar state
    (step counts, NAdam's momentum product) in the default dtype, and the float64
    comparisons with it need that to be float64 too."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.fixture(autouse=True)
def _seeded_torch() -> None:
    """Each test starts from the same state of torch's global generator, whatever ran
    before it in its worker: a test that draws unseeded values draws the same ones on
    every run."""
    import torch

    torch.manual_seed(0)
