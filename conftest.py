"""Test configuration: hypothesis profiles.

``ci`` (the default) is derandomized and bounded so that every run of `make test` sees the
same examples; ``dev`` explores randomly; ``deep`` runs many examples (by hand:
``HYPOTHESIS_PROFILE=deep make test``).
"""

import os

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
