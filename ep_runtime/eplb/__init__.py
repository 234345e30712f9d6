"""Expert-parallel load balancing: redundant expert slots, the logical → physical map applied
before dispatch, per-slot load counts, and rebalancing from measured load (docs/eplb.md)."""

from ep_runtime.eplb.algorithm import balanced_packing, rebalanced_placement, replicate
from ep_runtime.eplb.balancer import ExpertBalancer, WeightSet
from ep_runtime.eplb.device_map import DeviceMap
from ep_runtime.eplb.moves import MovePlan, plan_moves
from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.eplb.stats import LoadStats, LoadSummary, RebalanceReport
from ep_runtime.eplb.synthetic import parse_zipf, zipf_popularity, zipf_routing

__all__ = [
    "DeviceMap",
    "ExpertBalancer",
    "LoadStats",
    "LoadSummary",
    "MovePlan",
    "PlacementMap",
    "RebalanceReport",
    "WeightSet",
    "balanced_packing",
    "parse_zipf",
    "plan_moves",
    "rebalanced_placement",
    "replicate",
    "zipf_popularity",
    "zipf_routing",
]
