"""Test set-up: one intra-op thread before any compute, so forked ranks start fast and safe."""

import torch

torch.set_num_threads(1)

# DDP imports torch._dynamo lazily; importing it once here spares every forked rank the cost.
import torch._dynamo  # noqa: E402
