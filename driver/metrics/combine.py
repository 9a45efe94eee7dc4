"""Step metrics that combine exactly across micro-batches, iterations and ranks: token means
weighted by their tokens, minima (*/min, *_min) and maxima (*/max, *_max) as the min and max, so a
step reports the same values whatever its split (the losses produce them, the update and torchrun's
ranks combine them)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

MINIMUM_SUFFIXES, MAXIMUM_SUFFIXES = ("/min", "_min"), ("/max", "_max")  # TRL: .../min, clip_ratio/low_min


@dataclass
class Metrics:
    """What one part of a step measured (a micro-batch, an iteration, a rank), kept combinable: values
    whose key ends in /min or _min (/max, _max) are minima (maxima), NaN when there was nothing to
    measure; counts[key] is the number of tokens or sequences the mean values[key] is taken over; a value
    without a count (loss, grad_norm) weighs once per part."""

    values: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, key: str) -> float:
        return self.values[key]

    def update(self, other: Metrics) -> Metrics:
        self.values.update(other.values)
        self.counts.update(other.counts)
        return self


def combine_metrics(parts: Iterable[Metrics], summed: tuple[str, ...] = ()) -> Metrics:
    """One Metrics from those of several parts, by each key's meaning: the sum for `summed` keys, the min
    of minima and the max of maxima over the parts that measured one, the count-weighted mean of a mean
    with counts (NaN when no part counted anything), the plain mean of any other value over the parts
    that have the key."""
    parts = list(parts)
    out = Metrics()
    for key in dict.fromkeys(key for part in parts for key in part.values):
        having = [part for part in parts if key in part.values]
        counted = [key in part.counts for part in having]
        if any(counted) and not all(counted):
            raise ValueError(f"metric {key!r} has a count in some parts and not in others; a mean must say what "
                             "it averages over in every part, or in none")
        values = [part.values[key] for part in having]
        if key in summed:
            out.values[key] = sum(values)
        elif key.endswith(MINIMUM_SUFFIXES + MAXIMUM_SUFFIXES):
            measured = [value for value in values if not math.isnan(value)]
            out.values[key] = (min if key.endswith(MINIMUM_SUFFIXES) else max)(measured) if measured else math.nan
        elif all(counted):
            weighted = [(part.values[key], part.counts[key]) for part in having if part.counts[key] > 0]
            total = sum(count for _, count in weighted)
            out.values[key] = sum(value * count for value, count in weighted) / total if total else math.nan
            out.counts[key] = total
        else:
            out.values[key] = sum(values) / len(values)
    return out
