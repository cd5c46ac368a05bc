"""On a CUDA device (skipped elsewhere): a GPT step under bf16 autocast follows the fp32 step on
the CPU, and the count sketch encodes and decodes bit for bit as on the CPU."""

import copy

import pytest
import torch
import torch.nn.functional as F

from interlace.compress import sketch
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model

pytestmark = pytest.mark.cuda

CONFIG = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4)

# bf16 keeps 8 significant bits (rounding ≤ 2^-9 ≈ 0.2 % per value) and the error grows through
# the layers. With CPU bf16 autocast this model's loss is off by ≈ 0.002 % and its gradient by
# ≈ 0.5 %; the bounds leave room for CUDA's kernels.
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2


def _step(model: torch.nn.Module, idx: torch.Tensor, bf16: bool) -> tuple[float, torch.Tensor]:
    """Loss of one forward pass and the gradient of every parameter as one fp32 CPU vector."""
    idx = idx.to(next(model.parameters()).device)
    with torch.autocast(idx.device.type, torch.bfloat16, enabled=bf16):
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    grads = [p.grad.float().flatten().cpu() for p in model.parameters()]
    return loss.item(), torch.cat(grads)


def test_gpt_step_in_bf16_on_cuda_follows_fp32_on_the_cpu():
    torch.manual_seed(0)
    cpu = build_model(CONFIG)
    cuda = copy.deepcopy(cpu).cuda()
    idx = torch.randint(CONFIG.vocab_size, (4, CONFIG.seq_len + 1))
    loss, grad = _step(cpu, idx, bf16=False)
    cuda_loss, cuda_grad = _step(cuda, idx, bf16=True)
    assert cuda_loss == pytest.approx(loss, rel=LOSS_RTOL)
    assert (cuda_grad - grad).norm() <= GRAD_RTOL * grad.norm()


def _sketch_round_trip(device: str) -> dict[str, torch.Tensor]:
    """Hashes, table and every decoding of 2000 integer-valued entries (sums exact in fp32, so
    the order of CUDA's atomic adds cannot change them), moved to the CPU."""
    gen = torch.Generator().manual_seed(0)
    n = 2000
    positions = torch.randperm(100_000, generator=gen)[:n].sort().values.to(device)
    values = torch.randint(-100, 101, (n,), generator=gen).float().to(device)
    out = {}
    for method in sketch.DECODE_METHODS:
        cols = sketch.sketch_columns(n, sketch.DEFAULT_WIDTH[method])
        hashes = sketch.CountSketch.from_seed(7, rows=3, cols=cols, device=device)
        columns, signs = hashes.columns(positions), hashes.signs(positions, values.dtype)
        table = sketch.encode(values, columns, signs, cols)
        decoder = sketch.Decoder(method, columns, signs, cols)
        out |= {
            f"{method} columns": columns,
            f"{method} signs": signs,
            f"{method} table": table,
            f"{method} exact": decoder.exact,
            f"{method} decoded": decoder(table),
        }
    return {key: tensor.cpu() for key, tensor in out.items()}


def test_count_sketch_on_cuda_equals_the_cpu():
    cpu, cuda = _sketch_round_trip("cpu"), _sketch_round_trip("cuda")
    for key, expected in cpu.items():
        assert torch.equal(cuda[key], expected), key
