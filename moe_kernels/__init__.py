"""MoE compute kernels: grouped expert GEMMs (torch paths for any device; a Triton W4A4 MXFP4
kernel for GPUs, with tuned configs per GPU model)."""
