"""Reading a service's `/metrics` in tests: one value per metric, summed over its label sets."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families


def metric_total(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of every sample called `name` (a counter's `_total`, a histogram's `_count`, ...) whose labels
    include `labels` (None: whatever its labels); 0 for a family exported with no such samples yet (a labelled
    counter nothing has touched). Raises AssertionError if no family declares it."""
    families = list(text_string_to_metric_families(text))
    wanted = dict(labels or {})
    samples = [s.value for family in families for s in family.samples
               if s.name == name and wanted.items() <= s.labels.items()]
    if samples:
        return float(sum(samples))
    if any(name in (family.name, family.name + "_total") for family in families):
        return 0.0
    raise AssertionError(f"{name} is not exported")


def scrape_total(http: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """`metric_total` of the `/metrics` page under the base URL `http`."""
    return metric_total(urllib.request.urlopen(http + "/metrics", timeout=5).read().decode(), name, labels)
