"""Data parallelism (`plan.dp`, mesh group "dp"): every rank holds the whole (already split)
model and its own rows of the batch; gradients are averaged over the group. `apply` wraps the
module in torch's DDP (buckets all-reduced during backward, through a metered or compressing comm
hook) or, where backward cannot carry the reduction, all-reduces one flat buffer after it."""
