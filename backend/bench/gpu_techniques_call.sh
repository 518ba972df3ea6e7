#!/bin/bash
# Calls 6-12 of docs/gpu-session.md in one device call (about 5 minutes), for a session's
# second call, warm after gpu_flash_call.sh: the techniques finished on CPUs since the last
# GPU session, run on CUDA for the first time. Each job is a process of its own, all at once
# (their predicted peaks add up to about 90 GiB of the H200's 139), each with its own kernel
# cache seeded from call 0's (/tmp/cache-flash-call, if this machine still has it), so none
# waits on another's compile and no two append to one cache:
#
#   6.  fp16 with dynamic loss scaling (llama125m_fp16.plan, 30 steps) beside the same
#       plan in bf16 (llama125m_base.plan, 30 steps).
#   7.  The optimizer step in the backward (llama1b_in_backward.plan, 6 steps) against the
#       same plan stepping after it; Adafactor (llama125m_adafactor.plan, 20 steps).
#   8.  Qwen's layers (llama125m_qk_norm_qkv_bias.plan, 6 steps).
#   9.  Adam-mini (llama125m_adam_mini.plan, 20 steps).
#   10. The fixtures on CUDA, fp32: prompt-completion rows (llama-sft.plan), partial rotary
#       with LongRoPE (phi3-longrope) and a sliding window past its length (mistral-window,
#       eager and with the fused kernels' window: `Rows`, as the fixtures are fp32), 4 steps each, with --eval on the fixture's eval.jsonl, whose loss before the first
#       step is the CPU's and transformers' (reference.json's eval.loss); and the prompt-completion
#       rows packed (`packing = true`), eager and fused (the kernels' documents, `Rows` in fp32),
#       whose eval before training is transformers' unpacked loss.
#   11. Head dim 96 (llama125m_head96.plan, eager and flash, 6 steps each): the peak
#       against the prediction where CubeCL pads Burn's `[..., 96]` rows to 128 values.
#   12. Flash against eager over a whole run: llama125m_base.plan with `attention = flash`
#       (30 steps) beside job 6's bf16 run of the same plan, same seed; the summary prints
#       the largest difference of their losses (docs/flash-attention.md's last condition
#       for flash as `target burn`'s default).
#
# Then a summary of every job (steps, skipped steps, loss scale, first and last loss, eval
# losses, peak against predicted) into $OUT/summary.txt. Device tool: carry [".rcoa-bin"];
# call it as
#   OUT_DIR=$OUT; export OUT=/tmp/t; LIMIT=300 bash backend/bench/gpu_techniques_call.sh;
#   tar czf $OUT_DIR/techniques.tgz -C /tmp/t .; cp /tmp/t/summary.txt /tmp/t/steps.txt $OUT_DIR/
# DRY=1 checks the script on a CPU with this machine's release build: the fixtures' jobs
# only (the others are GPU-sized), on the CPU.
set -u
LIMIT=${LIMIT:-300}
source backend/bench/gpu_call_common.sh
SEED_CACHE=${SEED_CACHE:-/tmp/cache-flash-call}
PIDS=()

# job NAME STEPS PLAN [ARGS...]: `rcoa run` in the background into $OUT/NAME.jsonl and .err,
# with a kernel cache of its own and a quarter of the cores to compile ahead with.
job() {
  local name=$1 steps=$2 plan=$3; shift 3
  local cache=/tmp/tc-cache-$name
  rm -rf "$cache"
  [ -d "$SEED_CACHE" ] && cp -r "$SEED_CACHE" "$cache"
  local jobs=(); [ "$DEVICE" = cuda ] && jobs=(--compile-jobs 4)
  (
    RCOA_CACHE_DIR=$cache timeout "$(cap 600)" "$RCOA" run "$plan" --steps "$steps" \
      --device "$DEVICE" --format json "${jobs[@]}" "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
    log "job $name rc=$?"
  ) &
  PIDS+=($!)
}

# The fixtures: tests/fixtures/eval/llama.plan naming fixture $1 by its absolute path, trained
# and evaluated on the fixture's eval.jsonl.
fixture_job() {
  local attention=${2:-sdpa}
  local plan=/tmp/gpu-$1-$attention.plan
  sed -e "s|\"../hf/llama\"|\"$PWD/tests/fixtures/hf/$1\"|" \
    -e "s|^train {|train {\n  attention = $attention|" tests/fixtures/eval/llama.plan > "$plan"
  local name="fixture-$1"
  if [ "$attention" != sdpa ]; then name="$name--$attention"; fi
  job "$name" 4 "$plan" --data "tests/fixtures/hf/$1/eval.jsonl" \
    --eval "tests/fixtures/hf/$1/eval.jsonl"
}

if [ "$DEVICE" = cuda ]; then
  job fp16 30 $B/llama125m_fp16.plan
  job bf16-base 30 $B/llama125m_base.plan
  sed 's/attention = eager/attention = flash/' $B/llama125m_base.plan > /tmp/base-flash.plan
  job bf16-flash 30 /tmp/base-flash.plan
  job in-backward 6 $B/llama1b_in_backward.plan
  sed 's/  in_backward = true//' $B/llama1b_in_backward.plan > /tmp/after-backward.plan
  job after-backward 6 /tmp/after-backward.plan
  job adafactor 20 $B/llama125m_adafactor.plan
  job qwen-layers 6 $B/llama125m_qk_norm_qkv_bias.plan
  job adam-mini 20 $B/llama125m_adam_mini.plan
  job head96 6 $B/llama125m_head96.plan
  sed 's/attention = eager/attention = flash/' $B/llama125m_head96.plan > /tmp/head96-flash.plan
  job head96-flash 6 /tmp/head96-flash.plan
fi
job sft 4 tests/fixtures/eval/llama-sft.plan --data tests/fixtures/hf/llama/sft.jsonl \
  --eval tests/fixtures/hf/llama/sft.jsonl
# The same examples packed (`train { packing = true }`), eager and fused: the eval before the
# first step is still transformers' unpacked loss.
for attention in sdpa flash; do
  sed -e "s|\"../hf/llama\"|\"$PWD/tests/fixtures/hf/llama\"|" \
    -e "s|^train {|train {\n  packing = true\n  attention = $attention|" \
    tests/fixtures/eval/llama-sft.plan > /tmp/gpu-sft-packed-$attention.plan
  job "sft-packed--$attention" 4 /tmp/gpu-sft-packed-$attention.plan \
    --data tests/fixtures/hf/llama/sft.jsonl --eval tests/fixtures/hf/llama/sft.jsonl
done
fixture_job phi3-longrope
fixture_job mistral-window
fixture_job mistral-window flash
log "started ${#PIDS[@]} jobs"
wait "${PIDS[@]}"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/gpu-after.txt" 2>&1

python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import glob, json, os, sys
curves = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.jsonl"))):
    name = os.path.basename(path)[:-6]
    steps, evals, start, summary = [], [], {}, {}
    for line in open(path):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        ev = v.get("event")
        if ev is None and "step" in v:
            steps.append(v)
        elif ev == "eval":
            evals.append(v.get("eval_loss"))
        elif ev == "start":
            start = v
        elif ev == "summary":
            summary = v
    print(f"== {name}: {len(steps)} steps")
    if start:
        print(f"   start: precision {start.get('precision')}, optimizer_in_backward "
              f"{start.get('optimizer_in_backward')}, device {start.get('device')}")
    if steps:
        losses = [s.get("loss") for s in steps]
        curves[name] = losses
        print("   losses:", " ".join(f"{x:.4f}" if isinstance(x, float) else str(x) for x in losses))
        scales = [s.get("loss_scale") for s in steps if "loss_scale" in s]
        skipped = [s["step"] for s in steps if s.get("skipped")]
        if scales:
            print(f"   loss_scale first {scales[0]} last {scales[-1]}; skipped steps {skipped}")
    if evals:
        # What transformers computed on the CPU for the untrained fixture (the first eval).
        # (`fixture-NAME--ATTENTION`: the fixture NAME under another attention.)
        ref = {"sft": "llama/sft_reference.json"}.get(name.split("--")[0].replace("-packed", "")) or (
            name.startswith("fixture-") and name[len("fixture-"):].split("--")[0] + "/reference.json")
        want = None
        if ref:
            r = json.load(open(os.path.join("tests/fixtures/hf", ref)))
            want = r["eval"]["loss"] if "eval" in r else r["loss"]
        print("   eval_loss:", evals, "transformers (before training):", want)
    if summary:
        pred, meas = summary.get("predicted_peak_bytes"), summary.get("measured_peak_bytes")
        print(f"   peak measured {meas} predicted {pred} error {summary.get('peak_error')}; "
              f"reserved {summary.get('measured_reserved_bytes')}; skipped {summary.get('skipped_steps')}; "
              f"steady {summary.get('steady_step_seconds')} s")
    err = os.path.join(sys.argv[1], name + ".err")
    tail = [l.rstrip() for l in open(err) if l.strip() and not l.startswith("[")][-4:] if os.path.exists(err) else []
    for l in tail:
        print("   err:", l[:300])
a, b = curves.get("bf16-base"), curves.get("bf16-flash")
if a and b:
    n = min(len(a), len(b))
    d = max(abs(x - y) for x, y in zip(a[:n], b[:n]))
    print(f"== flash against eager, {n} steps of llama125m_base: largest loss difference {d:.4f}, "
          f"last losses {a[n - 1]:.4f} and {b[n - 1]:.4f}")
PY
log "done"
