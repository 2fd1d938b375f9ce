"""Medians, per-round ratios and formatting.

The machine is shared and noisy (±20–30% from round to round), so every comparison is a ratio
taken within one round, and what is reported is the median of those ratios over rounds.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

Number = Optional[float]


def median(values: Iterable[Number]) -> Number:
    """The median of the values that are not None; None if there are none."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def fmt(value: Number, spec: str = ".0f") -> str:
    """VALUE formatted with SPEC, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def ratios(num: Sequence[Number], den: Sequence[Number]) -> list[Number]:
    """One ratio per round (None where either side is missing)."""
    return [None if a is None or not b else a / b for a, b in zip(num, den)]


def fmt_ratio(num: Sequence[Number], den: Sequence[Number], sep: str = ", ") -> str:
    """ "0.72× (per round: 0.70, 0.72, 0.75)" """
    per = ratios(num, den)
    return f"{fmt(median(per), '.2f')}× (per round: {sep.join(fmt(r, '.2f') for r in per)})"


def order_of(round_no: int, targets: Sequence[str]) -> list[str]:
    """The targets of round ROUND_NO (from 1), so that no target is always first (cold) or
    always next to the same neighbour: rotated by one each round, reversed every other round.
    Two targets simply swap places every round (rotating and reversing would cancel out)."""
    n = len(targets)
    if n == 2:
        return list(targets) if round_no % 2 else [targets[1], targets[0]]
    order = [targets[(i + round_no - 1) % n] for i in range(n)]
    return order[::-1] if round_no % 2 == 0 else order
