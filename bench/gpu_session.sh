#!/usr/bin/env bash
# The measurements still owed (bench/README.md, "Still to be measured") in one call on a two-GPU machine:
# GPU 0 the static-graph decode at B=64 after a 32K prompt, then the decode and prefill profiles; GPU 1 fla's KDA
# row at H=32 T=64K (one shape per process: fla autotunes for minutes), then the KDA correctness checks. Each job has
# its own time limit and writes its JSON as it goes, so a cut run keeps what it measured. The outputs are packed
# into $OUT/session.tgz: the device tool brings back at most 8 files.
#
#   OUT=/some/dir bash bench/gpu_session.sh         # ~9 minutes; needs fla in PYTHONPATH for the peer rows
#   OUT=/some/dir bash bench/gpu_session.sh second  # two GPUs, ~4 minutes: the KDA kernel options sweep and MXFP4
#                                                   # tile probes; moe.py (item 4) and ncu at the current tiles
set -u
OUT=${OUT:?set OUT to an output folder}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-}:$ROOT/src:$ROOT/kernels PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$ROOT"

if [ "${1:-}" = second ]; then
  (
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/kda.py --out "$W/kda_sweep" --sections sweep \
      > "$W/kda_sweep.log" 2>&1
    # MXFP4 tiles around the defaults where they were never swept at their own size (BM=64 at 2K tokens, BM=128 at
    # 4K) and at 16K (0.87x against the 0.9x goal); the BK=256 down tile between 1 and 64 tokens
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/moe_probe.py --tokens 2048 4096 16384 8 16 --configs \
      64:64:128:4:2:1:1,64:128:128:4:3:1:1,64:64:128:4:4:1:1/128:64:128:4:2:1:1,128:64:128:4:4:1:1,64:64:128:4:3:1:1,64:128:128:8:3:1:1/128:64:128:4:2:1:1,128:64:128:4:4:1:1,64:128:128:8:3:1:1,64:64:128:4:3:1:1/16:64:256:4:3:1:1,16:64:256:4:2:1:1/16:64:256:4:3:1:1,16:64:256:4:2:1:1 \
      > "$W/probe.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 300 python3 bench/moe.py --tokens 1 2 8 16 64 1024 16384 --out "$W/moe" \
      > "$W/moe.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 150 ncu --clock-control none --kernel-name regex:mxfp4 --launch-skip 2 \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      python3 bench/moe_probe.py --tokens 1024 --reps 2 > "$W/ncu.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '^sweep' "$W/kda_sweep.log" | cut -c1-300
  tail -8 "$W/moe.log" | cut -c1-300
  grep -E "Duration|DRAM Throughput|L1/TEX Cache Throughput|Registers Per|Achieved Occupancy" "$W/ncu.log"
  cut -c1-200 "$W/probe.log"
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
  CUDA_VISIBLE_DEVICES=1 timeout 300 python3 bench/kda.py --out "$W/kda_64k" --sections time \
    --shapes 32:65536:sp > "$W/kda_64k.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 bench/kda.py --out "$W/kda_check" --sections check \
    > "$W/kda_check.log" 2>&1
) &
wait
tar czf "$OUT/session.tgz" -C "$W" .
grep -h '"stage"' "$W"/e2e_*.log | cut -c1-300
grep -h '^fla' "$W"/kda_*.log | cut -c1-300
