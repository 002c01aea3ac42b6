# syntax=docker/dockerfile:1
# Switchyard for NVIDIA GPU hosts:   docker build -t switchyard:latest .
# With DeepEP built from source:     docker build --build-arg WITH_DEEPEP=1 -t switchyard:latest .
# The Python layer is installed by scripts/bootstrap.sh, exactly as the README's commands do.
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/switchyard/src
COPY pyproject.toml README.md ./
COPY scripts/bootstrap.sh scripts/
COPY switchyard switchyard
COPY gateway gateway
COPY services services
COPY ep_dispatch ep_dispatch
COPY dcp dcp
COPY moe_kernels moe_kernels
# torch built for this image's CUDA (12.8, as cupy-cuda12x), then the project with its GPU
# extras; compiled ahead, as the non-root user cannot write __pycache__ here. torch 2.11
# brings Triton 3.6: the compiler the kernels were checked and tuned with on the H200
# (docs/benchmarks.md; moe_kernels/configs).
ENV SWITCHYARD_VENV=/opt/switchyard/venv \
    SWITCHYARD_TORCH="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
RUN scripts/bootstrap.sh gpu && "$SWITCHYARD_VENV/bin/python" -m compileall -q .
ARG WITH_DEEPEP=0
ARG DEEPEP_REF=main
RUN if [ "$WITH_DEEPEP" = 1 ]; then \
        git clone --depth 1 --branch "$DEEPEP_REF" https://github.com/deepseek-ai/DeepEP.git \
            /tmp/deepep \
        && cd /tmp/deepep \
        && "$SWITCHYARD_VENV/bin/python" -m pip install --no-build-isolation . \
        && rm -rf /tmp/deepep; \
    fi

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU}
# Triton compiles its launcher with the C compiler and Python headers at run time.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 switchyard
COPY --from=build /opt/switchyard /opt/switchyard
ENV PATH=/opt/switchyard/venv/bin:$PATH
USER switchyard
WORKDIR /home/switchyard
EXPOSE 8000
CMD ["switchyard", "serve", "--host", "0.0.0.0", "--port", "8000"]
