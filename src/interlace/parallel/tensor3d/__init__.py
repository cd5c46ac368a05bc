"""3D tensor parallelism (AxoNN-style): every linear layer of a block split over an x·y·z grid.

Ranks form a grid of groups "tp_x", "tp_y", "tp_z" (x fastest). The layout, per rank (X, Y, Z
its indices):

- **Tokens** are split over Z: the loop feeds the model rows [Z·B/z, (Z+1)·B/z) of every batch
  (`z_rows`), and the loss is the mean over Z of the slices' mean losses (`comm.mean_over`):
  the serial mean when every slice counts as many tokens (no uneven padding).
- **Residual stream** between blocks: [B/z, T, d/x], hidden features [X·d/x, (X+1)·d/x),
  replicated over Y. The first block splits the embedding output over X (backward all-gather);
  the final norm's input is all-gathered over X (backward slice) for the final norm and head.
  Both hooks are placed by structure (`detect`: the layer list and the final norm).
- **Normal layer** (q, k, v; up and gate), W [out, in]: `in` split over X, `out` over Y, the
  [out/y, in/x] block cut over Z by rows → `Linear3D` weight [out/(y·z), in/x]. Its output
  [.., out/y] (this rank's heads or ffn features) is replicated over X. HF's `Conv1D` (stored
  [in, out]) is held transposed, in this [out, in] layout. A fused q|k|v (GPT-2's `c_attn`) is
  split per part: the Y block is [q_Y; k_Y; v_Y]. With grouped-query attention, k and v split
  their kv heads over Y; with fewer kv heads than y, each is held by y/h_kv consecutive Y ranks
  and its block gradient summed over them before the Z reduce-scatter. Rotary embeddings act
  per head, so local heads need nothing; head-count attributes follow (as in 1D).
- **Transposed layer** (out projection; down): X and Y swapped: `in` over Y, `out` over X,
  weight [out/(x·z), in/y]; its output [.., d/x] is the residual layout again: no re-layout.
- **Collectives** per linear layer (`comm.linear3d`): forward all-gather of W over Z and
  all-reduce of O over its `in` group; backward all-gather over Z, async all-reduce of dX over its
  `out` group (hidden behind the dW matmul) and async reduce-scatter of dW over Z. With tokens per
  rank T and b bytes per element, a normal layer H → K·H puts on the wire
  X: 2(x−1)/x·T·(K·H/y)·b, Y: 2(y−1)/y·T·(H/x)·b, Z: 3(z−1)/z·(K·H²/(x·y))·b
  (`layer_wire_bytes`); a transposed one swaps X and Y. With z > 1 each Z all-gather is issued
  one layer ahead, asynchronously, while the layer before computes (`prefetch`; on
  unless `apply_tensor3d(..., prefetch=False)`, the plan's `tp3d_prefetch`): same bytes.
- **LayerNorms** inside blocks (`LayerNorm3D`) hold their [d/x] slice and all-reduce the row
  statistics Σx, Σx² [.., 2] over X (forward and backward): 2·2(x−1)/x·T·2·b per norm per step
  beyond the formula. RMS norms (`RMSNorm3D`: recognised by a [d] weight, an `eps` attribute
  and their output on a probe, on the meta device with a random weight in place of theirs)
  all-reduce Σx² [.., 1] the same way. The final norm, embeddings and LM head stay replicated
  (full [.., d] after the gather); their cost is the gather above and V·d replicated weights
  per rank.
- **Sequence parallelism** (`sequence_parallel`, y > 1): the residual stream between blocks is
  also split along the sequence over Y, [B/z, T/y, d/x]. Each attention and feed-forward block
  all-gathers the sequence over Y on entry (backward: reduce-scatter, the normal layers' dX sum
  over Y), each transposed layer reduce-scatters its output along T over Y in place of its
  all-reduce (`Linear3D.sequence`); the parameters replicated over Y inside the layers have
  their gradients all-reduced over Y.
- **Biases** of a normal layer [out/y] are replicated over X and Z, of a transposed one [out/x]
  over Y and Z. Every parameter except the 3D weights sees only its Z slice of the tokens: its
  gradient is all-reduced over Z by a hook. Data parallelism then all-reduces every gradient
  over "dp" (the 3D weights were already reduce-scattered over Z).

`Shard3D` records which grid axes split a parameter, for checkpoint keys, the gradient norm,
the runs of the full tensor a piece is read from (`shard3d_runs`: a model split on the meta
device, `interlace.parallel.pieces`) and tests. Dense decoders found by structure are supported
(the built-in GPT, HF GPT-2 and Llama); Mixture-of-Experts layers (the built-in ones, and HF
blocks with fused experts) stay whole under expert parallelism (`keep_whole`) and are refused
without it, as are parameterised modules in the layers that are neither blocks nor norms.

Modules: `comm` (the collectives as autograd functions), `shard` (the grid, `Shard3D`, the runs
a piece holds, checkpoint keys and the gradient norm of 3D pieces), `layers` (`Linear3D`,
`LayerNorm3D`, `RMSNorm3D`), `prefetch` (the next layer's weight gathered ahead), `shared`
(one gathered block per linear for a layer's overlapped sub-batches), `apply`
(`apply_tensor3d`, `check_tensor3d`).
"""
