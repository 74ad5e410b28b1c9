#!/usr/bin/env bash
# Issue 10's checks that need a CUDA GPU, in one go, each one's output in OUTDIR:
#   suite-cuda.log     the whole test suite with the GPU visible
#   suite-hidden.log   the whole test suite with CUDA_VISIBLE_DEVICES= (CPU only)
#   throughput.txt     gpu_throughput.py, bf16 then fp16 (fp32, native, O1, O2)
#   profile.txt        one O2 and one native step of each model, top ops by CUDA time
#   memory.txt         memory_o2.py on CUDA (fused AdamW), its presets and gpt-1024
#   cast-traffic.txt   cast_traffic.py (device-independent counts, for the record)
# The first line of each file names the device and the torch version.
#
# Run from the repository root on the GPU machine: benchmarks/gpu_checks.sh OUTDIR
# Needs pytest, pytest-xdist and hypothesis there (expecttest too, for the autocast
# op-list tests); ampkit is installed in place without dependencies.
set -uo pipefail
out="${1:?usage: benchmarks/gpu_checks.sh OUTDIR}"
py="${PYTHON:-python3}"
workers="${WORKERS:-8}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_checks.sh: no CUDA device here; these checks need a GPU" >&2
    exit 1
fi
missing=$("$py" -c "import importlib.util as u; print(' '.join(m for m in ('pytest', \
'xdist', 'hypothesis', 'expecttest') if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
    echo "gpu_checks.sh: missing Python packages: $missing (install or carry them first)" >&2
    exit 1
fi
"$py" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
header=$("$py" -c "import torch; print(torch.cuda.get_device_name(), 'torch', \
torch.__version__, 'CUDA', torch.version.cuda)") || exit 1
echo "$header"

run() {  # run NAME COMMAND...: the command's output, under a header, into OUTDIR/NAME
    local name=$1; shift
    { echo "# $header"; echo "# $*"; "$@"; echo "# exit status $?"; } > "$out/$name" 2>&1
    tail -n 2 "$out/$name"
}

run suite-cuda.log "$py" -m pytest -q -n "$workers" -p no:cacheprovider
run suite-hidden.log env CUDA_VISIBLE_DEVICES= "$py" -m pytest -q -n "$workers" \
    -p no:cacheprovider
{
    echo "# $header"
    for dtype in bfloat16 float16; do
        "$py" benchmarks/gpu_throughput.py --dtype "$dtype"
    done
} > "$out/throughput.txt" 2>&1
tail -n 14 "$out/throughput.txt"
run profile.txt "$py" benchmarks/gpu_throughput.py --dtype bfloat16 --modes native \
    ampkit-O2 --steps 3 --profile 25
{
    echo "# $header"
    "$py" benchmarks/memory_o2.py --device cuda
    "$py" benchmarks/memory_o2.py --device cuda --preset gpt-1024 --heads 16
} > "$out/memory.txt" 2>&1
tail -n 8 "$out/memory.txt"
run cast-traffic.txt "$py" benchmarks/cast_traffic.py --by-op
