"""MoE compute kernels: grouped expert GEMMs (torch path for CPU; Triton and MXFP4 W4A4 later)."""
