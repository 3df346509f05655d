"""Fast paths: fused kernels for the recipes, a whole-step entry point with donation, and
``torch.compile`` of any chain.

The pure transforms stay the reference (readable, per leaf, differentiable with
``torch.func``); everything here computes the same steps faster and is tested equal to
them (tests/test_fast.py). See the performance page of the docs for the measured speed.
"""

from functopt._kernel import FusedTransformation, Kernel, KernelResult
from functopt.fast._step import make_step

__all__ = ["FusedTransformation", "Kernel", "KernelResult", "make_step"]
