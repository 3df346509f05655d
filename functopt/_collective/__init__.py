"""Packed reductions over process groups, shared by the transforms, the mixed-precision step
and the sharding strategies (private; the public names are re-exported by
``functopt.distributed``).

It sits low (it imports only torch and ``functopt.tree``) so that ``functopt.transforms``
(``apply_if_finite``, ``zero_nans``) and ``functopt.precision`` can make their one
all-reduce without importing the sharding strategies in ``functopt.distributed``, which
sit above ``functopt.precision``: ``dtensor`` (which part of a DTensor a rank holds and
counts, over which group), ``counting`` (each element counted once: placements and the
``replicated`` declaration of plain tensors), ``stats`` (every gradient statistic of a
step: one local pass over the leaves, packed, one all-reduce), ``owners`` (whole leaves
on one owner rank each and the results back into the shards, two all-to-alls: Muon's
Newton-Schulz on sharded matrices).
"""
