#!/usr/bin/env bash
# The one-call GPU check (issue 21): preflight, then benchmarks/gpu/check.py (probes,
# correctness of every catalog kernel against float64, its special values on -inf, +inf and NaN rows
# (fuser_core/edge_rows.py), the accuracy bar on offsets, peaked and masked rows (fuser_core/accuracy.py),
# the client's stored-cubin path, the
# paper suite's speed against torch and the experts). Sized for one device call of at most
# 7 minutes on a bare H100/H200 of the GPU image (Python 3.12, torch 2.11, Triton 3.6).
#
#   Prepare here (needs PyPI):  bash benchmarks/gpu/prepare_wheels.sh
#   Device call:                bash benchmarks/gpu/check.sh --budget-s 330   carry [".whl"], timeout_s 420
#   Dry run (no GPU):           bash benchmarks/gpu/check.sh --dry-run OUT_DIR [check.py options]
#
# Results go to the folder given first, else to $OUT (the device tool's folder); at most 8 files:
# env.txt, check.log, check.json, summary.md, correctness.md, speed.md. Extra arguments go to
# check.py (--budget-s, --trials, --only, --stages). With no GPU it exits 3 at once, with
# one line and no results.
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY=0
ARGS=()
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then DRY=1; else ARGS+=("$a"); fi
done
OUT_DIR="${OUT:-}"
if [ ${#ARGS[@]} -gt 0 ] && [ "${ARGS[0]#-}" = "${ARGS[0]}" ]; then  # a first argument that is no option
  OUT_DIR="${ARGS[0]}"; ARGS=("${ARGS[@]:1}")
fi

if [ "$DRY" = 0 ]; then
  # Preflight: refuse at once, with one line and nothing that looks like a result.
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu check: no NVIDIA GPU here (nvidia-smi lists none); nothing was measured" >&2
    exit 3
  fi
fi
if [ -z "$OUT_DIR" ]; then
  echo "gpu check: give a results folder (or run where \$OUT is set)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"

# The carried wheels (prepare_wheels.sh: built for the GPU image's Python 3.12), installed beside
# the image's packages; a dry run, or another Python, uses the environment it is started in.
PY312=$(python3 -c 'import sys; print(int(sys.version_info[:2] == (3, 12)))')
if [ "$DRY" = 0 ] && [ "$PY312" = 1 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  SITE="${FOLDWISE_GPU_SITE:-/tmp/foldwise-site}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu check: the carried wheels did not install" >&2; exit 4; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
export FOLDWISE_CACHE_DIR="${FOLDWISE_CACHE_DIR:-/tmp/foldwise-cache}"
export FOLDWISE_COMPILE_WORKERS="${FOLDWISE_COMPILE_WORKERS:-8}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  if [ "$DRY" = 0 ]; then nvidia-smi; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv; fi
  python3 - <<'EOF'
import platform, numpy, torch, triton
print(f"python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"triton {triton.__version__}, numpy {numpy.__version__}")
try:
    import liger_kernel, optuna
    from importlib.metadata import version
    print(f"liger-kernel {version('liger-kernel')}, optuna {optuna.__version__}")
except ImportError as err:
    print(f"missing: {err}")
EOF
} 2>&1 | tee "$OUT_DIR/env.txt"

DEVICE=(--device cuda)
[ "$DRY" = 1 ] && DEVICE=(--device cpu --tiny)
python3 benchmarks/gpu/check.py --out "$OUT_DIR" "${DEVICE[@]}" "${ARGS[@]}" 2>&1 | tee "$OUT_DIR/check.log"
exit "${PIPESTATUS[0]}"
