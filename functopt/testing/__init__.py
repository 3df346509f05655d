"""Property-based testing for functopt transforms, and for your own.

``functopt.testing.strategies`` generates pytrees of tensors and nasty gradients;
``functopt.testing.conformance`` checks any transform against the protocol's laws.
"""

from functopt.testing import strategies

__all__ = ["strategies"]
