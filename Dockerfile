# The raywds image: every node of a Ray cluster (and every torchrun pod) runs the same Python,
# torch, Ray and raywds from it. docs/kubernetes.md builds, checks and pushes it.
#
#   docker build -t registry.example.com/raywds:latest .
#   docker build --build-arg BASE=nvcr.io/nvidia/pytorch:25.10-py3 -t raywds:ngc .
#
# BASE is any image with Python >= 3.10, pip, torch and torchvision, and apt (Debian or Ubuntu).
# The default is PyTorch's own runtime image: the CUDA and cuDNN that torch was built against,
# release versions of torch and torchvision (which raywds's requirements then keep, so nothing
# downloads torch again), and nothing else, unlike NVIDIA's NGC image (about 4x the size, with
# pre-release torch versions that pip may replace). Choose the tag whose CUDA your nodes' driver
# runs. The tests build this file on a Debian base made with debootstrap (tests/image.py).
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE}

# One layer: libjpeg-turbo (the region decoder links it), nginx (`raywds serve`), a compiler
# and headers for the region decoder's build, removed again once raywds is installed.
COPY pyproject.toml setup.py README.md /src/
COPY raywds /src/raywds
RUN set -eux; \
    export DEBIAN_FRONTEND=noninteractive PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore; \
    apt-get update; \
    build="gcc libc6-dev libjpeg-dev"; \
    python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
        || build="$build python3-dev"; \
    nginx=nginx-light; apt-cache show nginx-light >/dev/null 2>&1 || nginx=nginx; \
    apt-get install -y --no-install-recommends $build $nginx ca-certificates; \
    python3 -m pip install -q uv; \
    RAYWDS_REQUIRE_JPEG_EXT=1 uv pip install --system --break-system-packages --no-cache /src; \
    python3 -m pip uninstall -q -y uv; \
    python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true; \
    apt-mark manual $(dpkg-query -W -f '${Package} ' libjpeg62-turbo libjpeg-turbo8 2>/dev/null); \
    apt-get purge -y --auto-remove $build; \
    apt-get clean; \
    rm -rf /src /var/lib/apt/lists/* /root/.cache; \
    python3 -c 'from raywds.loader import _jpeg; from raywds.data import _restarts'; \
    useradd --create-home --shell /bin/bash --uid 1000 raywds 2>/dev/null \
        || useradd --create-home --shell /bin/bash raywds  # Ubuntu 24.04 bases have uid 1000 already

USER raywds
WORKDIR /home/raywds
