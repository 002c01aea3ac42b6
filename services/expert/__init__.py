"""Expert service: holds a share of every MoE layer's experts and runs the grouped GEMM."""
