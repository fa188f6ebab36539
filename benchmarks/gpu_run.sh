#!/usr/bin/env bash
# usage: benchmarks/gpu_run.sh CARRY
#
# On the GPU machine (Python 3.12 with torch and torchvision, a C compiler, no network), from a
# copy of this repository, with CARRY made by benchmarks/gpu_carry.sh:
#
# 1. unpacks the carried libjpeg-turbo .debs into CARRY/libjpeg (dpkg -x; nothing system-wide)
#    and points CFLAGS, LDFLAGS and LD_LIBRARY_PATH at them;
# 2. makes the virtual environment CARRY/venv, which sees the machine's own torch (a .pth file
#    names its site-packages), and installs the carried wheels into it with --no-index;
# 3. installs raywds from this repository, editable and without dependencies, with
#    RAYWDS_REQUIRE_JPEG_EXT=1: the install fails if raywds.loader._jpeg does not build;
# 4. runs, each step's output also in CARRY/results/DATE/STEP.txt:
#      tests    pytest -m cuda tests/train/test_cuda.py, then the extension's and --compile's CPU tests
#      bench    benchmarks/gpu_bench.py: the rows of docs/performance.md "On a GPU" (JSON beside it)
#      scaling  benchmarks/loader_bench.py --scaling-only --workers 1,2,4,8,15 --copies 100
#      compile  the bench with --compile (and COMPILE_ARGS, e.g. "--workers 15 --skip-http")
#      ray      (where CARRY/ray holds Ray: RAY=1 gpu_carry.sh) `raywds ray` on the bench's shards,
#               2 epochs on the GPU, fed by the per-rank loader (15 workers), then by the Ray Data plane
#
# PYTHON: the interpreter with torch (python3). ONLY: the steps to run, e.g. ONLY="tests bench".
# A failed step does not stop the others; the exit status says whether any failed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
carry="$(cd "${1:?usage: benchmarks/gpu_run.sh CARRY}" && pwd)"
python="${PYTHON:-python3}"
only="${ONLY:-tests bench scaling compile ray}"
results="$carry/results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$results"
say() { echo "gpu_run: $*" >&2; }

# 1. libjpeg-turbo from the .debs
jpeg="$carry/libjpeg"
rm -rf "$jpeg" && mkdir -p "$jpeg"
debs=("$carry"/debs/*.deb)
[[ -e ${debs[0]} ]] || { say "no .debs in $carry/debs: run benchmarks/gpu_carry.sh first"; exit 1; }
for deb in "${debs[@]}"; do
    if command -v dpkg >/dev/null; then
        dpkg -x "$deb" "$jpeg"
    else  # not Debian: a .deb is an ar archive holding data.tar.*
        unpack="$(mktemp -d)"
        (cd "$unpack" && ar x "$deb" && tar -xf data.tar.* -C "$jpeg")
        rm -rf "$unpack"
    fi
done
locate() { find "$jpeg" -name "$1" -print -quit; }
for name in jpeglib.h jconfig.h libjpeg.so; do
    [[ -n $(locate "$name") ]] || { say "the .debs in $carry/debs hold no $name (libjpeg62-turbo-dev does)"; exit 1; }
done
header_dir="$(dirname "$(locate jpeglib.h)")"
config_dir="$(dirname "$(locate jconfig.h)")"
lib_dir="$(dirname "$(locate libjpeg.so)")"
export CFLAGS="-I$header_dir -I$config_dir ${CFLAGS:-}"
export LDFLAGS="-L$lib_dir -Wl,-rpath,$lib_dir ${LDFLAGS:-}"
export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if [[ ! -f $include/Python.h ]]; then
    python_h="$(locate Python.h)"  # a carried libpython3.12-dev (DEBS), if any
    [[ -n $python_h ]] || { say "no Python.h in $include: the extension cannot build (Debian: python3.12-dev)"; exit 1; }
    export CFLAGS="$CFLAGS -I$(dirname "$python_h") -I$(dirname "$(locate pyconfig.h)")"
fi
command -v "${CC:-cc}" >/dev/null || { say "no C compiler (${CC:-cc}) on this machine"; exit 1; }
say "libjpeg-turbo from $lib_dir"

# 2. the environment: the machine's torch, the carried wheels
venv="$carry/venv"
if [[ ! -x $venv/bin/python ]]; then
    "$python" -m venv "$venv"
fi
"$python" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
py="$venv/bin/python"
"$py" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'
pip=("$py" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --no-index --find-links "$carry/wheels" -r "$repo/benchmarks/gpu_requirements.txt"

# 3. raywds and its C extension
RAYWDS_REQUIRE_JPEG_EXT=1 "${pip[@]}" install -q --no-index --no-deps --no-build-isolation -e "$repo"
"$py" -c 'from raywds.loader import _jpeg; print("raywds.loader._jpeg:", _jpeg.__file__)'
ldd "$(cd "$repo" && "$py" -c 'from raywds.loader import _jpeg; print(_jpeg.__file__)')" | grep libjpeg

# 4. the steps
cd "$repo"
export RAYWDS_REQUIRE_JPEG_EXT=1  # the extension's tests fail, not skip, without it
failed=()
step() {
    local name=$1
    shift
    [[ " $only " == *" $name "* ]] || return 0
    say "$name: $*"
    if "$@" 2>&1 | tee "$results/$name.txt"; then
        say "$name: passed"
    else
        failed+=("$name")
        say "$name: FAILED (see $results/$name.txt)"
    fi
}
tests() {  # both runs, whichever fails
    local status=0
    "$py" -m pytest -m cuda -v -rs tests/train/test_cuda.py || status=1
    "$py" -m pytest -q tests/loader/test_jpeg_region.py tests/train/test_compile.py || status=1
    return $status
}
bench=("$py" benchmarks/gpu_bench.py --images "$carry/images" --shards "$carry/shards")
step tests tests
step bench "${bench[@]}" --json "$results/gpu_bench.json"
step scaling "$py" benchmarks/loader_bench.py --images "$carry/images" --scaling-only --workers 1,2,4,8,15 --copies 100
# shellcheck disable=SC2086  # COMPILE_ARGS: more of gpu_bench.py's flags, split on spaces
step compile "${bench[@]}" --compile --json "$results/gpu_bench_compile.json" ${COMPILE_ARGS:-}
ray_runs() {  # Ray from CARRY/ray on PYTHONPATH (the machine's Python has none), both data planes
    [[ -d $carry/ray ]] || { say "ray: no Ray in $carry/ray (make it with RAY=1 benchmarks/gpu_carry.sh)"; return 1; }
    local site="$carry/raysite"
    rm -rf "$site" && mkdir -p "$site"
    "$py" - "$carry"/ray/*.stripped.zip "$site" <<'EOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        mode = (info.external_attr >> 16) & 0o777
        if mode:  # the raylet and GCS binaries must stay executable
            os.chmod(path, mode)
EOF
    "${pip[@]}" install -q --no-index --no-deps --target "$site" "$carry"/ray/*.whl
    if [[ ! -f $carry/shards/manifest.json ]]; then
        "$py" -c "import pathlib, sys; sys.path.insert(0, 'benchmarks'); import gpu_bench
gpu_bench.build_shards(sorted(pathlib.Path('$carry/images').iterdir()), pathlib.Path('$carry/shards'), 20000, 16)"
    fi
    local plane status=0
    for plane in loader ray; do
        PYTHONPATH="$site" "$venv/bin/raywds" ray --data "$carry/shards" --recipe imagenet-resnet50 --epochs 2 \
            --loader-workers 15 --data-plane "$plane" --storage-path "$results/ray" --name "$plane" || status=1
    done
    return $status
}
step ray ray_runs
nvidia-smi >"$results/nvidia-smi.txt" 2>&1 || true
say "results in $results"
if ((${#failed[@]})); then
    say "failed: ${failed[*]}"
    exit 1
fi
