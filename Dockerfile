# Switchyard's image. The Python layer is installed by scripts/bootstrap.sh, exactly as the
# README's commands do; its dependencies first (a layer that changes with pyproject.toml
# only), then the source.
#   NVIDIA GPU hosts:              docker build -t switchyard:latest .
#   With DeepEP built from source: docker build --build-arg WITH_DEEPEP=1 -t switchyard:latest .
#   A CPU image on a Debian base, torch's CPU wheel from a directory served on loopback
#   (scripts/docker-images does this, with a locally imported base):
#     docker build --network host --build-arg BASE_IMAGE=local/debian:bookworm \
#       --build-arg EXTRAS= --build-arg SWITCHYARD_TORCH=torch==2.13.0 \
#       --build-arg PIP_FIND_LINKS=http://127.0.0.1:PORT/ -t switchyard:cpu .
ARG BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04

FROM ${BASE_IMAGE} AS build
# EXTRA_CA_CERTS: PEM certificates the build must trust besides the system's (a network
# whose proxy re-signs TLS); pip then verifies against the system's bundle with them.
ARG EXTRA_CA_CERTS
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev g++ git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && if [ -n "$EXTRA_CA_CERTS" ]; then \
        printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/extra.crt \
        && update-ca-certificates >/dev/null 2>&1; fi
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /opt/switchyard/src
# The pip extras: gpu (CuPy's NCCL) on GPU hosts, none on the CPU.
ARG EXTRAS=gpu
# The torch requirement (pip arguments): a build for the image's CUDA (12.8, as
# cupy-cuda12x) by default; torch 2.11 brings Triton 3.6, the compiler the kernels were
# checked and tuned with on the H200 (docs/benchmarks.md; moe_kernels/configs). A CPU
# image asks for the CPU build, which pip takes from PIP_FIND_LINKS (its +cpu version
# sorts above PyPI's CUDA build of the same release): no CUDA wheel enters it.
ARG SWITCHYARD_TORCH="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
ARG PIP_FIND_LINKS
ENV SWITCHYARD_VENV=/opt/switchyard/venv
COPY pyproject.toml README.md ./
COPY scripts/bootstrap.sh scripts/
# Dependencies only: no package is here yet, so the project installs empty.
RUN scripts/bootstrap.sh "$EXTRAS"
COPY switchyard switchyard
COPY gateway gateway
COPY common common
COPY services services
COPY ep_dispatch ep_dispatch
COPY dcp dcp
COPY moe_kernels moe_kernels
# The project over its dependencies (already there: pip installs only it), compiled
# ahead, as the non-root user cannot write __pycache__ here.
RUN rm -f "$SWITCHYARD_VENV"/.switchyard-* && scripts/bootstrap.sh "$EXTRAS" \
    && "$SWITCHYARD_VENV/bin/python" -m compileall -q . \
    && rm -rf /root/.cache
ARG WITH_DEEPEP=0
ARG DEEPEP_REF=main
RUN if [ "$WITH_DEEPEP" = 1 ]; then \
        git clone --depth 1 --branch "$DEEPEP_REF" https://github.com/deepseek-ai/DeepEP.git \
            /tmp/deepep \
        && cd /tmp/deepep \
        && "$SWITCHYARD_VENV/bin/python" -m pip install --no-build-isolation . \
        && rm -rf /tmp/deepep; \
    fi

FROM ${BASE_IMAGE}
# Triton compiles its launcher, and torch the CPU expert kernels, with the C/C++ compiler
# and Python headers at run time.
# The CPU kernels are built where they run (-march=native) into torch's extension cache:
# its folder exists, so that a volume mounted there (compose --device cpu) is the user's.
# Kernels built beforehand go apart, into /opt/switchyard/cpu_kernels: Docker fills a new
# volume from the image's folder as each container is created, and two containers created
# at once then race to copy them ("mkdir ...: file exists").
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-dev g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 switchyard \
    && install -d -o switchyard -g switchyard /home/switchyard/.cache/torch_extensions \
        /opt/switchyard/cpu_kernels
COPY --from=build /opt/switchyard /opt/switchyard
ENV PATH=/opt/switchyard/venv/bin:$PATH \
    SWITCHYARD_CPU_KERNELS_PREBUILT=/opt/switchyard/cpu_kernels
USER switchyard
WORKDIR /home/switchyard
# PREBUILD_CPU_KERNELS=1: build the CPU kernels now, for an image that runs on the
# machine that builds it (-march=native): its containers then start without the 1-3 min
# build (scripts/docker-prepare). Elsewhere each container builds them on first use.
ARG PREBUILD_CPU_KERNELS=0
RUN if [ "$PREBUILD_CPU_KERNELS" = 1 ]; then \
        TORCH_EXTENSIONS_DIR=$SWITCHYARD_CPU_KERNELS_PREBUILT python -c \
            "from moe_kernels.cpu_kernels import cpu_kernels; assert cpu_kernels()"; \
    fi
EXPOSE 8000
CMD ["switchyard", "serve", "--host", "0.0.0.0", "--port", "8000"]
