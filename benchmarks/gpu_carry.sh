#!/usr/bin/env bash
# usage: benchmarks/gpu_carry.sh OUT [IMAGES]
#
# On a machine with network (x86_64 Debian; see DEBS for Ubuntu), put into OUT what a GPU machine
# without network lacks to run benchmarks/gpu_run.sh: wheels for Python 3.12 (webdataset,
# braceexpand and the rest of benchmarks/gpu_requirements.txt; not torch, torchvision or ray),
# libjpeg-turbo's runtime and headers as .debs (raywds.loader._jpeg is built against them there),
# and the JPEGs the benchmarks build their shards from (IMAGES, by default the 100-photo sample).
# Then copy OUT and this repository to the GPU machine and run there:
#
#     benchmarks/gpu_run.sh OUT
#
# PYTHON: the pip to download with (any Python 3; the wheels are for 3.12 whatever it is).
# DEBS: the packages to fetch; Ubuntu names them DEBS="libjpeg-turbo8 libjpeg-turbo8-dev".
# DEB_ARCH: the GPU machine's Debian architecture (amd64).
# RAY=1: also Ray for the `ray` step (OUT/ray): the wheel of the Ray installed here, without its
# Java jar, RLlib and source maps (80 MB -> 44 MB; raywds uses none of them), and the wheels Ray
# and Ray Train need beyond what a PyTorch machine has (jsonschema, pydantic, tensorboardX...).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: benchmarks/gpu_carry.sh OUT [IMAGES]}"
images="${2:-$here/../../shared/data/imagenet-sample-100}"
python="${PYTHON:-python3}"
debs="${DEBS:-libjpeg62-turbo libjpeg62-turbo-dev}"
arch="${DEB_ARCH:-amd64}"
mkdir -p "$out/wheels" "$out/debs" "$out/images"
out="$(cd "$out" && pwd)"

echo "gpu_carry: wheels for CPython 3.12 on x86_64 Linux -> $out/wheels" >&2
"$python" -m pip download --disable-pip-version-check --dest "$out/wheels" \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -r "$here/gpu_requirements.txt"

if [[ ${RAY:-0} == 1 ]]; then
    echo "gpu_carry: Ray and what it needs -> $out/ray" >&2
    mkdir -p "$out/ray"
    pins="$("$python" - <<'EOF'
from importlib import metadata
names = ["ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "tensorboardX",
         "pydantic", "pydantic-core", "annotated-types", "typing-inspection"]
print(" ".join(f"{n}=={metadata.version(n)}" for n in names))
EOF
)"
    # shellcheck disable=SC2086  # one argument per pin
    "$python" -m pip download --disable-pip-version-check --no-deps --dest "$out/ray" \
        --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $pins
    "$python" - "$out/ray" <<'EOF'
import pathlib, sys, zipfile
folder = pathlib.Path(sys.argv[1])
for wheel in folder.glob("ray-*.whl"):
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(wheel.with_suffix(".stripped.zip"), "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if not info.filename.startswith(("ray/jars/", "ray/rllib/")) and not info.filename.endswith(".js.map"):
                out.writestr(info, src.read(info))
    wheel.unlink()
EOF
fi

echo "gpu_carry: $debs ($arch) -> $out/debs" >&2
packages=()
for deb in $debs; do
    packages+=("$deb:$arch")
done
if ! (cd "$out/debs" && apt-get download "${packages[@]}"); then
    echo "gpu_carry: apt-get download failed: run apt-get update first; on Ubuntu set" >&2
    echo "gpu_carry: DEBS=\"libjpeg-turbo8 libjpeg-turbo8-dev\"" >&2
    exit 1
fi

echo "gpu_carry: JPEGs from $images -> $out/images" >&2
shopt -s nullglob nocaseglob
jpegs=("$images"/*.jpeg "$images"/*.jpg)
if ((${#jpegs[@]} == 0)); then
    echo "gpu_carry: no JPEGs in $images; give the folder of the 100-photo sample as IMAGES" >&2
    exit 1
fi
cp "${jpegs[@]}" "$out/images/"

echo "gpu_carry: done ($(du -sh "$out" | cut -f1)):" >&2
ls "$out/wheels" "$out/debs" >&2
echo "gpu_carry: copy $out and this repository to the GPU machine, then run: benchmarks/gpu_run.sh OUT" >&2
