"""Mixture-of-Experts on one device: top-k routing (`gating`), the experts held stacked
(`experts`) and computed in one grouped call (`grouped`), and the MoE FFN layer (`layer`).
"""

from interlace.moe.experts import GroupedExperts
from interlace.moe.gating import Routing, TopKRouter
from interlace.moe.layer import MoELayer

__all__ = ["GroupedExperts", "MoELayer", "Routing", "TopKRouter"]
