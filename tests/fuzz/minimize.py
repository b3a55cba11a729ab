"""Shrinking a failing fuzz case to a minimal one that fails the same check.

Greedy: try each one-step simplification of the spec (drop a site nothing reads, drop a
dependency, a mask, a scale, a factor, subsampling, the nested plate's extra elements, chain
steps; fewer particles), keep the first that still fails the same way, and repeat until none does.
"""

import copy
from collections.abc import Iterator
from typing import Callable, Optional

from .generator import Case, Spec, features_of
from .oracles import Check, check_case


def _signature(check: Check) -> tuple:
    """What makes two failures the same: the oracle, what was compared, the error type if any."""
    error = str(check.got).split(":")[0] if isinstance(check.got, str) else None
    return check.oracle, check.what.split(":")[0], error


def _failing_signatures(case: Case, oracles) -> set:
    try:
        checks = check_case(case, oracles)
    except Exception:  # noqa: BLE001  (a spec the simplification made invalid)
        return set()
    return {_signature(c) for c in checks if not c.ok and not c.refused}


def _readers(spec: Spec, name: str) -> bool:
    """Whether anything reads site ``name`` (a child, a factor, a non-factorised guide site)."""
    if any(name in s.parents for s in spec.sites):
        return True
    if any(parent == name for _, parent, _ in spec.factors):
        return True
    if spec.guide_factor is not None and spec.guide_factor[0] == name:
        return True
    return any(s.numbers.get("guide_parent") == name for s in spec.sites)


def _simplifications(spec: Spec) -> Iterator[Callable[[Spec], None]]:
    """One-step changes, each a function that edits a copy of the spec in place."""
    for i, site in enumerate(spec.sites):
        observed = [s for s in spec.sites if s.observed]
        if site.level == "chain" or _readers(spec, site.name):
            continue
        if site.observed and len(observed) == 1:
            continue
        yield lambda s, i=i: s.sites.pop(i)
    for i, site in enumerate(spec.sites):
        for p in site.parents:
            if p not in ("prev1",) and p != site.numbers.get("guide_parent"):
                yield lambda s, i=i, p=p: s.sites[i].parents.remove(p)
        if site.mask is not None:
            yield lambda s, i=i: setattr(s.sites[i], "mask", None)
        if site.treatment == "nonfact":
            yield lambda s, i=i: setattr(s.sites[i], "treatment", "guide")
        if site.learn:
            yield lambda s, i=i: setattr(s.sites[i], "learn", False)
        if "K" in site.numbers:
            yield lambda s, i=i: s.sites[i].numbers.pop("K")
    for field in ("plate_scale", "model_scale", "guide_factor", "irrelevant"):
        if getattr(spec, field) is not None:
            yield lambda s, field=field: setattr(s, field, None)
    if spec.factors:
        yield lambda s: setattr(s, "factors", [])
    for j, plate in enumerate(spec.plates):
        if plate.subsample is not None or plate.subsample_size is not None:
            yield lambda s, j=j: (
                setattr(s.plates[j], "subsample", None),
                setattr(s.plates[j], "subsample_size", None),
            )
        if plate.subsample is None and plate.subsample_size is None and plate.size > 1:
            yield lambda s, j=j: setattr(s.plates[j], "size", s.plates[j].size - 1)
    if spec.chain is not None and spec.chain.length > 1:
        yield lambda s: setattr(s.chain, "length", s.chain.length - 1)
    if spec.options["num_samples"] > 1:
        yield lambda s: s.options.__setitem__("num_samples", s.options["num_samples"] - 1)


def minimize(case: Case, check: Check, oracles: Optional[list[str]] = None, max_steps: int = 200) -> Case:
    """
    The smallest case (greedily) that still fails as ``check`` did.

    :param oracles: the oracles to run (default: the failed check's own).
    """
    oracles = oracles or [check.oracle if check.oracle in ("dtype", "readout") else check.oracle]
    target = _signature(check)
    current = case
    for _ in range(max_steps):
        for change in _simplifications(current.spec):
            spec = copy.deepcopy(current.spec)
            try:
                change(spec)
            except Exception:  # noqa: BLE001
                continue
            candidate = Case(spec)
            if target in _failing_signatures(candidate, oracles):
                current = candidate
                break
        else:
            break
    current.spec.features = sorted(features_of(current.spec))
    return current
