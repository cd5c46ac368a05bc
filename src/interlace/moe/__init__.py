"""Mixture-of-Experts on one device: top-k routing (`gating`) and the MoE FFN layer (`layer`).

The experts reuse the dense model's MLP (`interlace.models.mlp`) and the GPT in
`interlace.models` builds MoE layers, so the two packages import each other; loading
`interlace.models` first fixes one import order whichever package a user imports first.
"""

import interlace.models  # noqa: F401  (import order, see above)
from interlace.moe.gating import Routing, TopKRouter
from interlace.moe.layer import MoELayer

__all__ = ["MoELayer", "Routing", "TopKRouter"]
