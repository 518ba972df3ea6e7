#!/bin/bash
# Call 1: PyTorch ground truth (issue 14): the multi-GPU sweep under the fake process group and the
# single-GPU tails, concurrently (memory peaks are per process); the config that should not fit runs alone last.
set -u
W=/tmp/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $W/gpu.txt
python3 -m pip show deepspeed torch transformers peft 2>/dev/null | grep -E '^(Name|Version)' > $W/versions.txt
python3 - <<'PY'
import json
rows=[json.loads(l) for l in open('tools/memtrace/tails-configs.jsonl') if l.strip()]
big=[r for r in rows if r['name']=='tail_xlmrl_eager_s512_lora_qkvo_b64']
rest=[r for r in rows if r not in big]
for name, part in [('a', rest[0::2]), ('b', rest[1::2]), ('oom', big)]:
    open(f'/tmp/w/tails-{name}-configs.jsonl','w').write(''.join(json.dumps(r)+'\n' for r in part))
PY
date +%T > $W/times.txt
( timeout 480 python3 tools/measure_multigpu.py --jobs 2 -o $W/multigpu.jsonl > $W/multigpu.log 2>&1; echo "multigpu rc=$? $(date +%T)" >> $W/times.txt ) &
for p in a b; do ( timeout 480 python3 tools/measure_pytorch.py $W/tails-$p-configs.jsonl -o $W/tails-$p.jsonl > $W/tails-$p.log 2>&1; echo "tails-$p rc=$? $(date +%T)" >> $W/times.txt ) & done
wait
timeout 70 python3 tools/measure_pytorch.py $W/tails-oom-configs.jsonl -o $W/tails-oom.jsonl > $W/tails-oom.log 2>&1; echo "tails-oom rc=$? $(date +%T)" >> $W/times.txt
cd /tmp && tar czf $OUT/call1.tgz w && ls -la $OUT && cat $W/times.txt && tail -3 $W/*.log
