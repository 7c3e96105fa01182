#!/usr/bin/env bash
# Prepares .whl/ at the repository root: the wheels the GPU machine lacks, pinned in
# benchmarks/gpu/wheels.txt (the one list; each line says why it is carried).
#
#   Run here (needs PyPI):  bash benchmarks/gpu/prepare_wheels.sh
#   Device call:            name ".whl" in the run tool's `carry` (it is git-ignored, so it
#                           travels only when carried; the repo itself travels as source).
#   GPU side (no network):  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# The GPU machine is Python 3.12.3, manylinux x86-64, no network; it already has torch 2.11.0,
# triton 3.6.0, numpy 2.5.2 and the packages in benchmarks/gpu/image.txt. Exits 1 if a wheel's
# requirement is neither carried nor in the image, or if what travels is over 64 MiB.
# FOLDWISE_WHEEL_DIR=DIR writes the wheels there instead of .whl/ (the tests use a temporary one).
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
LIST=benchmarks/gpu/wheels.txt
WHL="${FOLDWISE_WHEEL_DIR:-.whl}"
LIMIT=67108864   # the device call's carry limit: 64 MiB

# What the GPU image already has (never downloaded): the one list, also read by the tests.
IMAGE=benchmarks/gpu/image.txt

mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$LIST")
echo "== ${#PINS[@]} pins from $LIST"

# 1. Download, without dependencies: the list is the closure, so pip must add nothing to it.
#    A wheel already in .whl/ is kept. The stderr filter drops pip's warnings about this
#    machine's configured local indexes that do not exist (harmless noise).
mkdir -p "$WHL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "${PINS[@]}" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)

# 2. Prune and check, in Python (packaging's parsers): delete any wheel not pinned (a stale
#    version would be installed beside or over the pinned one), require exactly one wheel per
#    pin, and check each wheel's non-extra requirements (for CPython 3.12 on Linux) against
#    the carried pins and the image.
python3 - "$WHL" "$IMAGE" "${PINS[@]}" <<'PY'
import sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

whl, pins = Path(sys.argv[1]), sys.argv[3:]
image_lines = [ln.split("#")[0].strip() for ln in Path(sys.argv[2]).read_text().splitlines()]
image = [ln.split("==")[0] for ln in image_lines if ln]
pinned = {canonicalize_name(p.split("==")[0]): p.split("==")[1] for p in pins}
known = {canonicalize_name(ln.split("==")[0]): ln.split("==")[1] for ln in image_lines if "==" in ln}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
       "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}

def in_image(name):
    return any(name == canonicalize_name(i) or (i.endswith("*") and name.startswith(i[:-1])) for i in image)

found, bad = {}, []
for f in sorted(whl.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(f.name)
    if pinned.get(name) != str(version):
        print(f"   removing stale {f.name}")
        f.unlink()
        continue
    found.setdefault(name, []).append(f)
for name, version in pinned.items():
    if len(found.get(name, [])) != 1:
        bad.append(f"{name}=={version}: {len(found.get(name, []))} wheels in {whl}/, want 1")
for name, (f,) in ((n, fs) for n, fs in found.items() if len(fs) == 1):
    meta = next(m for m in zipfile.ZipFile(f).namelist() if m.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(f).read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker and not req.marker.evaluate(env):
            continue   # an extra, another platform or another Python
        dep = canonicalize_name(req.name)
        have = pinned.get(dep) or known.get(dep)
        if have is not None:
            if not req.specifier.contains(have, prereleases=True):
                bad.append(f"{name} needs {req}, but {dep}=={have} is what the GPU gets")
        elif not in_image(dep):
            bad.append(f"{name} needs {req}: neither carried nor in the image")
if bad:
    sys.exit("FAILED:\n  " + "\n  ".join(bad))
print(f"== {len(found)} wheels, one per pin; every requirement is carried or in the image")
PY

# 3. Each wheel must be a sound zip (the GPU side cannot download a replacement).
for f in "$WHL"/*.whl; do python3 -m zipfile -t "$f" >/dev/null; done

# 4. Sizes: the wheels, and all that travels (git's tracked and untracked-not-ignored files,
#    which is what the device call copies, plus the carried .whl/).
echo "== wheels (bytes):"
stat -c '%10s  %n' "$WHL"/*.whl
whl_bytes=$(stat -c %s "$WHL"/*.whl | awk '{s+=$1} END {print s+0}')
repo_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
total=$((whl_bytes + repo_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b/1048576}'; }
echo "== $WHL/: $whl_bytes bytes ($(mib "$whl_bytes")); repo files: $repo_bytes bytes ($(mib "$repo_bytes"))"
echo "== travels: $total bytes ($(mib "$total")) of $LIMIT ($(mib "$LIMIT"))"
if (( total > LIMIT )); then
    echo "FAILED: over the 64 MiB carry limit" >&2
    exit 1
fi
echo "OK: carry \".whl\" in the device call"
