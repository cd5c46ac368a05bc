"""1D tensor parallelism (Megatron-style): column → row inside every block, vocab-parallel ends.

With p ranks in the tensor parallel group and rank r:

- **Column-parallel** (q, k, v; up and gate): W = [W_1; …; W_p] split along the output features,
  y_r = x·W_rᵀ + b_r. Rank r keeps heads [r·h/p, (r+1)·h/p) (GPT-2's fused q|k|v is split per
  part: [q_r | k_r | v_r]). With grouped-query attention and fewer kv heads than ranks, each kv
  head is held by p/h_kv consecutive ranks and its gradient summed among them. The layer is
  the same module, narrower: sharded in place; head-count attributes follow (`num_heads`,
  `split_size`, `num_key_value_groups`, ...).
- **Row-parallel** (out projection; down): W = [W_1, …, W_p] split along the input features,
  y = Σ_r x_r·W_rᵀ + b: `RowParallelLinear` all-reduces the partial sums, then adds b once.
- Entering a block, the input passes `copy_to_tp` (its gradient all-reduced): one all-reduce per
  block forward (row output) and one backward (block input).
- **Vocab-parallel embedding**: rank r holds rows [r·V/p, (r+1)·V/p); other ids look up zeros;
  the sum over ranks is all-reduced. The LM head holds the same rows (tied weights stay one
  Parameter) and gives this rank's logits [..., V/p].
- **Loss**: the model returns this rank's logits [B, T, V/p] and the loop scores them with
  `vocab_parallel_cross_entropy`, which all-reduces only row maxima and two sums. With
  `gather_logits` the head all-gathers full logits [..., V] instead (one all-gather of B·T·V/p
  elements per rank), for a Hugging Face model's own `labels` loss or `generate`.
- **Sequence parallel** (`sequence_parallel=True`): between blocks the residual stream is split
  along the sequence, [B, T/p, d], and LayerNorms run on shards. A block's entry all-gathers the
  sequence (backward reduce-scatter) and its row-parallel exit reduce-scatters (backward
  all-gather): the same bytes as the all-reduce, activations p times smaller. The first layer
  takes its shard of the embedding output; the final norm all-gathers before the head.
  Replicated parameters inside the sharded region (norms, row biases) see only their tokens, so
  their gradients are all-reduced over the group by a hook.

Written by hand rather than with DTensor's `parallelize_module`: every collective must pass the
comm meter (`interlace.comm`), HF's `Conv1D` stores [in, out] and GPT-2 fuses q|k|v (neither is
expressible with `ColwiseParallel`), GQA with fewer kv heads than ranks needs replication, and the
sharded cross-entropy must never gather logits.

The package's modules, each one idea: `options` (the plan's rules, torch-free), `comm` (the
collectives as autograd functions), `shard`
(ShardSpec: which piece a rank holds), `layers` (row-parallel linear, vocab-parallel embedding,
head and cross-entropy, block entry), `moe` (fused-expert MoE blocks split along every expert's
width; other MoE layers stay replicated), `apply` (`apply_tensor_parallel`, `check_divisible`),
`overlap` and `interleave` (`tp_subbatches`: sub-batches taking turns at each all-reduce).

All ranks of the group must hold the same full model before `apply_tensor_parallel` (build
it with the same seed); ranks must also share dropout seeds for the replicated regions.
"""
