"""Count-sketch reducer math, and the sketch all-reduce against the dense mean on 2 ranks."""

import math

import pytest
import torch
import torch.distributed as dist

from interlace import comm
from interlace.compress import sketch, sketch_allreduce
from interlace.testing import run_ranks


def _sparse_values(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randperm(d, generator=gen)[:n].sort().values
    return positions, torch.randn(n, generator=gen)


@pytest.mark.parametrize("numel", [1, 7, 8, 13, 1000])
def test_packed_bits_give_back_the_set_positions(numel):
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.3
    packed = sketch.pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8)
    assert torch.equal(sketch.packed_positions(packed), mask.nonzero().squeeze(1))


def test_hashes_are_shared_by_seed_and_in_range():
    positions = torch.arange(10_000)
    a = sketch.CountSketch.from_seed(5, rows=3, cols=17)
    b = sketch.CountSketch.from_seed(5, rows=3, cols=17)
    columns, signs = a.columns(positions), a.signs(positions, torch.float32)
    assert torch.equal(columns, b.columns(positions))
    assert columns.shape == (3, 10_000) and columns.min() >= 0 and columns.max() < 17
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert abs(signs.mean().item()) < 0.05  # balanced signs
    counts = torch.bincount(columns[0], minlength=17).float()
    assert counts.min() > 0.8 * counts.mean()  # columns evenly filled
    other = sketch.CountSketch.from_seed(6, rows=3, cols=17)
    assert not torch.equal(columns, other.columns(positions))


def test_median_is_exact_where_each_entry_is_alone_in_most_rows():
    positions, values = _sparse_values(40, 5000, seed=0)
    cols = sketch.sketch_columns(40, width_factor=50.0)
    hashes = sketch.CountSketch.from_seed(1, rows=3, cols=cols)
    columns, signs = hashes.columns(positions), hashes.signs(positions, torch.float32)
    assert (sketch.sole_rows(columns, cols) >= 2).all()  # a majority of clean rows
    table = sketch.encode(values, columns, signs, cols)
    decoder = sketch.Decoder("median", columns, signs, cols)
    assert decoder.exact.all()
    assert torch.equal(decoder(table), values)


def test_peeling_recovers_every_entry_of_a_narrow_sketch():
    positions, values = _sparse_values(2000, 100_000, seed=1)
    cols = sketch.sketch_columns(2000, sketch.DEFAULT_WIDTH["peel"])
    hashes = sketch.CountSketch.from_seed(2, rows=3, cols=cols)
    columns, signs = hashes.columns(positions), hashes.signs(positions, torch.float32)
    table = sketch.encode(values, columns, signs, cols)
    median = sketch.Decoder("median", columns, signs, cols)
    assert median.exact.float().mean() < 0.5  # the median is lossy at this width
    assert not torch.allclose(median(table)[~median.exact], values[~median.exact], atol=1e-3)
    peel = sketch.Decoder("peel", columns, signs, cols)
    assert peel.exact.all()
    torch.testing.assert_close(peel(table), values, atol=1e-5, rtol=0)


def test_peeling_falls_back_to_the_median_on_a_cycle():
    # entries 0 and 1 share both cells of a 2-row sketch: no cell ever isolates either
    columns = torch.tensor([[0, 0, 1], [2, 2, 3]])
    signs = torch.ones(2, 3)
    values = torch.tensor([1.0, 2.0, 5.0])
    decoder = sketch.Decoder("peel", columns, signs, cols=4)
    assert decoder.exact.tolist() == [False, False, True]
    decoded = decoder(sketch.encode(values, columns, signs, 4))
    assert decoded.tolist() == [3.0, 3.0, 5.0]  # the colliding pair reads its cell's sum


def test_median_error_stays_within_the_count_sketch_bound():
    """|ĝ_i − g_i| ≤ ε‖g‖₂ with ε = sqrt(e/c) fails for a fraction ≤ δ(r) of coordinates.

    One row fails with probability ≤ 1/e (Chebyshev, E[X²] ≤ ‖g‖²/c); the median of r
    independent rows fails only if ⌈r/2⌉ rows do. Checked over 25 draws × 400 coordinates.
    """
    rows, cols, n = 5, 64, 400
    q = 1 / math.e
    delta = sum(math.comb(rows, k) * q**k * (1 - q) ** (rows - k) for k in range(3, rows + 1))
    eps = math.sqrt(math.e / cols)
    failures, inexact = 0, 0
    for trial in range(25):
        positions, values = _sparse_values(n, 50_000, seed=100 + trial)
        hashes = sketch.CountSketch.from_seed(trial, rows, cols)
        columns, signs = hashes.columns(positions), hashes.signs(positions, torch.float32)
        estimate = sketch.decode_median(sketch.encode(values, columns, signs, cols), columns, signs)
        error = (estimate - values).abs()
        failures += int((error > eps * values.norm()).sum())
        inexact += int((error > 1e-5).sum())
    assert failures / (25 * n) <= delta  # δ(5) ≈ 0.26
    assert inexact / (25 * n) > 0.5  # the sketch is far too narrow to be exact: a real test


def _reduce_on_two_ranks(union: str) -> dict:
    rank = dist.get_rank()
    group = comm.Group("dp", dist.group.WORLD, 2, rank)
    d = 20_000
    grads = []
    for r in range(2):  # both ranks' gradients, to know the dense mean and the union here
        gen = torch.Generator().manual_seed(r)
        grads.append(
            torch.where(torch.rand(d, generator=gen) < 0.002, torch.randn(d, generator=gen), 0.0)
        )
    mean = (grads[0] + grads[1]) / 2
    union_positions = ((grads[0] != 0) | (grads[1] != 0)).nonzero().squeeze(1)
    cols = sketch.sketch_columns(union_positions.numel(), 50.0)
    meter = comm.meter
    meter.reset()
    median = sketch_allreduce(grads[rank].clone(), group, 3, 50.0, 7, union, "median")
    peel = sketch_allreduce(grads[rank].clone(), group, 3, 0.8, 8, union, "peel", residual=True)
    lossy = sketch_allreduce(grads[rank].clone(), group, 3, 1.0, 9, union, "median", residual=True)
    dense = sketch_allreduce(torch.randn(d), group, 3, 0.8, 9, union)
    empty = sketch_allreduce(torch.zeros(d), group, union=union)
    hashes = sketch.CountSketch.from_seed(7, 3, cols)
    return {
        "mean": mean,
        "union": union_positions,
        "median": median.future.wait(),
        "median_sole": sketch.sole_rows(hashes.columns(union_positions), cols),
        "peel": peel.future.wait(),
        "paths": [x.path for x in (median, peel, lossy, dense, empty)],
        "dense_ok": dense.future.wait().shape == (d,),
        "empty": empty.future.wait(),
        "bytes": [median.bytes_sent, peel.bytes_sent, lossy.bytes_sent],
        "peel_residual": peel.residual,
        "lossy": (lossy.future.wait(), lossy.residual, lossy.union_nnz - lossy.exact_nnz),
        "columns": median.columns,
        "metered": meter.snapshot()["dp"],
    }


@pytest.mark.parametrize("union", ["bor", "gather", "max"])
def test_sketch_allreduce_equals_the_dense_mean(union):
    r0, r1 = run_ranks(2, _reduce_on_two_ranks, union, timeout=30)
    assert r0["paths"] == ["sketch", "sketch", "sketch", "dense", "empty"]
    mean, outside = r0["mean"], torch.ones(20_000, dtype=torch.bool)
    outside[r0["union"]] = False
    assert (r0["median_sole"] >= 2).all()  # collision-free majority: the median is exact
    for result in (r0, r1):
        torch.testing.assert_close(result["median"], mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(result["peel"], mean, atol=1e-6, rtol=0)
        assert torch.equal(result["median"][outside], torch.zeros(int(outside.sum())))
        assert torch.equal(result["empty"], torch.zeros(20_000))
    assert torch.equal(r0["median"], r1["median"]) and torch.equal(r0["peel"], r1["peel"])
    assert r0["peel_residual"] is None  # every entry exact: nothing to feed back
    lossy, residual, inexact = r0["lossy"]
    assert inexact > 0 and 0 < int((residual != 0).sum()) <= inexact
    assert torch.equal(residual[outside], torch.zeros(int(outside.sum())))
    assert (lossy - mean).abs().max() > 1e-3
    bitmap = 20_000 if union == "max" else 2500
    assert r0["bytes"][0] == bitmap + 4 * 3 * r0["columns"]
    metered = sum(op["bytes"] for op in r0["metered"].values())
    dense_bytes = 20_000 * 4
    assert metered == sum(r0["bytes"]) + 2 * bitmap + dense_bytes  # + dense and empty calls
