"""Expert parallelism (`plan.ep`, `plan.moe_balance`; groups "ep" and "ep_dp" carved out of "dp").

Modules: `options` (the plan's rules and who holds an expert, torch-free), `groups` (the ep and
ep_dp groups), `comm` (the token all-to-all as autograd functions),
`trans` (Trans and Agg: replicas of busy experts and their gradients), `layer`
(`ExpertParallelMoE`, whose docstring describes the scheme), `local` (`LocalExperts`: a layer's
experts, read stacked through their module's call), `fused` (blocks with fused experts, HF
Mixtral and Qwen2-MoE), `apply` (`parallelize_experts`), `grads` (expert gradients and norm),
`tp_tokens` (ep × tp: each tensor parallel rank dispatches its share of the tokens), `shard`
(experts sharded over ep_dp by FSDP2 under sharded data parallelism).
"""
