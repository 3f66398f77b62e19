"""Public value merging for personal groups (seed 004 §4.1.4).

If two values of a public attribute affect the sensitive attribute the same
way, an adversary can pool the personal groups that differ only in them and
reconstruct more accurately than each group allows. So such values are
merged before groups are formed: for every pair of values x, x′ of one
attribute, the χ² two-sample statistic for unequal totals (Numerical Recipes
chstwo, thesis Eq. 4.3)

    χ² = Σ_j (√(|O′|/|O|)·o_j − √(|O|/|O′|)·o′_j)² / (o_j + o′_j)

compares their sensitive-value counts; bins empty in both are skipped and the
degrees of freedom (m in the thesis) drop accordingly. Values the test cannot
tell apart at level α are joined by an edge, and the connected components of
each attribute's graph become its merged values (so merging is transitive).

A `ValueMap` is fitted on a reference table, saved as TOML, and loaded by the
batch tools and the stream. Published rows keep their original public values;
the map only decides which rows share a personal group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tomli_w

from service.core.schema import Attribute, SchemaError, read_toml
from service.core.table import Table


@dataclass(frozen=True)
class ValueMap:
    """Merged classes of public values, fitted against one sensitive attribute."""

    sensitive: str
    sensitive_domain: tuple[str, ...]
    alpha: float
    classes: Mapping[str, tuple[tuple[str, ...], ...]]

    def classes_of(self, name: str, domain: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """Merged class of every value in `domain` of column `name`, and each class's label.

        Values the map has not seen form classes of their own: they could not
        be tested, so they are not pooled with anything. A label lists the
        class's values joined by "|"; labels are never published.
        """
        members: list[list[str]] = [list(c) for c in self.classes.get(name, ())]
        class_of_value = {v: i for i, c in enumerate(members) for v in c}
        per_code = np.empty(len(domain), dtype=np.int64)
        for code, value in enumerate(domain):
            if value not in class_of_value:
                class_of_value[value] = len(members)
                members.append([value])
            per_code[code] = class_of_value[value]
        return per_code, ["|".join(c) for c in members]

    def class_counts(self) -> dict[str, tuple[int, int]]:
        """(values, merged values) per attribute."""
        return {name: (sum(map(len, c)), len(c)) for name, c in self.classes.items()}

    def to_toml(self) -> str:
        return tomli_w.dumps(
            {
                "merge": {
                    "sensitive": self.sensitive,
                    "sensitive_domain": list(self.sensitive_domain),
                    "alpha": self.alpha,
                    "classes": {n: [list(c) for c in cs] for n, cs in self.classes.items()},
                }
            }
        )

    @classmethod
    def identity(cls, sensitive: Attribute) -> ValueMap:
        """No merging: every public value is a class of its own (alpha 0: nothing tested)."""
        return cls(sensitive.name, sensitive.domain, 0.0, {})

    @classmethod
    def load(cls, path: str | Path) -> ValueMap:
        path = Path(path)
        merge = read_toml(path).get("merge")
        if not isinstance(merge, Mapping):
            raise SchemaError(f"{path}: no [merge] table (write one with `splu merge`)")
        try:
            classes = {
                str(name): tuple(tuple(str(v) for v in members) for members in groups)
                for name, groups in merge["classes"].items()
            }
            value_map = cls(
                sensitive=str(merge["sensitive"]),
                sensitive_domain=tuple(str(v) for v in merge["sensitive_domain"]),
                alpha=float(merge["alpha"]),
                classes=classes,
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise SchemaError(f"{path}: [merge] is missing or mangles {err}") from None
        for name, groups in classes.items():
            members = [v for g in groups for v in g]
            if len(set(members)) != len(members):
                raise SchemaError(f"{path}: merge.classes.{name} lists a value twice")
        return value_map


def chi_square_statistics(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 4.3 for every pair of rows of `counts` (values × sensitive values).

    Returns (statistic, degrees of freedom), each (V, V); a pair with an
    empty value has 0 degrees of freedom.
    """
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt(totals[None, :] / totals[:, None])  # √(|O′|/|O|) for pair (O, O′)
        left = ratio[:, :, None] * counts[:, None, :]
        right = counts[None, :, :] / ratio[:, :, None]
        pooled = counts[:, None, :] + counts[None, :, :]
        terms = np.where(pooled > 0, (left - right) ** 2 / pooled, 0.0)
    nonempty = (totals[:, None] > 0) & (totals[None, :] > 0)
    degrees = np.where(nonempty, (pooled > 0).sum(axis=2), 0)
    return np.where(nonempty, terms.sum(axis=2), np.inf), degrees


def merged_classes(
    values: Sequence[str], counts: np.ndarray, alpha: float
) -> list[tuple[str, ...]]:
    """Connected components of "the χ² test cannot tell these two values apart"."""
    statistic, degrees = chi_square_statistics(counts)
    from scipy import stats

    critical = np.where(degrees > 0, stats.chi2.isf(alpha, np.maximum(degrees, 1)), -np.inf)
    similar = statistic <= critical
    parent = list(range(len(values)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, k in zip(*np.nonzero(np.triu(similar, k=1)), strict=True):
        parent[root(int(i))] = root(int(k))
    components: dict[int, list[str]] = {}
    for i, value in enumerate(values):
        components.setdefault(root(i), []).append(value)
    return sorted((tuple(sorted(c)) for c in components.values()), key=lambda c: c[0])


def fit_value_map(table: Table, sensitive: str, alpha: float = 0.05) -> ValueMap:
    """Merge each public attribute's values against `sensitive` on a reference table."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    target = table.schema[sensitive]
    if not target.sensitive:
        raise SchemaError(f"{sensitive!r} is not a sensitive attribute")
    classes = {}
    for attribute in table.schema.public:
        joint = attribute.size * table.codes[sensitive] + table.codes[attribute.name]
        counts = np.bincount(joint, minlength=attribute.size * target.size)
        counts = counts.reshape(target.size, attribute.size).T
        present = counts.sum(axis=1) > 0
        observed = [v for v, keep in zip(attribute.domain, present, strict=True) if keep]
        classes[attribute.name] = tuple(merged_classes(observed, counts[present], alpha))
    return ValueMap(sensitive, target.domain, alpha, classes)
