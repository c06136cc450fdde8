#!/usr/bin/env bash
# Batches of H200 measurements, each one device call on a two-GPU machine (one job per GPU). Each job has its own
# time limit and writes its JSON as it goes, so a cut run keeps what it measured. The outputs are packed into
# $OUT/session.tgz: the device tool brings back at most 8 files.
#
#   OUT=/some/dir bash bench/gpu_session.sh tune  # ~9 min: GPU 0 the KDA launch-option tuning (kda.py --sections
#                                                 # tune); GPU 1 the static-graph decode at B=64 after a 32K prompt,
#                                                 # then the decode and prefill profiles
#   OUT=/some/dir bash bench/gpu_session.sh fla   # ~9 min: fla's KDA rows in the same process as ours, one shape per
#                                                 # process (fla autotunes for minutes), then the correctness checks;
#                                                 # needs fla in PYTHONPATH
#   OUT=/some/dir bash bench/gpu_session.sh moe   # ~4 min: MXFP4 tile probes, moe.py between 1 and 16K tokens, ncu
set -u
OUT=${OUT:?set OUT to an output folder}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-}:$ROOT/src:$ROOT/kernels PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$ROOT"

case "${1:-}" in
tune)
  CUDA_VISIBLE_DEVICES=0 timeout 540 python3 bench/kda.py --out "$W/kda_tune" --sections tune \
    > "$W/kda_tune.log" 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 350 python3 bench/e2e.py --stages decode --prompt 32768 --batches 64 \
      --new-tokens 16 --prefill-chunk 4096 --impls ours_static_graph --budget-s 330 \
      --out "$W/e2e_32k_b64_static.json" > "$W/e2e_32k_b64_static.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 180 python3 bench/e2e.py --stages profile,prefill_profile --prefill 8192 \
      --out "$W/e2e_profile.json" > "$W/e2e_profile.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '^tune' "$W/kda_tune.log" | cut -c1-260
  grep -h '"stage"' "$W"/e2e_*.log | cut -c1-300
  ;;
fla)
  (
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/kda.py --out "$W/kda_16k" --sections time \
      --shapes 32:16384:sp > "$W/kda_16k.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 170 python3 bench/kda.py --out "$W/kda_4k" --sections time \
      --shapes 32:4096:sp > "$W/kda_4k.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 180 python3 bench/kda.py --out "$W/kda_check" --sections check \
      > "$W/kda_check.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 280 python3 bench/kda.py --out "$W/kda_96_32k" --sections time \
      --shapes 96:32768:k3 > "$W/kda_96_32k.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 270 python3 bench/kda.py --out "$W/kda_64k" --sections time \
      --shapes 32:65536:sp > "$W/kda_64k.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '^fla\|^ours\|^time' "$W"/kda_*.log | cut -c1-300
  ;;
moe)
  (
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
  tail -8 "$W/moe.log" | cut -c1-300
  grep -E "Duration|DRAM Throughput|L1/TEX Cache Throughput|Registers Per|Achieved Occupancy" "$W/ncu.log"
  cut -c1-200 "$W/probe.log"
  ;;
*)
  echo "usage: OUT=dir bash bench/gpu_session.sh tune|fla|moe" >&2
  exit 2
  ;;
esac
