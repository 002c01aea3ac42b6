"""Expert service: holds a share of every MoE layer's experts and runs the grouped GEMM.

`server` loads its share of the experts, checks and computes each layer's batches, and runs
its dispatch backend's expert side; `quantize` is `switchyard quantize`, a copy of a
checkpoint with W4A4 experts and/or int8 dense linears.
"""
