"""The generators here need optax and jax, which the project does not install: they are run
by hand (see their docstrings), never collected by the test suite."""

collect_ignore = ["make_contrib_golden.py"]
