#!/usr/bin/env python3
"""Measure the peak GPU memory of real PyTorch training steps.

Runs each configuration (a Hugging Face model built from its config with
random weights, a few optimizer steps on random token ids) on one CUDA GPU,
each in a fresh process, and writes JSON lines in the format of
tests/groundtruth/h100-pytorch.jsonl: one `"record": "env"` line for the
machine, then one `"record": "config"` line per configuration with
`peak_train_B` (the highest torch.cuda.max_memory_allocated() over the
training steps, model construction excluded) or `"oom": true`.
`rcoa validate OUT.jsonl` then scores rcoa's predictions against them.

Usage:
  measure_pytorch.py CONFIGS [-o OUT.jsonl] [--timeout S] [--only NAME ...]
  measure_pytorch.py CONFIGS --dry-run     # check the configurations; no GPU needed

CONFIGS is a JSON list of configurations, or JSON lines holding
configurations or measured rows (their `config` is taken, so an existing
ground-truth file can be measured again). Configuration keys:
  name, family (llama|xlmr), hidden, layers, heads, kv_heads, intermediate,
  vocab, max_pos, tie_embeddings, batch, seq, grad_accum, weight_dtype
  (fp32|bf16), autocast (bf16|none), optimizer (adamw|adamw_fused|sgd|
  sgd_momentum|adafactor), grad_ckpt, ckpt_every, attn (sdpa|eager), lora
  (null or {r, alpha, targets, dropout}), loss (lm|mlm|contrastive),
  dropout, steps; optional alloc_conf (PYTORCH_CUDA_ALLOC_CONF for the run)
  and timeout_s. Missing optional keys take the defaults in DEFAULTS.

Exit status: 0 every configuration ran (an OOM counts as a result),
1 some configuration failed otherwise, 2 bad input or no CUDA device.
"""
import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time

DEFAULTS = {
    "kv_heads": None,  # = heads
    "tie_embeddings": None,  # llama false, xlmr true
    "grad_accum": 1,
    "weight_dtype": "fp32",
    "autocast": "bf16",
    "optimizer": "adamw",
    "grad_ckpt": False,
    "ckpt_every": 1,
    "attn": "sdpa",
    "lora": None,
    "loss": None,  # llama lm, xlmr mlm
    "dropout": 0.0,
    "steps": 3,
    "timeout_s": 600,
    "alloc_conf": None,
}
REQUIRED = ["name", "family", "hidden", "layers", "heads", "intermediate", "vocab",
            "max_pos", "batch", "seq"]
CHOICES = {
    "family": ["llama", "xlmr"],
    "weight_dtype": ["fp32", "bf16"],
    "autocast": ["bf16", "none"],
    "optimizer": ["adamw", "adamw_fused", "sgd", "sgd_momentum", "adafactor"],
    "attn": ["sdpa", "eager"],
    "loss": ["lm", "mlm", "contrastive"],
}
POSITIVE = ["hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "max_pos",
            "batch", "seq", "grad_accum", "ckpt_every", "steps"]


class ConfigError(ValueError):
    pass


def normalize_config(raw):
    """The configuration with every default filled in; ConfigError says what is wrong."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a configuration is a JSON object, not {type(raw).__name__}")
    c = dict(raw)
    name = c.get("name", "?")
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise ConfigError(f"{name}: missing {', '.join(missing)}")
    for k, v in DEFAULTS.items():
        c.setdefault(k, v)
    llama = c["family"] == "llama"
    if c["kv_heads"] is None:
        c["kv_heads"] = c["heads"]
    if c["tie_embeddings"] is None:
        c["tie_embeddings"] = not llama
    if c["loss"] is None:
        c["loss"] = "lm" if llama else "mlm"
    for k, allowed in CHOICES.items():
        if c[k] not in allowed:
            raise ConfigError(f"{name}: {k} = {c[k]!r}; expected one of {', '.join(allowed)}")
    for k in POSITIVE:
        if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
            raise ConfigError(f"{name}: {k} = {c[k]!r}; expected a whole number >= 1")
    for k in ["tie_embeddings", "grad_ckpt"]:
        if not isinstance(c[k], bool):
            raise ConfigError(f"{name}: {k} = {c[k]!r}; expected true or false")
    if not (isinstance(c["dropout"], (int, float)) and 0 <= c["dropout"] < 1):
        raise ConfigError(f"{name}: dropout = {c['dropout']!r}; expected a number in [0, 1)")
    if c["hidden"] % c["heads"]:
        raise ConfigError(f"{name}: hidden {c['hidden']} is not divisible by heads {c['heads']}")
    if c["heads"] % c["kv_heads"]:
        raise ConfigError(f"{name}: heads {c['heads']} is not divisible by kv_heads {c['kv_heads']}")
    if not llama and c["kv_heads"] != c["heads"]:
        raise ConfigError(f"{name}: XLM-R has no grouped-query attention (kv_heads must equal heads)")
    if llama and c["loss"] == "mlm":
        raise ConfigError(f"{name}: loss mlm needs family xlmr")
    if c["loss"] == "contrastive" and c["batch"] % 2:
        raise ConfigError(f"{name}: the contrastive loss pairs two halves of the batch; batch must be even")
    if not llama and c["seq"] + 2 > c["max_pos"]:
        # XLM-R's positions start after the padding index (2).
        raise ConfigError(f"{name}: seq {c['seq']} needs max_pos >= {c['seq'] + 2} for XLM-R")
    if c["lora"] is not None:
        lora = dict(c["lora"])
        for k in ["r", "alpha", "targets"]:
            if k not in lora:
                raise ConfigError(f"{name}: lora needs {k}")
        if not lora["targets"] or not all(isinstance(t, str) for t in lora["targets"]):
            raise ConfigError(f"{name}: lora.targets must be a non-empty list of module names")
        lora.setdefault("dropout", 0.0)
        c["lora"] = lora
    return c


def model_config_kwargs(c):
    """(class name, keyword arguments of its transformers config) for configuration c."""
    if c["family"] == "llama":
        return "LlamaForCausalLM", dict(
            hidden_size=c["hidden"],
            num_hidden_layers=c["layers"],
            num_attention_heads=c["heads"],
            num_key_value_heads=c["kv_heads"],
            intermediate_size=c["intermediate"],
            vocab_size=c["vocab"],
            max_position_embeddings=c["max_pos"],
            tie_word_embeddings=c["tie_embeddings"],
            attention_dropout=c["dropout"],
        )
    return "XLMRobertaForMaskedLM", dict(
        hidden_size=c["hidden"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        intermediate_size=c["intermediate"],
        vocab_size=c["vocab"],
        max_position_embeddings=c["max_pos"],
        tie_word_embeddings=c["tie_embeddings"],
        hidden_dropout_prob=c["dropout"],
        attention_probs_dropout_prob=c["dropout"],
    )


def lora_kwargs(c):
    """Keyword arguments of peft.LoraConfig, or None without an adapter."""
    lora = c["lora"]
    if lora is None:
        return None
    return dict(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(lora["targets"]),
                lora_dropout=lora["dropout"], bias="none")


def checkpointed_layers(c):
    """Indices of the layers recomputed in the backward."""
    if not c["grad_ckpt"]:
        return []
    return [i for i in range(c["layers"]) if i % c["ckpt_every"] == 0]


def phase_names(grad_accum):
    """The phases of one optimizer step, in order."""
    names = []
    for m in range(grad_accum):
        names += [f"fwd{m}", f"bwd{m}"]
    return names + ["opt", "zero"]


def summarize(c, steps, meta):
    """The output row: `steps` is a list of {step, complete, phases: [{phase, peak_B, ...}]}
    (the last one may have stopped at a failed phase); `meta` holds the build facts and,
    on failure, `oom`, `oom_phase`, `error`."""
    oom = bool(meta.get("oom"))
    row = {"record": "config", "name": c["name"], "config": c,
           "status": "oom" if oom else ("error" if meta.get("error") else "ok"),
           "oom": oom, "oom_phase": meta.get("oom_phase"), "error": meta.get("error")}
    row.update({k: v for k, v in meta.items() if k not in row})
    peaks, reserved = [], []
    for s in steps:
        n = s["step"]
        phases = s["phases"]
        if not phases:
            continue
        top = max(phases, key=lambda p: p["peak_B"])
        s["peak_B"] = top["peak_B"]
        s["peak_phase"] = top["phase"]
        s["reserved_peak_B"] = max(p["reserved_peak_B"] for p in phases)
        s["ms"] = round(sum(p["ms"] for p in phases), 3)
        row[f"peak_step{n}_B"] = s["peak_B"]
        row[f"peak_phase_step{n}"] = s["peak_phase"]
        row[f"reserved_peak_step{n}_B"] = s["reserved_peak_B"]
        row[f"alloc_step{n}_B"] = phases[-1]["alloc_B"]
        if s["complete"]:
            row[f"step{n}_ms"] = s["ms"]
        peaks.append(s["peak_B"])
        reserved.append(s["reserved_peak_B"])
    row["steps"] = steps
    row["peak_train_B"] = max(peaks) if peaks else None
    row["reserved_peak_train_B"] = max(reserved) if reserved else None
    timed = [s["ms"] for s in steps if s["complete"] and s["step"] > 1]
    tokens = c["batch"] * c["seq"] * c["grad_accum"]
    row["tokens_per_step"] = tokens
    row["tokens_per_s"] = round(1000.0 * tokens / (sum(timed) / len(timed)), 1) if timed else None
    return row


def read_configs(path, normalize=normalize_config):
    """Configurations from a JSON list or JSON lines (configs or measured rows),
    each checked and completed by `normalize`."""
    if path == "-":
        text = sys.stdin.read()
    else:
        with open(path) as f:
            text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not JSON: {e}") from e
    else:
        items = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: not JSON: {e}") from e
            if isinstance(r, dict) and r.get("record") == "env":
                continue
            items.append(r["config"] if isinstance(r, dict) and "config" in r else r)
    if not items:
        raise ConfigError(f"{path}: no configurations")
    configs = [normalize(r) for r in items]
    names = [c["name"] for c in configs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{path}: configuration names repeat: {', '.join(dup)}")
    return configs


# ---------------------------------------------------------------- on the GPU

def env_record(device="cuda"):
    """The machine and library versions; GPU facts only when `device` is cuda."""
    import torch
    env = {"record": "env", "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "hostname": socket.gethostname(),
           "cpu_count": os.cpu_count(),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for mod in ["transformers", "peft", "accelerate", "numpy"]:
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if device != "cuda":
        env["device"] = device
        return env
    env["cudnn"] = torch.backends.cudnn.version()
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    env.update({"gpu_name": p.name, "gpu_total_memory_B": p.total_memory,
                "gpu_total_memory_GiB": round(p.total_memory / 2**30, 3),
                "sm_count": p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
                "mem_get_info_at_init": {"free_B": free, "total_B": total},
                "sdpa_backends": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                  "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                  "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                  "math": torch.backends.cuda.math_sdp_enabled()}})
    smi = nvidia_smi("name,driver_version,memory.total,memory.used,clocks.max.sm,power.limit,pstate")
    env["nvidia_smi_gpu"] = smi
    env["driver_version"] = smi.split(", ")[1] if smi else None
    try:
        v = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    except Exception:
        v = None
    env["driver_cuda_version"] = f"{v // 1000}.{v % 1000 // 10}" if v else None
    return env


def nvidia_smi(query):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def memory(dev):
    """The allocator's counters for one phase record. The CPU has none: zeros
    there (a CPU run checks that a configuration runs, not what it holds)."""
    import torch
    if dev.type != "cuda":
        return {"peak_B": 0, "alloc_B": 0, "reserved_peak_B": 0, "reserved_B": 0}
    return {"peak_B": torch.cuda.max_memory_allocated(dev),
            "alloc_B": torch.cuda.memory_allocated(dev),
            "reserved_peak_B": torch.cuda.max_memory_reserved(dev),
            "reserved_B": torch.cuda.memory_reserved(dev)}


def reset_peak(dev):
    """Waits for the device and starts a new peak."""
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def model_facts(c, model, params, dev):
    """What was built: parameter counts, bytes and dtypes, and the build's memory."""
    import torch
    facts = {
        "attn_implementation": c["attn"], "model_class": type(base_of(model)).__name__,
        "is_gradient_checkpointing": bool(checkpointed_layers(c)),
        "n_checkpointed_layers": len(checkpointed_layers(c)),
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_trainable": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trainable_param_bytes": sum(p.numel() * p.element_size() for p in params),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "trainable_param_dtypes": sorted({str(p.dtype) for p in params}),
    }
    if dev.type == "cuda":
        facts.update({"peak_build_B": torch.cuda.max_memory_allocated(dev),
                      "alloc_build_B": torch.cuda.memory_allocated(dev),
                      "reserved_build_B": torch.cuda.max_memory_reserved(dev)})
    return facts


def random_batches(c, dev):
    """One [batch, seq] tensor of random token ids per micro-batch."""
    import torch
    gen = torch.Generator(device=dev).manual_seed(0)
    low = 3 if c["family"] == "xlmr" else 0  # skip XLM-R's special tokens
    return [torch.randint(low, c["vocab"], (c["batch"], c["seq"]), device=dev, generator=gen)
            for _ in range(c["grad_accum"])]


def run_steps(c, dev, run_phase, steps, meta):
    """Runs c["steps"] optimizer steps, phase by phase (`phase_names`), each
    with its own peak: `run_phase(name)` does the work of one phase and may
    return the micro-batch's loss. Appends to `steps`; an out-of-memory error
    ends the run and is recorded in `meta`. Returns False after an OOM."""
    import torch
    for n in range(1, c["steps"] + 1):
        step = {"step": n, "complete": False, "phases": []}
        steps.append(step)
        for phase in phase_names(c["grad_accum"]):
            reset_peak(dev)
            t = time.perf_counter()
            try:
                loss = run_phase(phase)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except torch.OutOfMemoryError as e:
                step["phases"].append({"phase": f"{phase}(failed)",
                                       "ms": round(1000 * (time.perf_counter() - t), 3),
                                       **memory(dev)})
                meta.update(oom=True, oom_phase=f"step{n}.{phase}",
                            error=f"OutOfMemoryError: {str(e).splitlines()[0]}")
                return False
            if loss is not None:
                # JSON has no NaN: a loss that is not finite (tensor parallelism under the fake
                # process group reduces nothing, so bf16 activations can overflow) is null.
                step["loss"] = loss if math.isfinite(loss) else None
            step["phases"].append({"phase": phase,
                                   "ms": round(1000 * (time.perf_counter() - t), 3),
                                   **memory(dev)})
        step["complete"] = True
    return True


def build_model(c, device):
    """The model (PEFT-wrapped with an adapter), built directly on `device` in the weight dtype."""
    import torch
    import transformers
    cls_name, kwargs = model_config_kwargs(c)
    cfg_cls = transformers.LlamaConfig if c["family"] == "llama" else transformers.XLMRobertaConfig
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = c["attn"]
    dtype = torch.bfloat16 if c["weight_dtype"] == "bf16" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, cls_name)(cfg)
    finally:
        torch.set_default_dtype(old)
    layers = encoder_layers(model)
    ckpt = checkpointed_layers(c)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(layers):
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = i in ckpt
    lk = lora_kwargs(c)
    if lk is not None:
        import peft
        # autocast_adapter_dtype (PEFT's default) keeps the adapters fp32 over bf16 weights.
        model = peft.get_peft_model(model, peft.LoraConfig(**lk), autocast_adapter_dtype=True)
    model.train()
    return model


def base_of(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def encoder_layers(model):
    m = base_of(model)
    if hasattr(m, "model"):  # LlamaForCausalLM
        return list(m.model.layers)
    return list(m.roberta.encoder.layer)


def make_optimizer(c, params):
    import torch
    o = c["optimizer"]
    if o == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if o == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if o == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if o == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    from transformers.optimization import Adafactor
    return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)


def loss_of(c, model, ids):
    """One micro-batch's loss (autocast is applied by the caller)."""
    import torch
    if c["loss"] in ("lm", "mlm"):
        return model(input_ids=ids, labels=ids).loss
    m = base_of(model)
    body = m.model if c["family"] == "llama" else m.roberta
    h = body(input_ids=ids).last_hidden_state
    emb = torch.nn.functional.normalize(h.float().mean(dim=1), dim=-1)
    half = emb.shape[0] // 2
    scores = emb[:half] @ emb[half:].T / 0.05
    return torch.nn.functional.cross_entropy(scores, torch.arange(half, device=ids.device))


def phase_runner(c, dev, forward, backward, step, zero_grad):
    """The `run_phase` of `run_steps` for one engine: `forward(m)` is micro-batch
    m's loss (run under bf16 autocast when c asks for it), `backward(loss)`,
    `step()` and `zero_grad()` the engine's own calls."""
    import torch
    autocast = c["autocast"] == "bf16"
    pending = {}

    def run_phase(phase):
        if phase.startswith("fwd"):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                pending["loss"] = forward(int(phase[3:])) / c["grad_accum"]
        elif phase.startswith("bwd"):
            loss = pending.pop("loss")
            backward(loss)
            value = loss.detach()
            if hasattr(value, "full_tensor"):  # a DTensor loss (tensor parallelism)
                value = value.full_tensor()
            return float(value) * c["grad_accum"]
        elif phase == "opt":
            step()
        else:
            zero_grad()
        return None

    return run_phase


def measure(c, device="cuda"):
    """Run configuration c on cuda:0 (or, to test this script, on the CPU, where
    there are no peaks to read); returns its row."""
    import torch
    on_gpu = device == "cuda"
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    torch.set_float32_matmul_precision("high")  # fp32 runs use TF32 matmuls
    torch.manual_seed(0)
    meta = {"device": device, "pid": os.getpid(),
            "alloc_conf_effective": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if on_gpu:
        torch.cuda.set_device(dev)
        meta["device_total_B"] = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(dev)
        meta["device_used_after_init_B"] = total - free
    steps = []
    t0 = time.perf_counter()
    try:
        model = build_model(c, dev)
    except torch.OutOfMemoryError as e:
        meta.update(oom=True, oom_phase="build", error=f"OutOfMemoryError: {e}")
        return summarize(c, steps, meta)
    if on_gpu:
        torch.cuda.synchronize()
    params = [p for p in model.parameters() if p.requires_grad]
    meta.update(model_facts(c, model, params, dev))
    meta["build_s"] = round(time.perf_counter() - t0, 3)
    opt = make_optimizer(c, params)
    batches = random_batches(c, dev)
    if on_gpu:
        meta["alloc_setup_B"] = torch.cuda.memory_allocated(dev)
    run_phase = phase_runner(c, dev, lambda m: loss_of(c, model, batches[m]),
                             lambda loss: loss.backward(), opt.step,
                             lambda: opt.zero_grad(set_to_none=True))
    if not run_steps(c, dev, run_phase, steps, meta):
        return summarize(c, steps, meta)
    if on_gpu:
        smi = nvidia_smi("memory.used")
        meta["smi_used_MiB_end"] = int(smi.split()[0]) if smi else None
    return summarize(c, steps, meta)


def run_child(c, timeout, script=__file__, args=()):
    """Measures c in a fresh Python process running `script --child ARGS`
    (c on its stdin, its row the last JSON line of its stdout); a crash or
    timeout becomes an error row."""
    env = dict(os.environ)
    if c.get("alloc_conf"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = c["alloc_conf"]
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args],
                              input=json.dumps(c), capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return summarize(c, [], {"error": f"timed out after {timeout} s"})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return summarize(c, [], {"error": f"exit {proc.returncode}: {tail}",
                                 "returncode": proc.returncode})
    row = json.loads(lines[-1])
    row["parent_wall_s"] = round(time.perf_counter() - t, 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="?", help="JSON list or JSON lines of configurations ('-': stdin)")
    ap.add_argument("-o", "--out", help="write the rows here (default: stdout)")
    ap.add_argument("--timeout", type=float, help="seconds per configuration (default: its timeout_s)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="measure only these configurations")
    ap.add_argument("--dry-run", action="store_true", help="check and print the configurations; no GPU")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(measure(normalize_config(json.loads(sys.stdin.read())))))
        return 0
    if not args.configs:
        ap.error("CONFIGS is required")
    try:
        configs = read_configs(args.configs)
    except (ConfigError, OSError) as e:
        print(f"measure_pytorch: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {c["name"] for c in configs})
        if unknown:
            print(f"measure_pytorch: no configuration named {', '.join(unknown)}", file=sys.stderr)
            return 2
        configs = [c for c in configs if c["name"] in args.only]
    if args.dry_run:
        for c in configs:
            cls, kwargs = model_config_kwargs(c)
            print(json.dumps({"name": c["name"], "model_class": cls, "model_config": kwargs,
                              "lora": lora_kwargs(c), "checkpointed_layers": checkpointed_layers(c),
                              "phases": phase_names(c["grad_accum"])}))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("measure_pytorch: no CUDA device (this script measures GPU memory)", file=sys.stderr)
        return 2
    out = open(args.out, "w") if args.out else sys.stdout
    failed = 0
    print(json.dumps(env_record()), file=out, flush=True)
    for c in configs:
        row = run_child(c, args.timeout or c["timeout_s"])
        failed += row["status"] == "error"
        print(json.dumps(row), file=out, flush=True)
        peak = row.get("peak_train_B")
        print(f"{c['name']:34s} {row['status']:5s} "
              f"{'' if peak is None else f'{peak / 2**30:.2f} GiB'} {row.get('error') or ''}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
