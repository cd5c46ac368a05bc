"""Test set-up: one intra-op thread before any compute, so forked ranks start fast and safe."""

import torch

torch.set_num_threads(1)
