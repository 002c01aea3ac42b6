"""MoE compute kernels: grouped expert GEMMs. There are torch paths for any device, and a
Triton W4A4 MXFP4 kernel for GPUs, with tuned configs per GPU model.

From the formats up:

- `mxfp4`: the OCP-MX quantizer.
- `grouped_gemm`: grouped SwiGLU, float and W4A4 torch paths.
- `panels`: float32 and MXFP4 weights in the CPU kernels' layouts.
- `int8`: dense weights in 8 bits, a scale per output channel.
- `fp8`: the same scheme on a GPU.
- `cpu_kernels`: the compiled CPU kernels, in `csrc/`.
- `bf16x2_layout`: weights rearranged for the inline-PTX decode.
- `triton_mxfp4`: the grouped MXFP4 GEMM, and a one-pass MXFP4 decode for the bf16-GEMM
  route.
- `kernel_configs`: the kernel's tuned variant and tiles per GPU model, from
  `configs/<device>.json`.
- On top, `selection`: which kernel runs on which device.
"""
