#!/usr/bin/env bash
# Everything that needs the GPU, in one device call: machine facts, GPU tests, benchmarks.
# Usage (device tool, repo root):  bash bench/gpu_suite.sh [codec|codec-pages|pool|rmu|rmu-tests|rmu-bench|overhead|overhead-run|overhead-chunks|chunk-pass|overhead-x2|run-api|abort|faultkit|faultkit-abort|runtime|scale|preinit|integrity|scrub-bench|userpath|plain-recovery|moe|moe-userpath|replay-gpu|sdc|sdc-userpath|zoo|zoo-only|tied-job|certify|sdc-inject|gpu-tests|titan|titan-*|world2-shared|world2-*|breakdown|horner|horner-userpath|undo-ahead|copy-overlap|resumable-pass|clip-parity|userpath-long|grad-landing|certify-1b|user-recovery|fresh-start|cold-start|pin-stall|megatron|all]
# Writes logs and JSON under $OUT (or ./out when run by hand).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
} 2>&1 | tee "$OUT/machine.txt"
rc=0
# megatron-core is not installed on the GPU machine: its carried wheel (.whl), under
# /tmp/site, beside the repo on PYTHONPATH (the megatron and world2-megatron targets).
megatron_core() {
  pip install -q --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}
if [[ $what == codec || $what == all ]]; then
  python3 -m pytest -p no:cacheprovider -q tests/test_codec_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" || rc=1
  python3 -c 'from leto.erasure.kernels import by_name; print(by_name("cuda").kernel_info())' 2>&1 | tee "$OUT/kernel_info.txt"
  python3 -m bench.codec --device cuda --json-out "$OUT/codec_cuda.json" 2>&1 | tee "$OUT/codec_cuda.txt" || rc=1
fi
if [[ $what == pool || $what == all ]]; then
  python3 -m pytest -p no:cacheprovider -q tests/test_backend_cuda.py tests/test_pool_gpu.py 2>&1 | tee "$OUT/pool_gpu_tests.txt" || rc=1
  python3 -m bench.pool --device cuda:0 --pages 7168 --json-out "$OUT/pool_cuda.json" 2>&1 | tee "$OUT/pool_cuda.txt" || rc=1
  python3 -m bench.pool_cuda_backend --pages 7168 --json-out "$OUT/pool_backend_cuda.json" 2>&1 | tee "$OUT/pool_backend_cuda.txt" || rc=1
fi
if [[ $what == rmu || $what == rmu-tests || $what == all ]]; then
  python3 -m pytest -p no:cacheprovider -q tests/test_lending.py tests/test_rmu_gpu.py tests/test_dp_gpu.py tests/test_dp_multigpu.py 2>&1 | tee "$OUT/rmu_gpu_tests.txt" || rc=1
fi
if [[ $what == rmu || $what == rmu-bench || $what == all ]]; then
  python3 -m bench.rmu_memory --n-layer 20 --n-embd 2048 --n-head 16 --batch 8 --seq 1024 \
    --iters 2 --warmup 1 --json-out "$OUT/rmu_memory_cuda.json" 2>&1 | tee "$OUT/rmu_memory_cuda.txt" || rc=1
  python3 -m bench.rmu_overhead --device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 8 --seq 1024 \
    --iters 4 --warmup 2 --json-out "$OUT/rmu_overhead_cuda.json" 2>&1 | tee "$OUT/rmu_overhead_cuda.txt" || rc=1
fi
if [[ $what == codec-pages ]]; then
  # Why the parity kernels run far below their ceiling inside the updater: the same
  # operations on one torch tensor vs on pool (VMM) pages, and 1 vs 2 pages prefetched.
  python3 -m pytest -p no:cacheprovider -q tests/test_codec_gpu.py 2>&1 | tail -2 | tee "$OUT/codec_pages_tests.txt" || rc=1
  for h in 16 4; do for pf in 1 2; do for src in "" "--pool"; do
    LETO_CODEC_PREFETCH=$pf python3 -m bench.codec --device cuda --parity-pages $h --chunks 64,192 \
      --reps 10 $src --json-out "$OUT/codec_h${h}_pf${pf}${src:+_pool}.json" 2>&1 | tee -a "$OUT/codec_pages.txt" || rc=1
  done; done; done
fi
if [[ $what == overhead-x2 ]]; then
  # World 2 on two GPUs (nvidia-h200-x2): DDP + fused AdamW against Leto's bucketed
  # reduction, 16 K tokens per rank; then the two-GPU recovery tests under leto run.
  M="--device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 16 --seq 1024"
  python3 -m bench.rmu_overhead $M --world-size 2 --iters 4 --warmup 2 --tier1-pages ${LETO_H1:-4} \
    --json-out "$OUT/overhead_x2_16k.json" 2>&1 | tee "$OUT/overhead_x2_16k.txt" || rc=1
  timeout 240 python3 -m pytest -p no:cacheprovider -q tests/test_dp_multigpu.py 2>&1 | tail -3 | tee "$OUT/multigpu_tests.txt" || rc=1
fi
if [[ $what == integrity || $what == all ]]; then
  # Issue 19 on the GPU: the locating decoder and the scrub on a CUDA pool (side-stream
  # check), faultkit's corrupt mode under leto run (parity repaired, device pages ->
  # verified checkpoint), and the example job's kill/abort matrix with the scrub on.
  timeout 580 python3 -m pytest -p no:cacheprovider -q -rs tests/test_locate.py tests/test_scrub.py \
    tests/test_integrity_gpu.py tests/test_dp_gpu.py 2>&1 | tail -25 | tee "$OUT/integrity_tests.txt" || rc=1
fi
if [[ $what == scrub-bench ]]; then
  # The background scrub's cost at leto run's default rate (64 MiB of data per
  # iteration), Leto with and without it side by side, 1.01 B GPT, 16 K tokens, H1 = 4.
  M="--device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 16 --seq 1024"
  # One whole group (2 GiB) per iteration: the cost of checking a group, side by side.
  python3 -m bench.rmu_overhead $M --iters 4 --warmup 2 --tier1-pages 4 --scrub-mib 2048 \
    --scrub-compare --json-out "$OUT/scrub_group_16k.json" 2>&1 | tee "$OUT/scrub_group_16k.txt" || rc=1
  # The default rate: a group every 32 iterations, so the timed window is 40 iterations.
  python3 -m bench.rmu_overhead $M --iters 40 --warmup 2 --tier1-pages 4 --scrub-mib 64 \
    --scrub-compare --json-out "$OUT/scrub_16k.json" 2>&1 | tee "$OUT/scrub_16k.txt" || rc=1
fi
if [[ $what == run-api ]]; then
  # Issue 16 on two GPUs (nvidia-h200-x2): the script's own optimizers through the updater
  # on CUDA, the ported Hugging Face Llama against torchrun + DDP (NCCL) fault-free and
  # after a kill, and the example job (a plain script on leto.Run) killed on either GPU.
  python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tee "$OUT/run_api_env.txt"
  timeout 560 python3 -m pytest -p no:cacheprovider -q -rs tests/test_user_optim.py tests/test_porting.py \
    tests/test_dp_multigpu.py 2>&1 | tail -25 | tee "$OUT/run_api_tests.txt" || rc=1
fi
if [[ $what == chunk-pass || $what == all ]]; then
  # Issue 15 item 3: the fused chunk pass. Torch's own fused Adam arithmetic (what the
  # kernel mirrors and its start-up self-check compares with), the pass's bytes against
  # the unfused steps and a plain torch loop, its trip-wire; then the overhead with the
  # pass and without it side by side, 16 K tokens, and with it at 128 K, H1 = 4.
  python3 -c 'import os, torch; print(open(os.path.join(os.path.dirname(torch.__file__), "include/ATen/native/cuda/fused_adam_utils.cuh")).read())' \
    | sed -n '/C10_DEVICE inline void adam_math/,/Store results/p' > "$OUT/torch_adam_math.txt"
  timeout 400 python3 -m pytest -p no:cacheprovider -q -rfEs --tb=short -W ignore::pytest.PytestUnraisableExceptionWarning \
    tests/test_chunk_pass.py tests/test_user_optim.py > "$OUT/chunk_pass_tests.txt" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/chunk_pass_tests.txt" | tail -30
  M="--device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 16 --seq 1024 --tier1-pages 4"
  python3 -m bench.rmu_overhead $M --iters 4 --warmup 2 --unfused-compare \
    --json-out "$OUT/overhead_16k_pass.json" 2>&1 | tee "$OUT/overhead_16k_pass.txt" || rc=1
  python3 -m bench.rmu_overhead $M --micro-batches 8 --iters 3 --warmup 1 \
    --json-out "$OUT/overhead_128k_pass.json" 2>&1 | tee "$OUT/overhead_128k_pass.txt" || rc=1
fi
if [[ $what == overhead-chunks ]]; then
  # Larger chunks: fewer marker writes and launches per iteration (the undo buffer grows,
  # lent to activations), leto.Run's path, 16 K tokens, H1 = 4.
  M="--device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 16 --seq 1024 --tier1-pages 4"
  for cu in ${LETO_CHUNK_UNITS:-128 256}; do
    python3 -m bench.rmu_overhead $M --iters 4 --warmup 2 --chunk-units $cu \
      --json-out "$OUT/overhead_16k_cu$cu.json" 2>&1 | tee "$OUT/overhead_16k_cu$cu.txt" || rc=1
  done
fi
if [[ $what == overhead-run ]]; then
  # Issue 15 through leto.Run's path (the script's torch.optim.AdamW(fused=True), clipped
  # by the script in place) beside the updater's own AdamWConfig path, 16 K tokens, then
  # 128 K (8 micro-batches), H1 = 4.
  M="--device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 16 --seq 1024 --tier1-pages 4"
  for o in script config; do
    python3 -m bench.rmu_overhead $M --iters 4 --warmup 2 --leto-optimizer $o \
      --json-out "$OUT/overhead_16k_$o.json" 2>&1 | tee "$OUT/overhead_16k_$o.txt" || rc=1
  done
  python3 -m bench.rmu_overhead $M --micro-batches 8 --iters 3 --warmup 1 \
    --json-out "$OUT/overhead_128k_script.json" 2>&1 | tee "$OUT/overhead_128k_script.txt" || rc=1
fi
if [[ $what == overhead || $what == all ]]; then
  # Issue 15: steady-state overhead against the loop users run (fused AdamW, clip foreach,
  # bf16 autocast, TF32, SDPA), 1.01 B parameters, 16 K and 128 K tokens per iteration;
  # the optimizer's bit-identity to AdamW(fused=True) on CUDA first.
  python3 -m pytest -p no:cacheprovider -q tests/test_optim.py tests/test_rmu_gpu.py \
    ${LETO_OVERHEAD_TESTS:-tests/test_codec_gpu.py tests/test_tripwire.py} 2>&1 | tee "$OUT/overhead_gpu_tests.txt" || rc=1
  M="--device cuda --n-layer 20 --n-embd 2048 --n-head 16 --batch 16 --seq 1024"
  for h1 in ${LETO_H1S:-16 4}; do
    python3 -m bench.rmu_overhead $M --iters 4 --warmup 2 --tier1-pages $h1 \
      --json-out "$OUT/overhead_16k_h$h1.json" 2>&1 | tee "$OUT/overhead_16k_h$h1.txt" || rc=1
  done
  for h1 in ${LETO_H1S_128K:-4}; do
    python3 -m bench.rmu_overhead $M --micro-batches 8 --iters 3 --warmup 1 --tier1-pages $h1 \
      --json-out "$OUT/overhead_128k_h$h1.json" 2>&1 | tee "$OUT/overhead_128k_h$h1.txt" || rc=1
  done
fi
if [[ $what == abort || $what == all ]]; then
  # The trip-wire in Leto's kernels (codec, copy) and the example job under leto run on the GPU.
  python3 -m pytest -p no:cacheprovider -q tests/test_tripwire.py tests/test_codec_gpu.py \
    tests/test_dp_gpu.py 2>&1 | tee "$OUT/abort_gpu_tests.txt" || rc=1
fi
if [[ $what == faultkit-abort || $what == all ]]; then
  python3 -m faultkit.cli matrix --device cuda --world-size 1 --iterations 4 \
    --modes kernel-abort 2>&1 | tee "$OUT/faultkit_matrix_abort_cuda.txt" || rc=1
fi
if [[ $what == faultkit || $what == all ]]; then
  python3 -m faultkit.cli matrix --device cuda --world-size 1 --iterations 4 \
    --phases update,parity-copy,grad-parity 2>&1 | tee "$OUT/faultkit_matrix_cuda.txt" || rc=1
fi
if [[ $what == runtime || $what == all ]]; then
  # The verifiers' digest on the GPU (every recovery's exactness check hashes 16 GB), and
  # a premapped shadow's remap of lost VMM pages (issue 17).
  python3 -m pytest -p no:cacheprovider -q tests/test_digest.py tests/test_pool_gpu.py 2>&1 | tail -3 | tee "$OUT/runtime_gpu_tests.txt" || rc=1
  # HOF recovery on one H200 (NCCL, world size 1) with a >= 1 B-parameter GPT: L3 (its
  # shadow premapped the pool) against the torchrun + checkpoint baseline, then L3 without
  # premapping; each recovering trainer profiled.
  timeout 570 python3 -m bench.recovery_speed --device cuda --nproc-per-node 1 --iterations 6 --fail-at 4 \
    --checkpoint-interval 3 --variants "${LETO_VARIANTS:-L3,torchrun + checkpoint,L3 (attach cold)}" \
    --profile-recovery "$OUT/profiles" --json-out "$OUT/recovery_speed_cuda.json" \
    --model --n-layer 20 --n-embd 2048 --n-head 16 --chunk-units 64 2>&1 | tee "$OUT/recovery_speed_cuda.txt" || rc=1
fi
if [[ $what == scale ]]; then
  # Issue 17 items 3 and 5: HOF recovery time against state size on one H200 (fp32 +
  # AdamW: 16 bytes a parameter retained), in-place variants side by side with torchrun +
  # DCP. LETO_SCALE: "size|variants|seconds[|fault mode[|failing ranks]]" entries separated
  # by ';', run in order, each under its own time limit, or "rest" (results are written
  # after every variant); the fault mode is kill (default) or kill-synced
  # (bench.recovery_speed --fault-mode), the failing ranks 0 (default) or e.g. 0,1.
  # LETO_SCALE_NPROC=2 (nvidia-h200-x2: item 4) runs every entry at world 2, one GPU a
  # rank, each holding the whole size's state (data parallel: same state per GPU).
  # LETO_SCALE_REF=DIR keeps each size's fault-free reference in DIR/<size> (returned as
  # $OUT/scale_ref.tgz, to carry into a later call, see below: the 5 B one is ~2-4
  # minutes);
  # LETO_SCALE_PROFILE=1 (or a fault mode ending in +profile, for one entry) profiles
  # recoveries and first iterations (leto.trainer.profiling: the overhead is in those
  # figures). The baseline's
  # one checkpoint goes to RAM (/dev/shm) when it fits there: the fastest storage a user
  # could give it; else to the disk.
  if [[ ${LETO_SCALE_TESTS:-1} == 1 ]]; then
    # Premapping; the native loss scan over the driver; the shadow warm-ups (script,
    # verifiers, lending workspaces) on the GPU. One pytest per file, so a crash names its
    # file; the full output is in scale_art.tgz, each file's last line in scale_tests.txt.
    for t in "tests/test_pool_gpu.py -k premap" tests/test_backend_cuda.py tests/test_scan.py \
        tests/test_warmup.py tests/test_digest.py tests/test_lending.py; do
      timeout 120 python3 -m pytest -p no:cacheprovider -q -rfE $t > "$OUT/test_out.txt" 2>&1
      trc=$?; (( trc )) && rc=1
      { echo "== $t (rc $trc)"; cat "$OUT/test_out.txt"; } >> "$OUT/scale_tests_full.txt"
      echo "$t: rc $trc: $(grep -E '(passed|failed|error)' "$OUT/test_out.txt" | tail -1)" | tee -a "$OUT/scale_tests.txt"
    done
    rm -f "$OUT/test_out.txt"
  fi
  { df -BG /tmp /dev/shm; free -g; echo "nofile soft $(ulimit -Sn) hard $(ulimit -Hn) nr_open $(cat /proc/sys/fs/nr_open)"
    # Huge shmem pages would cut the host parity scan's page-table walk (localization).
    echo "THP shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled) enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
  } 2>&1 | tee "$OUT/scale_machine.txt"
  IFS=';' read -ra entries <<< "${LETO_SCALE:-1b|L3,torchrun + checkpoint,L2,L1|300}"
  for entry in "${entries[@]}"; do
    IFS='|' read -r size variants secs mode ranks <<< "$entry"
    mode=${mode:-kill} ranks=${ranks:-0} nproc=${LETO_SCALE_NPROC:-1} profile=${LETO_SCALE_PROFILE:-}
    [[ $mode == *+profile ]] && { profile=1; mode=${mode%+profile}; }
    # "rest": what is left of the device call (LETO_SCALE_END seconds after the start).
    [[ $secs == rest ]] && secs=$(( ${LETO_SCALE_END:-585} - SECONDS ))
    case $size in  # (iterations, the in-place variants' failure, model)
      1b) its=6 at=4 M="--n-layer 20 --n-embd 2048 --n-head 16" ckpt_gb=13 ;;
      3b) its=5 at=3 M="--n-layer 26 --n-embd 3072 --n-head 24" ckpt_gb=38 ;;
      5b) its=5 at=3 M="--n-layer 25 --n-embd 4096 --n-head 32" ckpt_gb=65 ;;
      *) echo "LETO_SCALE: unknown size $size (1b, 3b, 5b)"; rc=1; continue ;;
    esac
    ck=/dev/shm/leto-ckpt
    # tmpfs needs room for the files and DCP's staging copy in the same RAM.
    if (( $(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9) < ckpt_gb * 5 / 2 )); then ck=/tmp/leto-ckpt; fi
    # scale_5b, scale_5b-synced, scale_1b-w2-r0_1
    name=scale_$size${mode/#kill/}${profile:+-profiled}
    ref=$size  # a kept reference is for one world size (bench.recovery_speed refuses others)
    (( nproc > 1 )) && { name+=-w$nproc-r${ranks//,/_}; ref+=-w$nproc; }
    echo "== $size: $variants, $mode, world $nproc, ranks $ranks failing (limit $secs s, checkpoints in $ck)" | tee -a "$OUT/scale_machine.txt"
    timeout "$secs" python3 -m bench.recovery_speed --device cuda --nproc-per-node $nproc --iterations $its \
      --fail-at $at --ranks $ranks --fault-mode $mode --checkpoints baseline --checkpoint-dir $ck --variants "$variants" \
      ${LETO_SCALE_REF:+--reference-dir "$LETO_SCALE_REF/$ref"} \
      ${profile:+--profile-recovery "$OUT/profiles_$name"} \
      --json-out "$OUT/$name.json" --model $M --chunk-units 64 2>&1 | tee "$OUT/$name.txt" || rc=1
    # A time limit stops the bench, not the leto run it started: stop that job (SIGTERM
    # ends its trainers, shadows and state managers) before the next size needs the GPU.
    pkill -TERM -f "leto.cli run" && sleep 8
    pkill -KILL -f "leto.memory.state_manager|examples/train_gpt.py"
    # The jobs' logs (agent, trainers, state managers; the last 200 KB of each) and the
    # profiles, one archive each: the device tool returns only a few files per call.
    logs=$(mktemp -d)
    for f in /tmp/leto-recovery-speed-*/*/logs/*.log; do
      [[ -f $f ]] || continue
      d="$logs/$(basename "$(dirname "$(dirname "$f")")")"; mkdir -p "$d"
      tail -c 200000 "$f" > "$d/$(basename "$f")"
    done
    tar czf "$OUT/logs_$name.tgz" -C "$logs" . && rm -rf "$logs"
    if [[ -d $OUT/profiles_$name ]]; then
      tar czf "$OUT/profiles_$name.tgz" -C "$OUT/profiles_$name" . && rm -rf "$OUT/profiles_$name"
    fi
    rm -rf "$ck" /tmp/leto-recovery-speed-*
  done
  # The kept references (verifiers' traces: digests, a few KB) come back in one archive;
  # unpacked into .gpu-results/scale-ref (ignored by git) they are carried into a later
  # call (run's carry=[".gpu-results/scale-ref"], LETO_SCALE_REF=.gpu-results/scale-ref):
  # a 5 B baseline (~470 s) then fits a call without its ~4-minute reference run.
  if [[ -n ${LETO_SCALE_REF:-} && -d $LETO_SCALE_REF ]]; then
    tar czf "$OUT/scale_ref.tgz" -C "$LETO_SCALE_REF" . || rc=1
  fi
  # At most 8 files come back from a call: the figures (JSON), the tests' summary and
  # the reference stay loose; the rest (bench output, full test output, jobs' logs,
  # profiles) is one archive.
  (cd "$OUT" && shopt -s nullglob && art=(scale_*.txt logs_*.tgz profiles_*.tgz) &&
    tar czf scale_art.tgz "${art[@]}" && for f in "${art[@]}"; do [[ $f == scale_tests.txt ]] || rm -f "$f"; done) || rc=1
fi
if [[ $what == preinit || $what == all ]]; then
  # Issue 8: footprints per level and reclamation latency, the allocation-path hook on real
  # device memory, and leto run --shadow-level auto end to end (with those footprints).
  python3 -m bench.preinit_footprint --repeats 3 --json-out "$OUT/preinit_footprint.json" 2>&1 | tee "$OUT/preinit_footprint.txt" || rc=1
  LETO_TEST_FOOTPRINTS="$OUT/preinit_footprint.json" python3 -m pytest -p no:cacheprovider -q -s \
    tests/test_preinit_gpu.py tests/test_preinit_runtime_gpu.py --basetemp "$OUT/preinit_runs" 2>&1 | tee "$OUT/preinit_gpu_tests.txt" || rc=1
  find "$OUT/preinit_runs" -name '*.pt' -delete 2>/dev/null
  # The device tool returns a few shallow files only: the controlled run's summary and
  # memory timeline, flat.
  mkdir -p "$OUT/preinit_art"
  for d in "$OUT"/preinit_runs/test_under_the_controller*0/; do
    [[ -d $d ]] || continue
    cp "$d/summary.json" "$OUT/preinit_art/summary.json" 2>/dev/null
    cp "$d"/logs/rank0.memory.json "$d"/logs/rank0.memory.png "$OUT/preinit_art/" 2>/dev/null
  done
  [[ $rc == 0 ]] && rm -rf "$OUT/preinit_runs"  # kept for a look when something failed
fi
if [[ $what == userpath ]]; then
  # The overhead users see (bench/user_path.py): examples/porting/gpt_torchrun.py under
  # torchrun beside its Leto port under leto run with its default flags, 1.11 B GPT on
  # one H200; 12 iterations, median and max over iterations 4+, every iteration listed.
  # First the GPU tests of what the steady iteration runs (marker, updater, chunk pass,
  # the script's optimizers). 16 K tokens: also leto run with everything optional off
  # (the floor), and one iteration profiled (the third, inside the skipped ones:
  # LETO_PROFILE_RECOVERY). 128 K tokens: deterministic, so the two runs' bytes compare.
  # LETO_USERPATH_QUICK=1: the two presets' torchrun and leto run defaults only.
  if [[ ${LETO_USERPATH_QUICK:-0} == 0 ]]; then
    timeout 240 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_marker.py tests/test_staging.py \
      tests/test_rmu_gpu.py tests/test_chunk_pass.py tests/test_user_optim.py 2>&1 | tail -4 \
      | tee "$OUT/userpath_gpu_tests.txt" || rc=1
    LETO_PROFILE_RECOVERY=/tmp/userpath_prof python3 -m bench.user_path --preset h200-1b \
      --iterations 12 --skip 4 --timeout-s 200 \
      --leto-variant "floor=--shadow-level off --no-checkpoints --scrub-mib-per-iteration 0" \
      --json "$OUT/userpath_h200-1b.json" 2>&1 | tee "$OUT/userpath_h200-1b.txt" || rc=1
    tar czf "$OUT/userpath_prof.tgz" -C /tmp userpath_prof 2>/dev/null
  else
    timeout 60 python3 -m pytest -p no:cacheprovider -q tests/test_staging.py 2>&1 | tail -2 \
      | tee "$OUT/userpath_gpu_tests.txt" || rc=1
    python3 -m bench.user_path --preset h200-1b --iterations 12 --skip 4 --timeout-s 200 \
      --json "$OUT/userpath_h200-1b.json" 2>&1 | tee "$OUT/userpath_h200-1b.txt" || rc=1
  fi
  python3 -m bench.user_path --preset h200-1b-128k --iterations ${LETO_USERPATH_128K_ITERS:-10} \
    --skip 4 --timeout-s 200 --script-args=--deterministic \
    --json "$OUT/userpath_h200-1b-128k.json" 2>&1 | tee "$OUT/userpath_h200-1b-128k.txt" || rc=1
fi
if [[ $what == plain-recovery ]]; then
  # Issue 37 on the GPU: a plain script's L3 recovery (examples/porting/gpt_leto.py at
  # 1.11 B parameters, 16 K tokens), the kill in the forward: to training, regained,
  # and what the promoted trainer still imported (the goal: nothing); each trial with and
  # without the parked shadow's generic warm-up (the script gives none).
  python3 -m bench.plain_recovery --device cuda --nproc-per-node 1 --shadow-level L3 \
    --trials ${LETO_PLAIN_TRIALS:-2} --iterations 8 --warmup ${LETO_PLAIN_WARMUP:-both} \
    --script-args="--n-layer 20 --n-embd 2048 --n-head 16 --vocab 50304 --seq 1024 --batch 16" \
    --json-out "$OUT/plain_recovery_h200.json" 2>&1 | tee "$OUT/plain_recovery_h200.txt" || rc=1
fi
if [[ $what == moe ]]; then
  # Issue 35 on one H200, world 1 (every expert on the one rank): faultkit's EP job killed
  # in the update with 4 pages lost, a kernel abort in the update, kill at every phase;
  # the dense example the same way for its recovery beside it; then the user path, the MoE
  # example under torchrun and under leto run, and a dense GPT of a similar shape.
  fk() { timeout 300 python3 -m faultkit.cli "$@" --device cuda --world-size 1 --json; }
  fk inject --parallel ep --phase update --pages 4 > "$OUT/moe_inject.json" 2>"$OUT/moe_err.txt" || rc=1
  fk inject --parallel ep --phase update --mode kernel-abort > "$OUT/moe_abort.json" 2>>"$OUT/moe_err.txt" || rc=1
  fk matrix --parallel ep --modes kill --losses alternate > "$OUT/moe_matrix.json" 2>>"$OUT/moe_err.txt" || rc=1
  fk inject --parallel dp --phase update --pages 4 > "$OUT/dense_inject.json" 2>>"$OUT/moe_err.txt" || rc=1
  tail -c 3000 "$OUT/moe_err.txt"
fi
if [[ $what == moe || $what == moe-userpath ]]; then
  # (A call returns at most 8 files: moe-userpath alone when the section above ran before.)
  timeout 200 python3 -m bench.user_path --job moe --device cuda --nproc-per-node 1 --iterations 30 --skip 5 \
    --json "$OUT/moe_userpath.json" > "$OUT/moe_userpath.txt" 2>&1 || rc=1
  timeout 200 python3 -m bench.user_path --device cuda --nproc-per-node 1 --iterations 30 --skip 5 \
    --script-args="--n-layer 2 --n-embd 64 --n-head 2 --vocab 257 --seq 32 --batch 4 --accum 1" \
    --json "$OUT/dense_userpath.json" > "$OUT/dense_userpath.txt" 2>&1 || rc=1
fi
if [[ $what == replay-gpu || $what == sdc ]]; then
  # Issue 33's checks on CUDA, in-process (one GPU): a captured micro-batch replayed
  # bit-identically under bf16 autocast, this rank's state left alone; the update
  # recheck (fused CUDA pass against torch's fused AdamW) changes no byte and finds a
  # wrong value; the replica check's deferred digests copied in stream order.
  timeout 240 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_replay.py tests/test_recheck.py \
    tests/test_replica.py \
    2>&1 | tail -3 | tee "$OUT/replay_gpu_tests.txt" || rc=1
fi
if [[ $what == sdc ]]; then
  # Issue 33 on one H200 (world 1: no replica, so the update recheck is what checks the
  # update): faultkit's sdc-update found and EXACT; then the user path at 16 K tokens,
  # leto run's defaults (the recheck on) beside --no-replica-check (the recheck off).
  timeout 300 python3 -m faultkit.cli inject --device cuda --world-size 1 --mode sdc-update \
    --phase update --json > "$OUT/sdc_update_cuda.json" 2>"$OUT/sdc_err.txt" || rc=1
  timeout 400 python3 -m bench.user_path --preset h200-1b --iterations 12 --skip 4 --timeout-s 200 \
    --leto-variant "norecheck=--no-replica-check" \
    --json "$OUT/userpath_recheck.json" > "$OUT/userpath_recheck.txt" 2>&1 || rc=1
  tail -c 2500 "$OUT/userpath_recheck.txt"
fi
if [[ $what == sdc-userpath ]]; then
  # The update recheck's cost on the user path (16 K tokens, one H200): leto run's
  # defaults beside --no-replica-check, twice in alternating order, deterministic
  # algorithms on so that the bytes are compared too (a false alarm would be fatal).
  timeout 580 python3 -m bench.user_path --preset h200-1b --iterations 12 --skip 4 --timeout-s 200 \
    --script-args=--deterministic --repeats 2 --leto-variant "norecheck=--no-replica-check" \
    --json "$OUT/userpath_recheck.json" > "$OUT/userpath_recheck.txt" 2>&1 || rc=1
  tail -c 4000 "$OUT/userpath_recheck.txt"
fi
if [[ $what == zoo ]]; then
  # The issue "Real models on the GPU": the fused pass's exactness in every value regime
  # (denormal moments included), then the model zoo (bench/zoo) at ~1 B parameters —
  # torchrun vs leto run with every chunk rechecked, bit for bit, zero alarms — and the
  # tiny cases with a rank killed in the update (LETO_ZOO_CASES / LETO_ZOO_SIZE override).
  timeout 200 python3 -m pytest -p no:cacheprovider -q tests/test_chunk_pass.py tests/test_recheck.py \
    2>&1 | tail -3 | tee "$OUT/zoo_gpu_tests.txt" || rc=1
  # LETO_ZOO_KILL: the cases that also get the killed run (default none).
  kill=${LETO_ZOO_KILL:+--kill-cases $LETO_ZOO_KILL}
  timeout ${LETO_ZOO_TIMEOUT:-560} python3 -m bench.zoo --device cuda --size ${LETO_ZOO_SIZE:-large} \
    --cases ${LETO_ZOO_CASES:-tied} ${kill:---no-kill} --json "$OUT/zoo_cuda.json" 2>&1 | tee "$OUT/zoo_cuda.txt" || rc=1
fi
if [[ $what == zoo-only ]]; then
  # The zoo alone (the same variables as "zoo"), for cases that need the whole call.
  kill=${LETO_ZOO_KILL:+--kill-cases $LETO_ZOO_KILL}
  timeout ${LETO_ZOO_TIMEOUT:-580} python3 -m bench.zoo --device cuda --size ${LETO_ZOO_SIZE:-large} \
    --cases ${LETO_ZOO_CASES:-tied} ${kill:---no-kill} --json "$OUT/zoo_cuda.json" 2>&1 | tee "$OUT/zoo_cuda.txt" || rc=1
fi
if [[ $what == certify ]]; then
  # faultkit certify on the GPU: the nanoGPT-style port (a small shape), one rank, killed
  # at every phase with pages lost, against its fault-free run.
  timeout ${LETO_CERTIFY_TIMEOUT:-300} python3 -m faultkit.cli certify --device cuda --json \
    -- examples/porting/gpt_leto.py --n-layer 2 --n-embd 256 --n-head 4 --vocab 4096 --seq 128 \
    --batch 4 --iterations 10 --deterministic > "$OUT/certify_cuda.json" 2> "$OUT/certify_cuda.txt" || rc=1
  tail -c 1500 "$OUT/certify_cuda.txt"; python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print(v['verdict'], [(r['phase'], r['exact']) for r in v['faults']], v['first_divergence'], round(v['total_s']))" "$OUT/certify_cuda.json"
fi
if [[ $what == certify-1b ]]; then
  # Issue 57 item 4: faultkit certify of the 1.1 B plain port (16 K tokens an iteration,
  # deterministic), one rank killed at every phase with pages lost; each fault now meets
  # parked shadows (when: parked). Its total against the same runs under leto run's
  # defaults (its reference and its faulted run: twice the plain run's wall time).
  # LETO_C1B_PARTS picks (default both, in order): certify, plain (one 600 s call may not
  # hold both).
  parts=${LETO_C1B_PARTS:-certify plain}
  C1B="examples/porting/gpt_leto.py --n-layer 20 --n-embd 2048 --n-head 16 --vocab 50304 \
    --seq 1024 --batch 16 --iterations ${LETO_CERTIFY_ITERS:-24} --deterministic"
  if [[ " $parts " == *" certify "* ]]; then
    timeout ${LETO_CERTIFY_TIMEOUT:-590} python3 -m faultkit.cli certify --device cuda --json \
      -- $C1B > "$OUT/certify_1b.json" 2> "$OUT/certify_1b.txt" || rc=1
    tail -c 1500 "$OUT/certify_1b.txt"; python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print(v['verdict'], [(r['phase'], r['exact'], r['recovery_s']) for r in v['faults']], round(v['reference_run_s']), round(v['total_s']))" "$OUT/certify_1b.json"
  fi
  if [[ " $parts " == *" plain "* ]]; then
    w=$(mktemp -d); s0=$(date +%s.%N)
    (cd "$w" && timeout ${LETO_C1B_PLAIN_TIMEOUT:-300} python3 -m leto.cli run --device cuda --nproc-per-node 1 \
      "$OLDPWD/"$C1B --out out) > "$OUT/certify_1b_plain.txt" 2>&1 || rc=1
    echo "plain leto run (defaults) of the certified script: $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" $s0 $(date +%s.%N)) s" | tee -a "$OUT/certify_1b_plain.txt"
    tail -5 "$OUT/certify_1b_plain.txt"
  fi
fi
if [[ $what == titan* ]]; then
  # torchtitan 0.2.2 under Leto (issue 45). torchtitan and what it needs beyond the
  # machine's packages travel as wheels in .whl (docs/porting.md, "torchtitan"):
  # titan-exact, titan-certify, titan-overhead, titan-recovery, or titan for all four.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/titan-site .whl/*.whl || rc=1
  export PYTHONPATH=$PYTHONPATH:/tmp/titan-site HF_DATASETS_OFFLINE=1
  if [[ $what == titan || $what == titan-exact ]]; then
    # The debug model, deterministic: torchrun -m torchtitan.train against leto run -m
    # leto.titan.train (defaults), checkpoint and losses bit for bit.
    timeout 420 python3 -m bench.titan_path exact --steps 20 --timeout-s 200 \
      --json "$OUT/titan_exact.json" 2>&1 | tail -30 | tee "$OUT/titan_exact.txt" || rc=1
  fi
  if [[ $what == titan || $what == titan-certify ]]; then
    # Killed at every phase (forward/backward, the update and the rest) with pages lost.
    timeout 420 python3 -m faultkit.cli certify --device cuda --json -- \
      examples/titan/debug_job.py --iterations 9 > "$OUT/titan_certify.json" 2> "$OUT/titan_certify.txt" || rc=1
    tail -c 1500 "$OUT/titan_certify.txt"
  fi
  if [[ $what == titan || $what == titan-overhead ]]; then
    # Llama 3.2 1B's shape, 16 K tokens a step: torchtitan's tokens/s, torchrun vs leto run.
    timeout 540 python3 -m bench.titan_path overhead --steps ${LETO_TITAN_STEPS:-30} --skip 10 \
      --timeout-s 260 --json "$OUT/titan_overhead.json" 2>&1 | tail -40 | tee "$OUT/titan_overhead.txt" || rc=1
  fi
  if [[ $what == titan || $what == titan-recovery ]]; then
    # L3 recovery of the 1B model: kill in the forward of step 5 → training again.
    timeout 400 python3 -m bench.plain_recovery --device cuda --nproc-per-node 1 --shadow-level L3 \
      --trials 1 --iterations 8 --warmup generic --script examples/titan/debug_job.py \
      --script-args="--experimental.custom_import examples.titan.flavors --model.flavor 1B --training.seq_len 4096 --training.local_batch_size 4 --checkpoint.no-enable --metrics.no-enable_tensorboard" \
      --json-out "$OUT/titan_recovery.json" 2>&1 | tail -20 | tee "$OUT/titan_recovery.txt" || rc=1
  fi
fi
if [[ $what == world2-* ]]; then
  # Issue 47: world 2 (and 4) on one GPU, the ranks sharing it over gloo (leto run
  # --ranks-per-gpu). bench/world2.py runs a target's lanes at once within a budget and
  # prints a table (docs/runtime.md, "Several ranks on one GPU", says what each runs):
  # world2-certify (the example job killed at every phase; LETO_W2_PHASES: fewer),
  # world2-matrix, world2-sdc, world2-parallel, world2-ports, world2-costs, world2-megatron — one device
  # call each (<= 10 min) — or world2-shared: all of them in turn (~1 h: by hand, not in
  # one call). LETO_W2_BUDGET: seconds per target (530); LETO_W2_LANES: lanes at once (4);
  # LETO_W2_ONLY: comma-separated steps (a failed one again, say).
  t=${what#world2-}; [[ $t == shared ]] && t=all
  if [[ $t == megatron || $t == all ]]; then  # (world2-megatron: carry .whl, megatron-core's wheel)
    megatron_core
  fi
  budget=${LETO_W2_BUDGET:-530}; n=1; [[ $t == all ]] && n=8
  # Each target its own folder: two targets may run at once (one call, two lanes' worth).
  timeout $(( n * (budget + 40) )) python3 -m bench.world2 "$t" --out "$OUT/w2-$t" --budget-s "$budget" \
    --lanes "${LETO_W2_LANES:-4}" ${LETO_W2_ONLY:+--only "$LETO_W2_ONLY"} > "$OUT/w2_$t.txt" 2>&1 || rc=1
  # At most 8 files come back from a call: the table stays loose, each step's JSON and
  # log go in one archive.
  tar czf "$OUT/w2_$t.tgz" -C "$OUT" "w2-$t" && rm -rf "$OUT/w2-$t"
  tail -c 6000 "$OUT/w2_$t.txt"
fi
if [[ $what == sdc-inject ]]; then
  # faultkit's sdc-update at world 1 on the GPU: the update recheck finds it, EXACT.
  timeout 200 python3 -m faultkit.cli inject --device cuda --world-size 1 --mode sdc-update \
    --phase update --json > "$OUT/sdc_update_cuda.json" 2>"$OUT/sdc_err.txt" || rc=1
  tail -c 600 "$OUT/sdc_err.txt"; python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print({k: v.get(k) for k in ('exact','detected','detected_by','detected_at','named_rank','rolled_back','first_divergence')})" "$OUT/sdc_update_cuda.json"
fi
if [[ $what == breakdown ]]; then
  # Issue 46's breakdown: the GPU time of each piece leto run (defaults) adds to an
  # iteration of the 1.1 B nanoGPT-style port (torch.profiler on rank 0, Leto's named
  # ranges), at 16 K and 128 K tokens an iteration, beside torch's fused AdamW on the
  # same parameters (in-process). LETO_BD_PRESETS: which.
  for p in ${LETO_BD_PRESETS:-h200-1b h200-1b-128k}; do
    timeout ${LETO_BD_TIMEOUT:-280} python3 -m bench.update_breakdown --preset $p --window 4:3 \
      --script-args="--deterministic --tokens zipf" --timeout-s 260 \
      --json "$OUT/breakdown_$p.json" > "$OUT/breakdown_$p.txt" 2>&1 || rc=1
    tail -c 2500 "$OUT/breakdown_$p.txt"
  done
fi
if [[ $what == gpu-tests ]]; then
  # Every GPU unit test in one go (pytest -m "gpu and not integ": no leto run jobs), e.g.
  # after a change that moves code: the kernels, pools, chunk pass, checks and preinit.
  # Left out: CPU-only modules whose oracles (galois, torchdata) the GPU machine lacks.
  # One line a test, written as it ends (a timeout still shows how far it got); a test
  # stuck for 120 s gets its stacks dumped.
  timeout ${LETO_GPU_TESTS_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -v -rfEs \
    --durations=15 -o faulthandler_timeout=120 -m "gpu and not integ" \
    --ignore=tests/test_field.py --ignore=tests/test_kernels.py \
    --ignore=tests/test_data_state.py ${LETO_GPU_TESTS_FILES:-tests/} > "$OUT/gpu_unit_tests.txt" 2>&1 || rc=1
  grep -E "FAILED|ERROR|passed|failed|Timeout" "$OUT/gpu_unit_tests.txt" | tail -30
fi
if [[ $what == horner ]]; then
  # Issue 46 item 4: parity by the code's Horner scheme (H1 <= 4; leto.erasure.horner).
  # Its kernels' bytes against the table kernels and the unfused steps (every H1 from 1
  # to 16), then the codec at H = 4 with the scheme and with the table kernels
  # (LETO_HORNER=0) side by side, then faultkit's kill and kernel abort inside the update.
  timeout 300 python3 -m pytest -p no:cacheprovider -q -rfEs --tb=short -m gpu \
    -W ignore::pytest.PytestUnraisableExceptionWarning tests/test_horner.py tests/test_chunk_pass.py \
    tests/test_codec_gpu.py tests/test_locate.py > "$OUT/horner_tests.txt" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed|rror" "$OUT/horner_tests.txt" | tail -30
  for env in 1 0; do
    LETO_HORNER=$env timeout 120 python3 -m bench.codec --device cuda --parity-pages 4 --lost 4 --reps 10 \
      --json-out "$OUT/codec_h4_horner$env.json" > "$OUT/codec_h4_horner$env.txt" 2>&1 || rc=1
    echo "LETO_HORNER=$env"; tail -12 "$OUT/codec_h4_horner$env.txt"
  done
  timeout 240 python3 -m faultkit.cli matrix --device cuda --world-size 1 --iterations 4 \
    --phases update --modes kill,kernel-abort 2>&1 | tail -15 | tee "$OUT/horner_faultkit.txt" || rc=1
fi
if [[ $what == horner-userpath ]]; then
  # The user path with the Horner scheme (leto run's defaults) and with the table kernels
  # (LETO_HORNER=0), against torchrun, in one run (LETO_HU_PRESET: 16 K or 128 K tokens).
  timeout ${LETO_HU_TIMEOUT:-560} python3 -m bench.user_path --preset ${LETO_HU_PRESET:-h200-1b} \
    --iterations ${LETO_HU_ITERS:-8} --skip 3 --timeout-s 200 --script-args="--deterministic --tokens zipf" \
    --leto-variant "tables=LETO_HORNER=0" --json "$OUT/horner_userpath.json" > "$OUT/horner_userpath.txt" 2>&1 || rc=1
  tail -c 3000 "$OUT/horner_userpath.txt"
fi
if [[ $what == undo-ahead ]]; then
  # Issue 59: the undo copy beside forward and backward (leto run --undo ahead): its GPU
  # tests (the kernel with the copy on the copy stream, crashes), then the user path at
  # 16 K and 128 K tokens — torchrun, leto run's defaults and --undo ahead side by side,
  # deterministic (bytes compared) — and the breakdown of --undo ahead at 16 K.
  # One 600 s call does not hold all of it: LETO_UA_PARTS picks (default all, in order)
  # tests, h200-1b (16 K), h200-1b-128k, breakdown.
  parts=${LETO_UA_PARTS:-tests h200-1b h200-1b-128k breakdown}
  # The --undo ahead variants beside torchrun and the defaults: where the copy is queued
  # (the iteration's start, or its first gradient). LETO_UA_VARIANTS="name=flags;..."
  # replaces them.
  IFS=';' read -ra vs <<< "${LETO_UA_VARIANTS:-ahead=--undo ahead;ahead-grad=LETO_UNDO_AHEAD_AT=grad --undo ahead}"
  variants=(); for v in "${vs[@]}"; do variants+=(--leto-variant "$v"); done
  [[ " $parts " == *" tests "* ]] && { timeout 200 python3 -m pytest -p no:cacheprovider -q -rfEs \
    -m gpu tests/test_undo_ahead.py 2>&1 | tail -5 | tee "$OUT/undo_ahead_tests.txt" || rc=1; }
  for preset in h200-1b h200-1b-128k; do
    [[ " $parts " == *" $preset "* ]] || continue
    # (LETO_UA_ITERS / LETO_UA_SKIP: a longer window past the start's transients — on an
    # H100, 2026-12-05, Leto's iterations 3-7 rose 297 -> 358 ms while the parked
    # shadow started and the checkpoint stager page-locked its 13 GB beside them)
    iters=${LETO_UA_ITERS:-8}; [[ $preset == *128k ]] && iters=${LETO_UA_ITERS:-6}
    timeout 400 python3 -m bench.user_path --preset $preset --iterations $iters --skip ${LETO_UA_SKIP:-3} \
      --timeout-s 200 --script-args="--deterministic --tokens zipf" \
      "${variants[@]}" --json "$OUT/undo_ahead_$preset.json" \
      > "$OUT/undo_ahead_$preset.txt" 2>&1 || rc=1
    tail -c 2500 "$OUT/undo_ahead_$preset.txt"
  done
  if [[ " $parts " == *" breakdown "* ]]; then
    timeout 300 python3 -m bench.update_breakdown --preset h200-1b --leto-flags="${LETO_UA_BREAKDOWN_FLAGS:---undo ahead}" \
      --window 4:3 --script-args="--deterministic --tokens zipf" --json "$OUT/undo_ahead_breakdown.json" \
      > "$OUT/undo_ahead_breakdown.txt" 2>&1 || rc=1
    tail -c 3000 "$OUT/undo_ahead_breakdown.txt"
  fi
fi
if [[ $what == copy-overlap ]]; then
  # Issue 59: which copy mechanism runs beside compute-bound work (an in-process benchmark
  # of one component: bench/copy_overlap.py).
  timeout 240 python3 -m bench.copy_overlap --gib ${LETO_CO_GIB:-12} --json-out "$OUT/copy_overlap.json" \
    2>&1 | tee "$OUT/copy_overlap.txt" || rc=1
fi
if [[ $what == resumable-pass ]]; then
  # Issue 59: the chunk pass without an undo copy (chunk_pass.cu's chunk_pass_rf_h*).
  # LETO_RP_PARTS picks (default all, in order): bench (an in-process benchmark of one
  # component: its builds side by side), tests (the chunk pass's GPU tests), userpath
  # (the user path at 16 K tokens: torchrun, leto run's defaults and the per-chunk undo
  # copy side by side, deterministic, bytes compared), zoo (real models' shapes killed
  # in the update).
  parts=${LETO_RP_PARTS:-tests bench userpath zoo}
  [[ " $parts " == *" tests "* ]] && { timeout 200 python3 -m pytest -p no:cacheprovider -q -rfEs -m gpu \
    tests/test_chunk_pass.py tests/test_resumable_pass.py ${LETO_RP_MORE_TESTS:-} 2>&1 | tail -6 \
    | tee "$OUT/resumable_tests.txt" || rc=1; }
  [[ " $parts " == *" bench "* ]] && { timeout ${LETO_RP_BENCH_TIMEOUT:-300} python3 -m bench.resumable_pass --repeats 3 2>&1 \
    | tee "$OUT/resumable_pass.txt" | grep -A1 '": {\|bit-ident' | grep -v '^--' || rc=1; }
  if [[ " $parts " == *" userpath "* ]]; then
    timeout 420 python3 -m bench.user_path --preset h200-1b --iterations ${LETO_RP_ITERS:-12} \
      --skip ${LETO_RP_SKIP:-6} --timeout-s 200 --script-args="--deterministic --tokens zipf" \
      --leto-variant "copy=LETO_RESUMABLE_PASS=0" --json "$OUT/resumable_userpath.json" \
      > "$OUT/resumable_userpath.txt" 2>&1 || rc=1
    tail -c 2500 "$OUT/resumable_userpath.txt"
  fi
  if [[ " $parts " == *" zoo "* ]] && (( SECONDS < ${LETO_RP_ZOO_BEFORE:-9999} )); then
    timeout ${LETO_RP_ZOO_TIMEOUT:-300} python3 -m bench.zoo --device cuda --size tiny \
      --cases tied,groups,two-optimizers,fp16 --kill-cases ${LETO_RP_ZOO_KILL:-tied,groups,two-optimizers,fp16} \
      --json "$OUT/resumable_zoo.json" > "$OUT/resumable_zoo.txt" 2>&1 || rc=1
    tail -c 1500 "$OUT/resumable_zoo.txt"
  fi
fi
if [[ $what == clip-parity ]]; then
  # Issue 59 item 2: the gradients' parity taken in the script's clip_grad_norm_ pass
  # (leto.update.grad_clip, grad_clip.cu). LETO_CP_PARTS picks (default all, in order):
  # tests (its GPU tests, the chunk pass's and the resumable pass's), userpath (16 K
  # tokens: torchrun, leto run's defaults and LETO_CLIP_PARITY=0 side by side,
  # deterministic, bytes compared), zoo (real models' shapes, killed in the update),
  # breakdown (16 K).
  parts=${LETO_CP_PARTS:-tests userpath zoo}
  [[ " $parts " == *" tests "* ]] && { timeout 240 python3 -m pytest -p no:cacheprovider -q -rfEs -m gpu \
    tests/test_grad_clip.py tests/test_chunk_pass.py tests/test_resumable_pass.py 2>&1 | tail -6 \
    | tee "$OUT/clip_parity_tests.txt" || rc=1; }
  if [[ " $parts " == *" userpath "* ]]; then
    timeout 420 python3 -m bench.user_path --preset h200-1b --iterations ${LETO_CP_ITERS:-16} \
      --skip ${LETO_CP_SKIP:-8} --timeout-s 200 --script-args="--deterministic --tokens zipf" \
      --leto-variant "step=LETO_CLIP_PARITY=0" --json "$OUT/clip_parity_userpath.json" \
      > "$OUT/clip_parity_userpath.txt" 2>&1 || rc=1
    grep -E "iterations, ms|median|bit-ident" "$OUT/clip_parity_userpath.txt" | tail -8
    grep -rh "host time between\|gradient parity" /tmp/leto-user-path-* 2>/dev/null | head -6
  fi
  if [[ " $parts " == *" zoo "* ]]; then
    timeout ${LETO_CP_ZOO_TIMEOUT:-300} python3 -m bench.zoo --device cuda --size tiny \
      --cases tied,groups,two-optimizers,fp16 --kill-cases ${LETO_CP_ZOO_KILL:-tied,fp16} \
      --json "$OUT/clip_parity_zoo.json" > "$OUT/clip_parity_zoo.txt" 2>&1 || rc=1
    tail -c 1500 "$OUT/clip_parity_zoo.txt"
  fi
  if [[ " $parts " == *" breakdown "* ]]; then
    timeout 280 python3 -m bench.update_breakdown --preset h200-1b --window 4:3 \
      --script-args="--deterministic --tokens zipf" --timeout-s 260 \
      --json "$OUT/clip_parity_breakdown.json" > "$OUT/clip_parity_breakdown.txt" 2>&1 || rc=1
    grep -A14 "^range" "$OUT/clip_parity_breakdown.txt"
  fi
fi
if [[ $what == userpath-long ]]; then
  # The user path over a run long enough to carry a checkpoint (issue 59: what a user
  # lives over hours, not only the steady median): 16 K tokens (LETO_UL_PRESET),
  # torchrun, leto run's defaults and --no-checkpoints side by side, deterministic,
  # bytes compared; median and mean; then each rank log's loop line (the saves, the
  # interval, each save's stall).
  # LETO_UL_REPEATS runs the list that many times, in alternating order; LETO_UL_VARIANT
  # is the leto run variant beside the defaults (empty: none).
  variant=${LETO_UL_VARIANT-nockpt=--no-checkpoints}
  timeout ${LETO_UL_TIMEOUT:-480} python3 -m bench.user_path --preset ${LETO_UL_PRESET:-h200-1b} \
    --iterations ${LETO_UL_ITERS:-150} --skip ${LETO_UL_SKIP:-8} --timeout-s 300 \
    --repeats ${LETO_UL_REPEATS:-1} --script-args="--deterministic --tokens zipf" \
    ${variant:+--leto-variant "$variant"} \
    --keep-work --json "$OUT/userpath_long.json" > "$OUT/userpath_long.txt" 2>&1 || rc=1
  grep -E "median|bit-ident|FAILED" "$OUT/userpath_long.txt" | tail -8
  grep -rh "the loop ran" /tmp/leto-user-path-* 2>/dev/null | cut -c1-900 | tee "$OUT/userpath_long_loop.txt"
fi
if [[ $what == grad-landing ]]; then
  # Issue 59: gradients landing in the retained buffer by copy (leto.trainer.grad_landing)
  # — its GPU test; the user path at 16 K against torchrun and against the old landing
  # (LETO_GRAD_LANDING=add), deterministic; the tiny zoo (tied, groups, two optimizers,
  # fp16) against torchrun with kills; and the in-process component benchmark (added to
  # zeros vs copied vs kept by autograd). LETO_GL_PARTS picks (default: tests userpath zoo).
  parts=${LETO_GL_PARTS:-tests userpath zoo}
  [[ " $parts " == *" tests "* ]] && { timeout 120 python3 -m pytest -p no:cacheprovider -q -rfEs \
    tests/test_grad_landing.py 2>&1 | tail -3 | tee "$OUT/grad_landing_tests.txt" || rc=1; }
  if [[ " $parts " == *" userpath "* ]]; then
    timeout 300 python3 -m bench.user_path --preset h200-1b --iterations ${LETO_GL_ITERS:-16} \
      --skip ${LETO_GL_SKIP:-8} --timeout-s 200 --script-args="--deterministic --tokens zipf" \
      --leto-variant "add=LETO_GRAD_LANDING=add" --json "$OUT/grad_landing_userpath.json" \
      > "$OUT/grad_landing_userpath.txt" 2>&1 || rc=1
    tail -c 2000 "$OUT/grad_landing_userpath.txt"
  fi
  if [[ " $parts " == *" zoo "* ]]; then
    timeout ${LETO_GL_ZOO_TIMEOUT:-240} python3 -m bench.zoo --device cuda --size tiny \
      --cases tied,groups,two-optimizers,fp16 --kill-cases tied,groups \
      --json "$OUT/grad_landing_zoo.json" > "$OUT/grad_landing_zoo.txt" 2>&1 || rc=1
    tail -c 2500 "$OUT/grad_landing_zoo.txt"
  fi
  [[ " $parts " == *" component "* ]] && { timeout 240 python3 -m bench.grad_landing --layers 16 \
    --dim 8192 --tokens 16384 --json-out "$OUT/grad_landing.json" 2>&1 | tail -8 \
    | tee "$OUT/grad_landing.txt" || rc=1; }
fi
if [[ $what == user-recovery ]]; then
  # Issue 57: recovery as the user lives it, the paper's measure (I + R: failure until the
  # interrupted iteration has completed again), on the 1.1 B plain port (no prepare=, no
  # warmup=) under leto run's defaults: killed in the update with 4 pages a group lost,
  # and in the backward; the promoted trainer's stages to the end of its first iteration.
  # The kill at iteration 10: the shadows park after the first iteration, then run the
  # script's set-up and its model's warm-up ahead (leto.trainer.run_ahead, shape_warmup);
  # LETO_UR_TAG names the outputs (a second run with other settings beside the first).
  ur=user_recovery${LETO_UR_TAG:+_$LETO_UR_TAG}
  rm -rf /tmp/leto-plain-recovery-*  # (the rank logs below are this run's)
  # LETO_UR_PRESET=h200-1b-prepared: the example job at the same size, a script that gives
  # prepare= and warmup= (the issue's ≤ 0.5 s target).
  timeout ${LETO_UR_TIMEOUT:-560} python3 -m bench.plain_recovery --preset ${LETO_UR_PRESET:-h200-1b} \
    --shadow-level ${LETO_UR_LEVELS:-L3} --trials ${LETO_UR_TRIALS:-1} --iterations ${LETO_UR_ITERS:-13} \
    --at ${LETO_UR_AT:-update.optimizer@10#1,compute.backward@10#1} --lose-pages 4 --timeout-s 240 \
    ${LETO_UR_VARIANT:+--variant="$LETO_UR_VARIANT"} \
    --json-out "$OUT/$ur.json" > "$OUT/$ur.txt" 2>&1 || rc=1
  tail -c 5000 "$OUT/$ur.txt"
  grep -H "leto: rank\|Error\|error\|shadow" /tmp/leto-plain-recovery-*/*/logs/*.log > "$OUT/${ur}_ranklogs.txt" 2>/dev/null
fi
if [[ $what == megatron ]]; then
  # Issue 58 stage 4 (world 1): examples/megatron on the H200 — bit-identical to torchrun
  # after a kill with pages lost (tests/test_megatron.py's cuda case), then certified at
  # every phase. megatron-core 0.19.2 is not installed there: carry its wheel (.whl, the
  # device README); the target installs it under /tmp/site.
  # (four micro-batches of 4: one of 16 ran out of memory under torchrun on an 80 GB H100)
  # LETO_MG_PARTS picks (default all, in order): tests, certify, userpath (overhead at
  # ~1 B beside torchrun: Megatron's DDP, DistributedOptimizer and bf16, 16 K tokens),
  # recovery (the paper's I + R, that job killed in the update with pages lost).
  parts=${LETO_MG_PARTS:-tests certify userpath recovery}
  megatron_core
  MG="--layers 20 --hidden 2048 --heads 16 --vocab 50304 --seq 1024 --micro-batch 4 --micro-batches 4 --megatron-ddp --distributed-optimizer --bf16"
  [[ " $parts " == *" tests "* ]] && { python3 -m pytest -p no:cacheprovider -q tests/test_megatron.py -k cuda 2>&1 | tee "$OUT/megatron_tests.txt" || rc=1; }
  [[ " $parts " == *" certify "* ]] && { timeout ${LETO_MG_CERTIFY_TIMEOUT:-500} python3 -m faultkit.cli certify --device cuda --nproc-per-node 1 \
    -- examples/megatron/gpt_leto.py --iterations 9 ${LETO_MG_CERTIFY_ARGS:-} 2>&1 | tail -30 | tee "$OUT/megatron_certify.txt" || rc=1; }
  if [[ " $parts " == *" userpath "* ]]; then
    # (LETO_MG_UP_ITERS/SKIP: iterations past the shadow's start and run ahead, for a
    # steady figure; 8/3 spans them)
    timeout ${LETO_MG_UP_TIMEOUT:-300} python3 -m bench.user_path --job megatron --device cuda --nproc-per-node 1 \
      --iterations ${LETO_MG_UP_ITERS:-8} --skip ${LETO_MG_UP_SKIP:-3} --timeout-s 240 --script-args="$MG" \
      --json "$OUT/megatron_userpath.json" \
      > "$OUT/megatron_userpath.txt" 2>&1 || rc=1
    tail -c 2500 "$OUT/megatron_userpath.txt"
  fi
  if [[ " $parts " == *" recovery "* ]]; then
    timeout ${LETO_MG_RECOVERY_TIMEOUT:-200} python3 -m bench.plain_recovery --device cuda --nproc-per-node 1 --shadow-level L3 \
      --trials 1 --iterations 10 --at update.optimizer@7#1 --lose-pages 4 --timeout-s 180 \
      --script examples/megatron/gpt_leto.py --script-args="$MG" \
      --json-out "$OUT/megatron_recovery.json" > "$OUT/megatron_recovery.txt" 2>&1 || rc=1
    tail -c 2500 "$OUT/megatron_recovery.txt"
  fi
fi
if [[ $what == fresh-start ]]; then
  # Issue 57: a fresh job's time from its launch to its first completed iteration, the
  # 1.1 B plain port under torchrun and under leto run's defaults, twice each (the second
  # pair in reverse order: the first leto run on a fresh machine builds the kernel caches);
  # beside them leto run without shadows (LETO_FS_VARIANT: what the parked shadows' start,
  # beside the first trainer's, costs it). None of them profiled; then one more leto run,
  # its first trainer's way to its first iteration profiled (LETO_PROFILE_START=1).
  timeout ${LETO_FS_TIMEOUT:-300} python3 -m bench.user_path \
    --preset h200-1b --iterations 4 --skip 2 --repeats ${LETO_FS_REPEATS:-2} --timeout-s 140 \
    --leto-variant="${LETO_FS_VARIANT:-no shadows=--shadow-level off}" \
    --json "$OUT/fresh_start.json" > "$OUT/fresh_start.txt" 2>&1 || rc=1
  tail -c 3500 "$OUT/fresh_start.txt"
  mkdir -p "$OUT/fresh_prof"
  for f in /tmp/leto-user-path-*/rep*/*/leto-run/rank0.gen0.active.log; do
    run=${f#/tmp/leto-user-path-*/}; cp "$f" "$OUT/fresh_prof/$(echo "${run%%/leto-run/*}" | tr / _).log"
  done
  grep -H "to the end of the first iteration\|for its state manager to listen" "$OUT"/fresh_prof/*.log
  grep -H "start-up, after" /tmp/leto-user-path-*/rep*/leto_run*/stderr.txt  # (the agent's part)
  w=$(mktemp -d); (cd "$w" && timeout 120 env LETO_PROFILE_RECOVERY="$OUT/fresh_prof" LETO_PROFILE_START=1 \
    LETO_PROFILE_WINDOW=99:1 python3 -m leto.cli run --nproc-per-node 1 "$OLDPWD/examples/porting/gpt_leto.py" \
    --n-layer 20 --n-embd 2048 --n-head 16 --vocab 50304 --seq 1024 --batch 16 --iterations 2 --out out \
    > /dev/null 2>&1) || rc=1
  head -45 "$OUT/fresh_prof/rank0.gen0.profile.txt" 2>/dev/null
fi
if [[ $what == cold-start ]]; then
  # Issue 57: the first leto run on a machine (its native builds and kernel caches empty:
  # LETO_BUILD_DIR and CUPY_CACHE_DIR fresh; leto run prebuilds Leto's NVRTC modules beside
  # its zygote: leto.gpu_kernels), its first trainer's way to its first iteration profiled,
  # and the launch to the end of that iteration timed.
  python3 -m pytest -p no:cacheprovider -q tests/test_gpu_kernels.py 2>&1 | tail -2 | tee "$OUT/gpu_kernels_tests.txt" || rc=1
  for s in 0 1; do  # NVRTC on one thread, then on every core (--split-compile=0, the default)
    LETO_BUILD_DIR=$(mktemp -d) LETO_NVRTC_SPLIT=$s python3 -c "import time; from leto import gpu_kernels as g
t = time.time(); g.module_file('codec'); a = time.time() - t; t = time.time(); g.module_file('chunk_pass')
print('LETO_NVRTC_SPLIT=$s: codec %.2f s, chunk_pass %.2f s (one process, in turn)' % (a, time.time() - t))" || rc=1
  done
  export LETO_BUILD_DIR=$(mktemp -d) CUPY_CACHE_DIR=$(mktemp -d)
  mkdir -p "$OUT/cold_prof"; w=$(mktemp -d); t0=$(date +%s.%N)
  (cd "$w" && timeout 200 env LETO_PROFILE_RECOVERY="$OUT/cold_prof" LETO_PROFILE_START=1 \
    LETO_PROFILE_WINDOW=99:1 python3 -m leto.cli run --nproc-per-node 1 "$OLDPWD/examples/porting/gpt_leto.py" \
    --n-layer 20 --n-embd 2048 --n-head 16 --vocab 50304 --seq 1024 --batch 16 --iterations 2 --out out \
    > "$OUT/cold_prof/leto_run.txt" 2>&1) || rc=1
  echo "cold leto run (2 iterations): $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
  cp "$w"/leto-run/rank0.gen0.active.log "$OUT/cold_prof/" 2>/dev/null
  grep -h "to the end of the first iteration\|start-up, after\|staging\|prebuild" "$w"/leto-run/*.log "$OUT/cold_prof/leto_run.txt" 2>/dev/null
  grep -E "cumtime|build_shared|compile|nvrtc|_module|subprocess.py.*(run|communicate)|cupy" "$OUT/cold_prof/rank0.gen0.profile.txt" | head -30
  ls -la "$LETO_BUILD_DIR" | head; du -sh "$CUPY_CACHE_DIR"
  unset LETO_BUILD_DIR CUPY_CACHE_DIR
fi
if [[ $what == pin-stall ]]; then
  # Issue 57: what making a checkpoint's pinned staging buffers (13 GB at 1.1 B) in the
  # background does to a training thread's steps: a thread, a registration, a process.
  timeout 300 python3 -m bench.pin_stall --gib ${LETO_PIN_GIB:-13} --json "$OUT/pin_stall.json" 2>&1 \
    | tee "$OUT/pin_stall.txt" || rc=1
fi
if [[ $what == tied-job ]]; then
  # The job that raised the false alarm, as its user ran it: the 1.1 B nanoGPT-style port
  # (tied embeddings, fused AdamW, two groups, LambdaLR warm-up, bf16 autocast), text-like
  # (Zipf) tokens, 16 K tokens an iteration, one H200, leto run's default flags against
  # torchrun; deterministic algorithms on, so parameters and losses are compared bit for bit.
  timeout ${LETO_TIED_TIMEOUT:-400} python3 -m bench.user_path --preset h200-1b --iterations ${LETO_TIED_ITERS:-8} --skip 3 \
    --timeout-s 200 --script-args="--deterministic --tokens zipf" \
    --json "$OUT/tied_job.json" > "$OUT/tied_job.txt" 2>&1 || rc=1
  tail -c 3000 "$OUT/tied_job.txt"
fi
exit $rc
