"""Expert parallelism (`plan.ep`, `plan.moe_balance`; groups "ep" and "ep_dp" carved out of "dp").

Modules: `groups` (the ep and ep_dp groups), `comm` (the token all-to-all as autograd functions),
`trans` (Trans and Agg: replicas of busy experts and their gradients), `layer`
(`ExpertParallelMoE`, whose docstring describes the scheme), `fused` (blocks with fused experts,
HF Mixtral and Qwen2-MoE), `apply` (`parallelize_experts`), `grads` (expert gradients and norm).
"""
