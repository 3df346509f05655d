"""Helpers for the multi-process distributed tests (``tests/test_distributed_*.py``).

``harness`` runs a function on N gloo ranks on the CPU with a hard timeout; ``checks``
holds the rank-side checks, grouped so that one launch of the ranks serves many tests.
"""
