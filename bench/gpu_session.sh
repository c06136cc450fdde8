#!/usr/bin/env bash
# Batches of H200 measurements, each one device call on a two-GPU machine (one job per GPU). Each job has its own
# time limit and writes its JSON as it goes, so a cut run keeps what it measured. The outputs are packed into
# $OUT/session.tgz: the device tool brings back at most 8 files.
#
#   OUT=/some/dir bash bench/gpu_session.sh tune  # ~8 min: GPU 0 the KDA launch-option tuning (kda.py --sections
#                                                 # tune); GPU 1 moe.py between 1 and 16K tokens, MXFP4 tiles at 16K
#   OUT=/some/dir bash bench/gpu_session.sh e2e   # ~6 min: the static-graph decode at B=64 after a 32K prompt; the
#                                                 # decode and prefill profiles
#   OUT=/some/dir bash bench/gpu_session.sh fla   # ~10 min: fla's KDA rows in the same process as ours at H=32
#                                                 # T=4K / 16K / 64K, H=96 T=4K-64K and the varlen batch (fla
#                                                 # autotunes for minutes per process); needs fla in PYTHONPATH
#   OUT=/some/dir bash bench/gpu_session.sh prefill  # ~6 min: moe.py at 1-64 tokens (the unsorted decode paths in a
#                                                    # CUDA graph), MXFP4 tiles at 2K / 4K tokens, the 4.3B and
#                                                    # K3-shaped prefills and the K3-shaped decode
#   OUT=/some/dir bash bench/gpu_session.sh precision  # ~5 min: the gradients' errors by the backward's matmul
#                                                  # precision (default, one-pass diagonal tiles, 3xTF32 in the
#                                                  # whole intra backward) and their forward+backward cost; the
#                                                  # full check without fla
set -u
OUT=${OUT:?set OUT to an output folder}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-}:$ROOT/src:$ROOT/kernels PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$ROOT"

case "${1:-}" in
tune)
  CUDA_VISIBLE_DEVICES=0 timeout 500 python3 bench/kda.py --out "$W/kda_tune" --sections tune \
    > "$W/kda_tune.log" 2>&1 &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 300 python3 bench/moe.py --tokens 1 2 8 16 64 1024 16384 --out "$W/moe" \
      > "$W/moe.log" 2>&1
    # 16K tokens (0.87x against the 0.9x goal): wider and deeper BM=128 tiles than the default
    CUDA_VISIBLE_DEVICES=1 timeout 180 python3 bench/moe_probe.py --tokens 16384 --configs \
      128:64:128:4:2:1:1,128:64:128:4:4:1:1,128:128:128:8:2:1:1,128:128:64:8:3:1:1,128:64:256:4:2:1:1 \
      > "$W/probe.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '^tune' "$W/kda_tune.log" | cut -c1-260
  tail -8 "$W/moe.log" | cut -c1-300
  cut -c1-200 "$W/probe.log"
  ;;
e2e)
  (
    CUDA_VISIBLE_DEVICES=0 timeout 350 python3 bench/e2e.py --stages decode --prompt 32768 --batches 64 \
      --new-tokens 16 --prefill-chunk 4096 --impls ours_static_graph --budget-s 330 \
      --out "$W/e2e_32k_b64_static.json" > "$W/e2e_32k_b64_static.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 180 python3 bench/e2e.py --stages profile,prefill_profile --prefill 8192 \
      --out "$W/e2e_profile.json" > "$W/e2e_profile.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '"stage"' "$W"/e2e_*.log | cut -c1-300
  ;;
fla)
  # fla in the same process as ours (fla autotunes for 2-4 minutes per head count and process, and again for varlen):
  # H=32 at 4K / 16K / 64K, then the varlen batch in a process of its own, on GPU 0; H=96 at 4K-64K on GPU 1
  (
    CUDA_VISIBLE_DEVICES=0 timeout 260 python3 bench/kda.py --out "$W/kda_32" --sections time --no-varlen \
      --shapes 32:4096:sp,32:16384:sp,32:65536:sp > "$W/kda_32.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 280 python3 bench/kda.py --out "$W/kda_varlen" --sections time --shapes "" \
      > "$W/kda_varlen.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 550 python3 bench/kda.py --out "$W/kda_96" --sections time --no-varlen \
      --shapes 96:4096:k3,96:8192:k3,96:16384:k3,96:32768:k3,96:65536:k3 > "$W/kda_96.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -h '^fla\|^ours\|varlen' "$W"/kda_*.log | cut -c1-300
  ;;
prefill)
  # the MXFP4 decode paths without the sort (moe.py at 1-16 tokens, CUDA graph rows) and tiles at 2K / 4K tokens;
  # the 4.3B and K3-shaped prefills
  (
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/moe.py --tokens 1 2 8 16 64 --out "$W/moe" > "$W/moe.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/moe_probe.py --tokens 2048 4096 --configs \
      64:64:128:4:2:1:1,64:128:128:4:3:1:1,64:64:128:4:4:1:1/128:64:128:4:2:1:1,128:64:128:4:4:1:1,128:128:64:8:3:1:1 \
      > "$W/probe.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 170 python3 bench/e2e.py --stages prefill --prefill 8192 \
      --out "$W/e2e_prefill.json" > "$W/e2e_prefill.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 170 python3 bench/e2e.py --model k3 --stages prefill,decode --prefill 2048,8192 \
      --out "$W/e2e_k3.json" > "$W/e2e_k3.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  tail -6 "$W/moe.log" | cut -c1-300
  cut -c1-200 "$W/probe.log"
  grep -h '"stage"' "$W"/e2e_*.log | cut -c1-300
  ;;
precision)
  (
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/kda_grad_precision.py --T 1000 8192 \
      --variants default,tf32_diag,x3_intra --time 96:16384,32:16384,96:65536 --out "$W/gp" > "$W/gp.log" 2>&1
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 500 python3 bench/kda.py --out "$W/kda_check" --sections check --no-fla \
      > "$W/kda_check.log" 2>&1
  ) &
  wait
  tar czf "$OUT/session.tgz" -C "$W" .
  grep -v Warn "$W/gp.log" | cut -c1-300
  grep -h "grad_vs" "$W/kda_check.log" | cut -c1-300
  ;;
*)
  echo "usage: OUT=dir bash bench/gpu_session.sh tune|e2e|fla|prefill|precision" >&2
  exit 2
  ;;
esac
