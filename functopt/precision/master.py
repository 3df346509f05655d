"""How a mixed-precision step keeps low-precision params exact: master-weight strategies.

A strategy is three per-leaf functions. ``init(param)`` builds the leaf's store (a float32
copy, a compensation buffer, or nothing); ``view(param, store)`` is the master-precision
value the update rule sees (and weight decay reads); ``write(param, store, value, generator)``
turns the new master-precision value into the new param and store. The step applies the
skip around them, so a strategy never needs to know about overflows.

| strategy | the param after a step | what is lost |
| --- | --- | --- |
| [`float32_master`][functopt.precision.float32_master] | round-to-nearest of an exact float32 master | nothing (float32 maths) |
| [`kahan_summation`][functopt.precision.kahan_summation] | round-to-nearest of ``param + compensation`` | bits below about two low-precision significands |
| [`stochastic_rounding`][functopt.precision.stochastic_rounding] | an unbiased random rounding | nothing on average; each step adds rounding noise |

Bytes per parameter for a bfloat16 param: the param and the strategy's store, without the
update rule's state (``tests/test_master_weights.py`` measures each row from the state):

| strategy | store | bytes |
| --- | --- | --- |
| ``float32_master()`` | float32 copy | 2 + 4 = 6 |
| ``kahan_summation()`` | bfloat16 compensation | 2 + 2 = 4 |
| ``stochastic_rounding()`` | none | 2 + 0 = 2 |
| ``float32_master(torch.bfloat16)`` (bfloat16 maths, no master) | none | 2 + 0 = 2 |

With Adam inside ([`mixed_precision`][functopt.precision.mixed_precision] around
``functopt.adam(lr)``, or around ``chain(scale_by_adam(mu_dtype=torch.bfloat16,
nu_dtype=torch.bfloat16), scale_by_learning_rate(lr))`` for bfloat16 moments), bytes per
bfloat16 parameter: param + store + ``mu`` + ``nu`` (the moments default to the dtype of
``view``, float32 for the first three strategies):

| strategy | float32 moments | bfloat16 moments |
| --- | --- | --- |
| ``float32_master()`` | 6 + 8 = 14 | 6 + 4 = 10 |
| ``kahan_summation()`` | 4 + 8 = 12 | 4 + 4 = 8 |
| ``stochastic_rounding()`` | 2 + 8 = 10 | 2 + 4 = 6 |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from functopt._collective.dtensor import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["MasterWeights", "float32_master", "kahan_summation", "stochastic_rounding"]


class MasterWeights(NamedTuple):
    """A master-weight strategy: how a low-precision param keeps its master-precision value.

    Three per-leaf functions, which [`mixed_precision`][functopt.precision.mixed_precision]
    calls on each param (and applies the overflow skip around): ``init(param)`` builds the
    leaf's store (or ``None``); ``view(param, store)`` is the value the update rule sees;
    ``write(param, store, value, generator)`` returns the new ``(param, store)`` for the new
    master-precision ``value``. The built-in strategies are
    [`float32_master`][functopt.precision.float32_master] (a float32 copy: exact, 6 bytes
    per bfloat16 param), [`kahan_summation`][functopt.precision.kahan_summation] (a
    compensation word: 4 bytes) and
    [`stochastic_rounding`][functopt.precision.stochastic_rounding] (no store: 2 bytes);
    ``functopt/precision/master.py`` tabulates the bytes with Adam's moments too.
    """

    init: Callable[[torch.Tensor], torch.Tensor | None]
    view: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    write: Callable[
        [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None],
        tuple[torch.Tensor, torch.Tensor | None],
    ]
    dtype: torch.dtype  # precision of view() and of the update maths
    needs_generator: bool  # whether write() draws random numbers
    # The store is a plain copy of the master value (or None: the param is its own master)
    # and write() is ``(value.to(param.dtype), value)``: then a fused kernel may update the
    # store in place and the param is copied from it (float32_master).
    plain_copy: bool = False


def float32_master(dtype: torch.dtype = torch.float32) -> MasterWeights:
    """Keep a ``dtype`` copy of every param narrower than ``dtype``; write params from it.

    After every step a low-precision param is bitwise ``master.to(param.dtype)``
    (round-to-nearest-even of the exact master), however nearly an update cancels the
    master value. Params already of ``dtype`` or wider get no copy and are updated in
    place of it.

    Examples:
        >>> import torch
        >>> from functopt.precision import float32_master
        >>> mw = float32_master()
        >>> p = torch.tensor([1.0], dtype=torch.bfloat16)
        >>> store = mw.init(p)
        >>> mw.write(p, store, store + 1e-3, None)
        (tensor([1.], dtype=torch.bfloat16), tensor([1.0010]))
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"float32_master: dtype must be a floating torch.dtype, got {dtype!r}.")

    def init(param: torch.Tensor) -> torch.Tensor | None:
        if torch.finfo(param.dtype).bits < torch.finfo(dtype).bits:
            return param.detach().to(dtype)
        return None

    def view(param: torch.Tensor, store: torch.Tensor | None) -> torch.Tensor:
        return param if store is None else store

    def write(
        param: torch.Tensor, store: torch.Tensor | None, value: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del generator
        if store is None:
            return value, None
        return value.to(param.dtype), value

    return MasterWeights(init, view, write, dtype, needs_generator=False, plain_copy=True)


def _narrow(dtype: torch.dtype) -> bool:
    return torch.finfo(dtype).bits < 32


def _check_rounding_dtype(dtype: torch.dtype) -> None:
    if _narrow(dtype) and dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"stochastic_rounding: cannot round to {dtype}; it rounds to torch.bfloat16 and "
            f"torch.float16 (params of float32 or wider are written as they are). Fix: use "
            f"float32_master() for {dtype} params."
        )


def _round_bfloat16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # bfloat16 is the top half of a float32. Adding 16 uniform random bits to the bottom
    # half and truncating carries into the kept half with probability (bottom half) / 2**16,
    # which is the distance to the lower neighbour over the spacing, in every binade
    # (subnormals included, since both formats share the exponent range). The sign is a
    # separate bit, so this rounds magnitudes: unbiased for either sign. inf has a zero
    # bottom half and stays inf; nan would lose its payload (or wrap), so it passes through.
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator,
                          device=generator.device).to(x.device)
    bits = (x.view(torch.int32) + noise) & -65536  # -65536 == 0xFFFF0000
    return torch.where(torch.isnan(x), x, bits.view(torch.float32)).to(torch.bfloat16)


def _round_float16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # float16 has a narrower exponent range than float32, so the bit trick fails at its
    # subnormals and at its maximum. Instead: the spacing of float16 numbers around |x|
    # (2**(e - 11) in the binade [2**(e-1), 2**e), 2**-24 below the normals), |x| / spacing
    # split into integer and fraction (both exact: power-of-two scaling, < 2**11), and a
    # round up when a uniform float64 draw is below the fraction.
    a = x.abs()
    _, e = torch.frexp(a)
    spacing_exp = torch.clamp(e - 11, min=-24)
    scaled = torch.ldexp(a, -spacing_exp)
    low = torch.floor(scaled)
    u = torch.rand(x.shape, dtype=torch.float64, generator=generator,
                   device=generator.device).to(x.device)
    up = (u < (scaled - low).to(torch.float64)).to(torch.float32)
    magnitude = torch.ldexp(low + up, spacing_exp)  # 2**16 when rounding up past 65504
    rounded = torch.copysign(magnitude, x)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.float16)


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    # Steele, Lea and Flood's SplitMix64 finaliser: a bijection on 64-bit words whose
    # outputs for nearby inputs look independent, so seeds that differ in one field give
    # unrelated generator streams.
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _shard_generator(param: DTensor, generator: torch.Generator) -> torch.Generator:
    """A generator for this rank's shard of the DTensor ``param``, seeded from ``generator``.

    Every rank draws one leaf seed from the shared step stream (the same on every rank:
    all ranks seed it alike and draw once per DTensor leaf, whatever their shard sizes),
    then folds in its coordinate along the mesh dimensions where ``param`` is split, so
    shards get independent noise while replicas of a replicated piece get the same noise
    and stay identical. No host sync: on the CPU the seed is a host draw; on CUDA
    (Philox) it is the generator's seed and offset, and the offset is advanced by one
    block. Other devices draw the seed on the device and read it (one sync per leaf).
    """
    offset = None
    if generator.device.type != "cpu":
        try:
            offset = generator.get_offset()
        except RuntimeError:  # a generator without Philox offsets
            offset = None
    if offset is None:
        base = int(torch.randint(0, 1 << 62, (), dtype=torch.int64, generator=generator,
                                 device=generator.device))
    else:
        base = _splitmix64(generator.initial_seed() & _MASK64) ^ offset
        generator.set_offset(offset + 4)  # Philox offsets move in blocks of 4
    coordinate = tuple(param.device_mesh.get_coordinate() or ())
    seed = _splitmix64(base)
    for c, placement in zip(coordinate, param.placements, strict=False):
        seed = _splitmix64(seed ^ (0 if placement.is_replicate() else c + 1))
    out = torch.Generator(device=generator.device)
    out.manual_seed(seed)
    return out


def stochastic_rounding() -> MasterWeights:
    r"""No master copy: round each new float32 value to the param's dtype stochastically.

    The update rule sees ``param.float()``; the new value $x$ (float32) becomes the lower
    representable neighbour $\lfloor x \rfloor$ or the upper one $\lceil x \rceil$ with

    $$
    P(\lceil x \rceil) = \frac{x - \lfloor x \rfloor}{\lceil x \rceil - \lfloor x \rfloor},
    $$

    so $\mathbb{E}[\text{param}] = x$: updates far below half a unit in the last place
    still move the param on average, where round-to-nearest drops them every time. It
    stores nothing (2 bytes per bfloat16 param instead of 6 with
    [`float32_master`][functopt.precision.float32_master]); the price is rounding noise of
    up to one unit in the last place per step.

    For bfloat16, 16 uniform random bits are added below the bfloat16 part of the float32
    bit pattern, which is then truncated: exactly the rule above for every float32 value.
    For float16, the fraction of $|x|$ over float16's spacing is compared with a uniform
    float64 draw (53 random bits): exactly the rule above for $|x| \ge 2^{-54}$, and below
    that $P(\lceil x \rceil)$ is the fraction rounded up to a multiple of $2^{-53}$ (a bias
    under $2^{-77}$). Representable values, $\pm 0$, $\pm\infty$ and nan pass through
    unchanged. Values beyond the largest finite number ``M`` round as if the next number
    were ``M`` plus one spacing and were infinity: ``M`` itself stays ``M``, values between
    ``M`` and ``M + spacing`` become $\pm\infty$ with probability proportional to their
    distance from ``M``, and larger ones $\pm\infty$ (round-to-nearest already overflows at
    ``M + spacing/2``). Params of float32 or wider are written as they are.

    The random bits come from the ``generator`` that
    [`mixed_precision`][functopt.precision.mixed_precision] passes to ``write``, seeded
    from its state's step key, so a step is reproducible and a skipped step draws nothing
    that persists.

    DTensor params (FSDP2): each rank rounds the local shard it holds and the result is a
    DTensor with the param's mesh, placements and global shape (no communication). Each
    DTensor leaf draws one seed from ``generator`` and folds in the rank's coordinate
    along the mesh dimensions where the param is split, so shards on different ranks get
    independent noise while replicated copies get the same noise and stay identical. A
    sharded step is therefore reproducible for a given mesh, but its noise is not that
    of an unsharded run (plain tensors draw straight from ``generator``, unchanged).

    Returns:
        A [`MasterWeights`][functopt.precision.MasterWeights] with ``needs_generator=True``.

    Examples:
        >>> import torch
        >>> from functopt.precision import stochastic_rounding
        >>> mw = stochastic_rounding()
        >>> p = torch.ones(10_000, dtype=torch.bfloat16)
        >>> g = torch.Generator().manual_seed(0)
        >>> new, store = mw.write(p, mw.init(p), mw.view(p, None) + 2 ** -10, g)
        >>> sorted(set(new.tolist()))  # the neighbours 1 and 1 + 2**-7
        [1.0, 1.0078125]
        >>> abs(new.double().mean().item() - (1 + 2 ** -10)) < 1e-4  # 1 + 2**-10 on average
        True

    References:
        Gupta et al., *Deep Learning with Limited Numerical Precision*, 2015.
        Zamirai et al., *Revisiting BFloat16 Training*, 2020.
    """

    def init(param: torch.Tensor) -> torch.Tensor | None:
        _check_rounding_dtype(param.dtype)
        return None

    def view(param: torch.Tensor, store: torch.Tensor | None) -> torch.Tensor:
        del store
        return param.float() if _narrow(param.dtype) else param

    def write(
        param: torch.Tensor, store: torch.Tensor | None, value: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del store
        if not _narrow(param.dtype):
            return value.to(param.dtype), None
        _check_rounding_dtype(param.dtype)
        if generator is None:
            raise ValueError(
                "stochastic_rounding: write() needs a torch.Generator to round a "
                f"{param.dtype} param, got None. Fix: pass torch.Generator().manual_seed(...) "
                "(mixed_precision passes one seeded from its state's key)."
            )
        round_ = _round_bfloat16 if param.dtype == torch.bfloat16 else _round_float16
        if is_dtensor(param):
            return _write_shard(param, value, generator, round_), None
        return round_(value.to(torch.float32), generator), None

    return MasterWeights(init, view, write, torch.float32, needs_generator=True)


def _write_shard(
    param: DTensor, value: torch.Tensor, generator: torch.Generator,
    round_: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
) -> torch.Tensor:
    """Round this rank's shard of ``value`` into a DTensor laid out like ``param``."""
    from torch.distributed.tensor import DTensor

    if not is_dtensor(value):
        raise TypeError(
            f"stochastic_rounding: the param is a DTensor but the new value is "
            f"{type(value).__name__}; expected a DTensor with the param's mesh. Fix: pass "
            f"DTensor values for DTensor params (mixed_precision does)."
        )
    if value.device_mesh != param.device_mesh or value.placements != param.placements:
        value = value.redistribute(param.device_mesh, param.placements)
    local = round_(value.to_local().to(torch.float32), _shard_generator(param, generator))
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def kahan_summation() -> MasterWeights:
    r"""A compensation buffer in the param's dtype carries what rounding the param dropped.

    Each low-precision param $p$ gets a buffer $c$ of its own dtype. The update rule sees
    $p + c$ (in float32); the new float32 value $x$ is written as

    $$
    p' = \operatorname{rn}(x), \qquad c' = \operatorname{rn}(x - p'),
    $$

    with $\operatorname{rn}$ round-to-nearest into the param's dtype ($x - p'$ is exact in
    float32). So $p + c$ is an unevaluated sum of two low-precision words: $|c| \le$ half
    a unit in the last place of $p$, and $p + c$ is within half a unit in the last place of
    $c$ of $x$, about $2t$ significant bits where the dtype has $t$ (bfloat16: $t = 8$,
    about 16 bits; float16: $t = 11$, about 22 bits; float32 has 24). Updates below half
    a unit in the last place of $p$ accumulate in $c$ until they move $p$. It costs one
    extra low-precision word per param (4 bytes per bfloat16 param instead of 6 with
    [`float32_master`][functopt.precision.float32_master]) and no random numbers.

    Failure modes:

    - An update smaller than about half a unit in the last place of $c$ (a relative
      $2^{-2t}$ of $p$) is lost, as round-to-nearest loses it on $p$ alone: the pair
      stagnates one level lower than a bare param, not never.
    - float16's exponent range is narrow: where $|p| < 2^{-3}$ the compensation is
      subnormal, with a fixed spacing of $2^{-24}$, so the pair holds fewer bits;
      bfloat16 shares float32's range and has no such loss.
    - A value beyond the dtype's largest finite number makes $p'$ infinite; $c'$ is then
      set to 0 (rather than $x - \infty$), so the param reads $\pm\infty$, not nan.
    - The buffer belongs to the current param values: after loading or editing params
      outside the step, re-run ``init`` (a stale $c$ shifts the value by up to half a unit
      in the last place).

    Params of float32 or wider get no buffer and are written as they are.

    Returns:
        A [`MasterWeights`][functopt.precision.MasterWeights].

    Examples:
        >>> import torch
        >>> from functopt.precision import kahan_summation
        >>> mw = kahan_summation()
        >>> p = torch.tensor([1.0], dtype=torch.bfloat16)
        >>> c = mw.init(p)
        >>> for _ in range(3):  # each step adds 1/1000, far below bfloat16's 1/128 spacing
        ...     p, c = mw.write(p, c, mw.view(p, c) + 1e-3, None)
        >>> p, c
        (tensor([1.], dtype=torch.bfloat16), tensor([0.0030], dtype=torch.bfloat16))

    References:
        Kahan, *Further remarks on reducing truncation errors*, 1965.
        Zamirai et al., *Revisiting BFloat16 Training*, 2020.
    """

    def init(param: torch.Tensor) -> torch.Tensor | None:
        return torch.zeros_like(param.detach()) if _narrow(param.dtype) else None

    def view(param: torch.Tensor, store: torch.Tensor | None) -> torch.Tensor:
        if store is None:
            return param
        return param.float() + store.float()

    def write(
        param: torch.Tensor, store: torch.Tensor | None, value: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del generator
        if store is None:
            return value.to(param.dtype), None
        x = value.to(torch.float32)
        new_param = x.to(param.dtype)
        residual = x - new_param.float()
        # Past the dtype's range new_param is inf and x - inf is -inf: keep c finite (0) so
        # the pair reads inf like a bare param would, not inf - inf = nan.
        residual = torch.where(torch.isfinite(new_param), residual, torch.zeros_like(residual))
        return new_param, residual.to(param.dtype)

    return MasterWeights(init, view, write, torch.float32, needs_generator=False)
