#!/usr/bin/env bash
# usage: benchmarks/busy_timeline.sh OUT [SECONDS]     (stop it by its PID)
#
# Every SECONDS (5), one line appended to OUT: the seconds since it started, how busy all CPUs
# were over that span (% of all cores, from /proc/stat: user, nice, system, irq, softirq, steal),
# and which of the image test's build steps (tests/support/image.py) were running then:
# debootstrap, torch (uv installing torch into the base), import (its `docker import`), dpkg; and
# pytest while a pytest runs. docs/testing.md reads a clean-clone `.ci/run` with it beside:
#
#     benchmarks/busy_timeline.sh /tmp/busy.txt & sampler=$!
#     bash .ci/run; kill $sampler
#
# A suite whose lines stay near 100% is bound by the CPU: only less CPU makes it shorter, not
# another order of its tests or work moved beside them.
set -euo pipefail
out="${1:?usage: benchmarks/busy_timeline.sh OUT [SECONDS]}"
every="${2:-5}"
start=$(date +%s)
read -r _ u n s i w q sq st _ </proc/stat
busy=$((u + n + s + q + sq + st)) total=$((busy + i + w))
while true; do
    sleep "$every"
    read -r _ u n s i w q sq st _ </proc/stat
    now_busy=$((u + n + s + q + sq + st))
    now_total=$((now_busy + i + w))
    line="$(($(date +%s) - start)) $((100 * (now_busy - busy) / (now_total - total > 0 ? now_total - total : 1)))"
    busy=$now_busy total=$now_total
    pgrep -x debootstrap >/dev/null && line+=" debootstrap"
    pgrep -f "pip install -q --compile-bytecode --python .* --target" >/dev/null && line+=" torch"
    pgrep -f -- "--numeric-owner -c" >/dev/null && line+=" import"
    pgrep -x dpkg >/dev/null && line+=" dpkg"
    pgrep -f "pytest" >/dev/null && line+=" pytest"
    echo "$line" >>"$out"
done
