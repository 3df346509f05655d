"""Different transforms for different parameters: ``partition``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

from functopt._base import GradientTransformation, Params, State, Updates
from functopt._spec import Select, describe, specified
from functopt.transforms import _common
from functopt.transforms.combining import _check_transform
from functopt.tree import _core

__all__ = ["PartitionState", "partition"]


class PartitionState(NamedTuple):
    """State of [`partition`][functopt.partition]."""

    # label -> state of transforms[label], built on a tree that holds the params of that
    # label and None at every other leaf (so its per-leaf fields are None there too).
    inner_states: dict[Hashable, State]


def _describe_label(label: Any) -> str:
    return repr(label) if isinstance(label, (str, int, float, tuple)) else type(label).__name__


def _flat_labels(labels: Any, tree: Any, treespec: _core.TreeSpec, *, what: str) -> list[Any]:
    """One label per leaf of ``tree`` (of structure ``treespec``), broadcasting prefix labels."""
    try:
        return _core.broadcast_prefix(labels, tree, treespec)
    except ValueError as where:
        raise ValueError(
            f"partition: param_labels does not line up with the {what} ({where}). Expected a "
            f"pytree of labels with the {what}' structure, or a prefix of it (one label for a "
            f"whole subtree). Fix: build the labels from the same pytree as the params, with one "
            f"label at every leaf (None leaves included), or pass a function params -> labels."
        ) from None


def _groups(flat: list[Any], txs: Mapping[Hashable, Any], treespec: _core.TreeSpec,
            ) -> tuple[dict[Hashable, list[int]], list[int]]:
    """The leaves of each label (``flat``: one label per leaf), and those labelled None
    where no transform is keyed None."""
    groups: dict[Hashable, list[int]] = {label: [] for label in txs}
    unlabelled: list[int] = []
    for i, label in enumerate(flat):
        if label is None and None not in txs:
            unlabelled.append(i)
            continue
        try:
            groups[label].append(i)
        except (KeyError, TypeError):
            where = _core.paths(treespec)[i]
            raise ValueError(
                f"partition: leaf {where!r} has label {_describe_label(label)}, but "
                f"transforms has no such key (its keys: {[*txs]}). Fix: add a "
                f"transform for this label, or correct param_labels."
            ) from None
    return groups, unlabelled


def _check_unlabelled(unlabelled: list[int], leaves: list[Any], treespec: _core.TreeSpec,
                      what: str, txs: Mapping[Hashable, Any]) -> None:
    """Label functions built with a tree map that skips None (optree's default) put a None
    label where a param has no gradient: harmless there, since nothing is transformed, but
    a tensor needs a transform."""
    for i in unlabelled:
        if leaves[i] is not None:
            where = _core.paths(treespec)[i]
            raise ValueError(
                f"partition: leaf {where!r} of the {what} is "
                f"{_core._describe(leaves[i])} but has the label None, which is allowed "
                f"only where the {what} hold None. Fix: give it one of the labels "
                f"{[*txs]}."
            )


def _inner_states(state: Any, txs: Mapping[Hashable, Any]) -> Mapping[Hashable, State]:
    """``state.inner_states``, checked to hold one state per transform."""
    _common.check_state("partition", state, PartitionState)
    inner_states = getattr(state, "inner_states", None)
    if not isinstance(inner_states, Mapping) or set(inner_states) != set(txs):
        got = (
            f"inner states for {list(inner_states)}"
            if isinstance(inner_states, Mapping) else f"a {type(state).__name__}"
        )
        raise ValueError(
            f"partition expects a PartitionState with inner states for "
            f"{list(txs)}, got {got}. Fix: pass the state returned by this "
            f"partition's init/update."
        )
    return inner_states


def _masked(leaves: list[Any], indices: list[int], treespec: _core.TreeSpec) -> Any:
    """The tree of ``leaves`` with None at every leaf not in ``indices``."""
    out: list[Any] = [None] * len(leaves)
    for i in indices:
        out[i] = leaves[i]
    return _core.unflatten(treespec, out)


def partition(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: Any | Callable[[Params], Any],
) -> GradientTransformation:
    r"""Apply a different transform to each group of parameters, grouped by label.

    Every leaf of the params gets a label from ``param_labels``; the leaves labelled
    $\ell$ are transformed by ``transforms[`` $\ell$ ``]`` and by nothing else:

    $$
    u_i \leftarrow T_{\ell(i)}\big(u_{|\ell(i)}\big)_i,
    $$

    where $u_{|\ell}$ is the tree of updates with ``None`` at every leaf not labelled
    $\ell$. Each inner transform is initialised and updated on such a tree (its params
    and updates are ``None`` outside its group), so its per-leaf state holds tensors only for
    its own leaves, and a reduction it computes (a global norm, say) covers only its group.
    ``params`` are masked the same way; extra arguments reach every inner transform as
    they are.

    Unlike `optax.partition`, a ``transforms`` key that no leaf uses is allowed (its
    transform runs on an all-``None`` tree), so that one recipe serves models that lack a
    group (a model without biases, say); a misspelt label still fails, because the leaf
    that carries it has no transform. Masking extra arguments
    (optax's ``mask_compatible_extra_args``) is not supported.

    Args:
        transforms: a mapping from label to the transform for the leaves with that label.
        param_labels: a pytree of labels with the params' structure, or a prefix of it (a
            label at an inner node labels its whole subtree), or a function
            ``params -> such a pytree``. The function is called with the params in ``init``
            and with the updates in ``update``. The label ``None`` is accepted at a leaf
            that is ``None`` (a tree map that skips ``None``, such as ``optree.tree_map``
            by default, leaves it there); such a leaf is not handed to any transform.

    Returns:
        A [`GradientTransformation`][functopt.GradientTransformation] with [`PartitionState`][functopt.PartitionState].

    Raises:
        TypeError: if ``transforms`` is not a mapping of transforms.
        ValueError: (in ``init``/``update``) naming the leaf whose label has no transform,
            or the place where ``param_labels`` does not line up with the params.

    Examples:
        >>> import torch, functopt
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx = functopt.partition(
        ...     {"train": functopt.scale(-0.5), "frozen": functopt.set_to_zero()},
        ...     {"w": "train", "b": "frozen"},
        ... )
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([1.0, 2.0]), "b": torch.ones(1)},
        ...                            state, params)
        >>> updates
        {'w': tensor([-0.5000, -1.0000]), 'b': tensor([0.])}
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(
            f"partition: transforms must be a mapping from label to GradientTransformation, "
            f"got {type(transforms).__name__}. Fix: partition({{'decay': adamw(...), "
            f"'no_decay': adam(...)}}, param_labels)."
        )
    txs = {
        label: _check_transform("partition", f"transforms[{label!r}]", tx)
        for label, tx in transforms.items()
    }
    labels_are_fn = callable(param_labels)
    # Single-entry cache for fixed labels: the treespec of the updates rarely changes.
    cache: dict[str, Any] = {}

    def groups_of(
        tree: Any, leaves: list[Any], treespec: _core.TreeSpec, what: str
    ) -> dict[Hashable, list[int]]:
        groups: dict[Hashable, list[int]]
        if not labels_are_fn and cache.get("treespec") == treespec:
            groups, unlabelled = cache["groups"], cache["unlabelled"]
        else:
            labels = param_labels(tree) if labels_are_fn else param_labels
            groups, unlabelled = _groups(_flat_labels(labels, tree, treespec, what=what), txs,
                                         treespec)
            if not labels_are_fn:
                cache.update(treespec=treespec, groups=groups, unlabelled=unlabelled)
        _check_unlabelled(unlabelled, leaves, treespec, what, txs)
        return groups

    def init_fn(params: Params) -> PartitionState:
        leaves, treespec = _core.flatten(params)
        groups = groups_of(params, leaves, treespec, "params")
        return PartitionState(
            inner_states={
                label: tx.init(_masked(leaves, groups[label], treespec))
                for label, tx in txs.items()
            }
        )

    def update_fn(
        updates: Updates, state: PartitionState, params: Params | None = None,
        **extra_args: Any,
    ) -> tuple[Updates, PartitionState]:
        inner_states = _inner_states(state, txs)
        leaves, treespec = _core.flatten(updates)
        groups = groups_of(updates, leaves, treespec, "updates")
        param_leaves = (
            None if params is None
            else _core.flatten_like(treespec, params, name="params", reference="updates")
        )
        new_leaves = list(leaves)
        new_states: dict[Hashable, State] = {}
        for label, tx in txs.items():
            indices = groups[label]
            out, new_states[label] = tx.update(
                _masked(leaves, indices, treespec),
                inner_states[label],
                None if param_leaves is None else _masked(param_leaves, indices, treespec),
                **extra_args,
            )
            out_leaves = _core.flatten_like(
                treespec, out, name=f"the updates returned by transforms[{label!r}]",
                reference="updates",
            )
            for i in indices:
                new_leaves[i] = out_leaves[i]
        return _core.unflatten(treespec, new_leaves), PartitionState(inner_states=new_states)

    def select(params: Params, treespec: _core.TreeSpec, leaves: list[Any],
               ) -> dict[Hashable, list[int]]:
        return groups_of(params, leaves, treespec, "params")

    return specified(GradientTransformation(init_fn, update_fn), Select(
        {label: describe(tx) for label, tx in txs.items()}, select,
        lambda state, label: state.inner_states[label], "partition"))
