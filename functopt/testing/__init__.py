"""Property-based testing for functopt transforms, and for your own.

``functopt.testing.strategies`` generates pytrees of tensors and nasty gradients;
``functopt.testing.conformance`` checks any transform against the protocol's laws (purity,
determinism, layout, state round trip, chain and masking laws). ``bitwise_equal``,
``assert_bitwise_equal`` and ``clone_tree`` compare trees the way those checks do.
"""

from functopt.testing import conformance, strategies
from functopt.testing._compare import assert_bitwise_equal, bitwise_equal, clone_tree

__all__ = ["assert_bitwise_equal", "bitwise_equal", "clone_tree", "conformance", "strategies"]
