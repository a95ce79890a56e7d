"""The public entry points of weight versions, one import for publishers and readers.

Publishing lives in :mod:`shipyard.weights.publisher` (snapshot every K versions, deltas
between, manifest last, LATEST after), reading in :mod:`shipyard.weights.versions` (cheapest
verified path, digests checked). Example::

    pub = WeightPublisher(store, snapshot_every=10)
    pub.publish(3, named_params(model))
    tensors = load_version(store, latest_version(store))   # verified dict name -> tensor
"""

from __future__ import annotations

from shipyard.weights.publisher import WeightPublisher, named_params
from shipyard.weights.versions import latest_version, load_version, published_versions, read_manifest

__all__ = [
    "WeightPublisher",
    "latest_version",
    "load_version",
    "named_params",
    "published_versions",
    "read_manifest",
]
