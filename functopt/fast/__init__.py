"""Fast paths: the step planner (PyTorch's fused kernels, and a compiled tier for the
elementwise rules they lack), a whole-step entry point with donation, and ``explain``.

The pure transforms stay the reference (readable, per leaf, differentiable with
``torch.func``); everything here computes the same steps faster and is tested equal to
them (tests/test_fast.py, tests/test_planner.py). See the performance page of the docs for
the measured speed.
"""

from functopt.fast._capture import CapturedStep
from functopt.fast._errors import CaptureError, FastPathWarning
from functopt.fast._explain import Explanation, explain
from functopt.fast._step import Step, make_step

__all__ = ["CaptureError", "CapturedStep", "Explanation", "FastPathWarning", "Step", "explain",
           "make_step"]
