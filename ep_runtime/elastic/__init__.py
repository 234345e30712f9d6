"""Elastic EP: layers that keep serving on the survivors after a rank is lost (docs/elastic.md)."""

from ep_runtime.elastic.group import ElasticGroup, RecoveryError
from ep_runtime.elastic.membership import CountedOutError
from ep_runtime.elastic.rehome import LostExpertsError, WeightSource
from ep_runtime.elastic.report import LayerRecovery, Recovery

__all__ = [
    "CountedOutError",
    "ElasticGroup",
    "LayerRecovery",
    "LostExpertsError",
    "Recovery",
    "RecoveryError",
    "WeightSource",
]
