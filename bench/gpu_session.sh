#!/usr/bin/env bash
# The measurements still owed (bench/README.md, "Still to be measured") in one call on a two-GPU machine:
# GPU 0 times the KDA kernel options, GPU 1 the MXFP4 GEMV, the K3-shaped model and decode after a 32K prompt.
# Each job has its own time limit and writes its JSON as it goes, so a cut run keeps what it measured.
#
#   OUT=/some/dir bash bench/gpu_session.sh      # ~8 minutes; needs fla in PYTHONPATH for the peer rows
set -u
OUT=${OUT:?set OUT to an output folder}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=${PYTHONPATH:-}:$ROOT/src:$ROOT/kernels PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT/kda" "$OUT/mx"
cd "$ROOT"

(
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/kda.py --out "$OUT/kda" --sections sweep,prof > "$OUT/kda_sweep.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/kda.py --out "$OUT/kda" --sections time \
    --shapes 96:8192:k3,96:32768:k3,32:16384:sp > "$OUT/kda_time.log" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 bench/mxfp4_decode_check.py --out "$OUT/mx" > "$OUT/mx.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 180 python3 bench/e2e.py --model k3 --stages prefill,decode --prefill 2048,8192 \
    --batches 1,8 --new-tokens 32 --budget-s 150 --out "$OUT/e2e_k3.json" > "$OUT/e2e_k3.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 bench/e2e.py --stages decode --prompt 32768 --batches 1 \
    --new-tokens 32 --budget-s 120 --out "$OUT/e2e_32k.json" > "$OUT/e2e_32k.log" 2>&1
) &
wait
grep -h '^sweep\|^prof' "$OUT/kda_sweep.log" | cut -c1-300
grep -h '"check": "time"' "$OUT/mx.log" | cut -c1-300
grep -h '"stage"' "$OUT/e2e_k3.log" "$OUT/e2e_32k.log" | cut -c1-300
