#!/usr/bin/env bash
# The measurements still owed (bench/README.md, "Still to be measured") in one call on a two-GPU machine:
# GPU 0 the 4.3B decode rows (B=64; B=8/64 after a 32K prompt) and the longest-prompt stage, GPU 1 the K3-shaped
# prefill, the kernels-on/off output check and the KDA timings with fla in the same run. Each job has its own time limit and writes its JSON as it
# goes, so a cut run keeps what it measured.
#
#   OUT=/some/dir bash bench/gpu_session.sh      # ~9 minutes; needs fla in PYTHONPATH for the peer rows
set -u
OUT=${OUT:?set OUT to an output folder}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=${PYTHONPATH:-}:$ROOT/src:$ROOT/kernels PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT/kda"
cd "$ROOT"

(
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/e2e.py --stages decode --batches 64 --new-tokens 32 \
    --budget-s 170 --out "$OUT/e2e_b64.json" > "$OUT/e2e_b64.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/e2e.py --stages decode --prompt 32768 --batches 8,64 \
    --new-tokens 16 --budget-s 120 --out "$OUT/e2e_32k.json" > "$OUT/e2e_32k.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/e2e.py --stages longest --longest 131072,1048576 \
    --budget-s 180 --out "$OUT/e2e_longest.json" > "$OUT/e2e_longest.log" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/e2e.py --model k3 --stages prefill --prefill 2048,8192 \
    --budget-s 120 --out "$OUT/e2e_k3.json" > "$OUT/e2e_k3.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 bench/e2e.py --stages check_kernels \
    --out "$OUT/e2e_check_kernels.json" > "$OUT/e2e_check_kernels.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 290 python3 bench/kda.py --out "$OUT/kda" --sections time \
    --shapes 96:32768:k3,32:4096:sp,32:65536:sp > "$OUT/kda_time.log" 2>&1
) &
wait
grep -h '"stage"' "$OUT"/e2e_*.log | cut -c1-300
grep -h 'fla' "$OUT/kda_time.log" | cut -c1-300
