"""The parallel dimensions, a sub-package each with its layers and its communication side by side:
`tensor/` (Megatron 1D), `tensor3d/` (AxoNN 3D), `expert/`, `pipeline/`, `data/`, `context/`.
Shared by them: `detect` (blocks found by module structure), `heads` (attention head
bookkeeping) and `grad_norm` (the gradient norm of a model split over ranks). `dimensions` lists
each dimension's torch-free plan rules (`options`) in mesh order. `interlace.parallelize`
applies the dimensions in a fixed order."""
