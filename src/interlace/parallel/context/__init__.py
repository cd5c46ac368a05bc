"""Context parallelism (`plan.cp`, mesh groups "cp" and "dp_cp"): each sequence split over the cp
ranks of a group, zig-zag (`zigzag`), attention exact by a ring of key/value blocks (`ring`) or
by heads ↔ sequence exchanges (`alltoall`), the model's seams (`apply`, and `hf` for Hugging
Face decoders), and the plan's rules (`rules`, torch-free)."""
