"""Mixture-of-Experts on one device: top-k routing (`gating`) and the MoE FFN layer (`layer`).

The experts reuse the dense model's MLP (`interlace.models.mlp`).
"""

from interlace.moe.gating import Routing, TopKRouter
from interlace.moe.layer import MoELayer

__all__ = ["MoELayer", "Routing", "TopKRouter"]
