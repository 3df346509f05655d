"""Property-based testing for functopt transforms, and for your own.

``functopt.testing.strategies`` generates pytrees of tensors and nasty gradients;
``functopt.testing.conformance`` checks any transform against the protocol's laws (purity,
determinism, layout, state round trip, chain and masking laws).
"""

from functopt.testing import conformance, strategies

__all__ = ["conformance", "strategies"]
