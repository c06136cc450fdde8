#!/usr/bin/env bash
# The measurements still owed (bench/README.md, "Still to be measured") in one call on a two-GPU machine:
# GPU 0 the static-graph decode at B=64 after a 32K prompt, then the decode and prefill profiles; GPU 1 fla's KDA
# rows at two shapes, one shape per process so that fla's autotuning of one cannot starve the other. Each job has
# its own time limit and writes its JSON as it goes, so a cut run keeps what it measured. The outputs are packed
# into $OUT/session.tgz: the device tool brings back at most 8 files.
#
#   OUT=/some/dir bash bench/gpu_session.sh         # ~9 minutes; needs fla in PYTHONPATH for the peer rows
#   OUT=/some/dir bash bench/gpu_session.sh second  # two GPUs, ~8 minutes: items 4 (KDA kernel options sweep) and 5
#                                                   # (moe.py and ncu at the current MXFP4 tiles)
set -u
OUT=${OUT:?set OUT to an output folder}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-}:$ROOT/src:$ROOT/kernels PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$ROOT"

if [ "${1:-}" = second ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 bench/kda.py --out "$W/kda_sweep" --sections sweep \
    > "$W/kda_sweep.log" 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 300 python3 bench/moe.py --tokens 1 64 1024 16384 --out "$W/moe" \
      > "$W/moe.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 150 ncu --clock-control none --kernel-name regex:mxfp4 --launch-skip 2 \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      python3 bench/moe_probe.py --tokens 1024 --reps 2 > "$W/ncu.log" 2>&1
    # K-permuted tiles at 16K tokens (BM=128) whose sm_90 code has no operand shuffle and asynchronous MMA waits
    CUDA_VISIBLE_DEVICES=1 timeout 100 python3 bench/moe_probe.py --tokens 16384 \
      --configs 128:64:64:4:4:1,128:128:64:8:3:1,128:64:64:8:4:1 > "$W/probe_16k.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '^sweep' "$W/kda_sweep.log" | cut -c1-300
  tail -8 "$W/moe.log" | cut -c1-300
  grep -E "Duration|DRAM Throughput|L1/TEX Cache Throughput|Registers Per|Achieved Occupancy" "$W/ncu.log"
  cut -c1-250 "$W/probe_16k.log"
  exit 0
fi

(
  CUDA_VISIBLE_DEVICES=0 timeout 360 python3 bench/e2e.py --stages decode --prompt 32768 --batches 64 \
    --new-tokens 16 --prefill-chunk 4096 --impls ours_static_graph --budget-s 340 \
    --out "$W/e2e_32k_b64_static.json" > "$W/e2e_32k_b64_static.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 180 python3 bench/e2e.py --stages profile,prefill_profile --prefill 8192 \
    --out "$W/e2e_profile.json" > "$W/e2e_profile.log" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 270 python3 bench/kda.py --out "$W/kda_4k" --sections time \
    --shapes 32:4096:sp > "$W/kda_4k.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 270 python3 bench/kda.py --out "$W/kda_32k" --sections time \
    --shapes 96:32768:k3 > "$W/kda_32k.log" 2>&1
) &
wait
tar czf "$OUT/session.tgz" -C "$W" .
grep -h '"stage"' "$W"/e2e_*.log | cut -c1-300
grep -h '^fla' "$W"/kda_*.log | cut -c1-300
