# syntax=docker/dockerfile:1
# rigserve for GPU rigs: a build stage compiles the engine with build.py, a runtime stage carries only the
# engine libraries, the app and its Python dependencies. docs/docker.md explains every option and what has and
# has not been tested (this file was written and linted without a Docker engine to build it).
#
#   docker build -t rigserve .                                    # CUDA, archs 80;86;89;90;120
#   docker build -t rigserve --build-arg CUDA_ARCHS=90 .          # only Hopper: a much faster build
#   docker build -t rigserve:rocm --build-arg GPU=rocm .          # ROCm / HIP (untested)
#   docker run --gpus all -p 8080:8080 -v /srv/models:/models rigserve -m /models/model.gguf
#
# The engine source is the pinned sdist, fetched by build.py with pip (network to PyPI at build time), or,
# when the context holds `.export/llama.cpp` (`python3 build.py engine --export-source .export/llama.cpp`),
# that exported tree, with no download at all.

ARG GPU=cuda
ARG CUDA_VERSION=12.8.1
ARG ROCM_VERSION=6.4.1
ARG UBUNTU_VERSION=24.04

# ---- build stages: one per GPU stack; `FROM build-${GPU}` below picks one, BuildKit skips the other ----------

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build-cuda
ARG CUDA_ARCHS="80;86;89;90;120"
# libcuda.so.1 belongs to the host driver and is mounted at run time; build.py's ldd check after install needs
# the name to resolve now, so the toolkit's stub is registered with the loader in this stage only
RUN ln -s /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/cuda/lib64/stubs/libcuda.so.1 \
    && echo /usr/local/cuda/lib64/stubs > /etc/ld.so.conf.d/zz-cuda-stubs.conf && ldconfig
ENV ENGINE_BACKEND_ARGS="--cuda-arch ${CUDA_ARCHS}"

FROM rocm/dev-ubuntu-${UBUNTU_VERSION}:${ROCM_VERSION}-complete AS build-rocm
ARG HIP_ARCHS="gfx90a;gfx942;gfx1100"
ENV ENGINE_BACKEND_ARGS="--hip-arch ${HIP_ARCHS}"

FROM build-${GPU} AS build
# GGML_NATIVE=OFF: the image runs on other CPUs than the one that built it (docs/build.md)
ARG ENGINE_DEFINES="-D GGML_NATIVE=OFF"
# empty: all cores; nvcc for several archs takes a few GiB per job, so lower it on small builders
ARG BUILD_JOBS=""
# 1: also build llama-server, llama-bench & co. into app/_lib/bin (needed by `app bench`)
ARG ENGINE_TOOLS=0
ENV DEBIAN_FRONTEND=noninteractive \
    CCACHE_DIR=/root/.cache/rigserve/ccache
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential ca-certificates ccache cmake ninja-build \
       patch python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rigserve
# only what the engine build reads, so editing app/ does not rebuild the engine
COPY build.py ./
COPY native/ native/
# /ctx: the whole (dockerignored) context, read-only, to find an exported source tree if one was shipped;
# the cache mount keeps build.py's download, build dirs and ccache between image builds
RUN --mount=type=bind,target=/ctx \
    --mount=type=cache,target=/root/.cache/rigserve,id=rigserve-build-cache \
    set -eu; \
    mkdir -p app; \
    src=""; if [ -d /ctx/.export/llama.cpp ]; then src="--source /ctx/.export/llama.cpp"; fi; \
    tools=""; if [ "${ENGINE_TOOLS}" = "1" ]; then tools="--with-upstream-tools"; fi; \
    jobs=""; if [ -n "${BUILD_JOBS}" ]; then jobs="--jobs ${BUILD_JOBS}"; fi; \
    python3 build.py engine ${ENGINE_BACKEND_ARGS} ${src} ${tools} ${jobs} ${ENGINE_DEFINES}

# ---- runtime stages ---------------------------------------------------------------------------------------------

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS base-cuda

# ROCm's runtime libraries (rocBLAS, hipBLAS) come with the dev image; a slimmer base is future work
FROM rocm/dev-ubuntu-${UBUNTU_VERSION}:${ROCM_VERSION}-complete AS base-rocm

FROM base-${GPU} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# libgomp1: ggml's CPU backend uses OpenMP; python3-venv: Ubuntu's Python refuses system-wide pip installs
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libgomp1 python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin rigserve \
    && mkdir -p /models /home/rigserve/.config/rigserve/presets \
    && chown -R rigserve:rigserve /models /home/rigserve
WORKDIR /opt/rigserve
COPY pyproject.toml README.md ./
COPY configs/ configs/
COPY app/ app/
COPY --from=build /opt/rigserve/app/_lib/ app/_lib/
# editable: app/_lib and configs/presets are found next to the package's own files, as in a checkout
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -e /opt/rigserve \
    && /opt/venv/bin/app --help > /dev/null \
    && /opt/venv/bin/python -c "from app.presets import load_catalog; assert load_catalog().get('generic')"
# (the engine itself is not loaded here: libggml-cuda needs the host driver's libcuda.so.1, present only at run time)
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    LLAMA_ARG_HOST=0.0.0.0 \
    LLAMA_ARG_PORT=8080
USER rigserve
VOLUME ["/models"]
EXPOSE 8080
# /health is 503 while the model loads, so the start period covers a large model's load
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('LLAMA_ARG_PORT', '8080'), timeout=4)" || exit 1
ENTRYPOINT ["app", "serve"]
