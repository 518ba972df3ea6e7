#!/usr/bin/env python3
"""Measure rank 0's peak GPU memory in multi-GPU training, on one GPU.

Each configuration runs as rank 0 of a world of `world_size` ranks under
PyTorch's fake process group (FakeStore + backend "fake"): collectives
return at once without moving data, while every tensor rank 0 allocates
(its shards, gathered weights, gradient buckets, optimizer state) is real.
So one GPU measures what one rank of N holds, for N up to 64, with FSDP2,
DDP, tensor parallelism through DTensor, and DeepSpeed ZeRO 0-3. Not
captured: NCCL's own buffers and communicator memory, and anything that
depends on communication overlapping computation.

The model, the phases (fwdN/bwdN per micro-batch, opt, zero, each with its
own torch.cuda.max_memory_allocated() peak), the environment record and the
row format are measure_pytorch.py's; a row adds the engine and its sharding
settings to `config`. `rcoa validate OUT.jsonl` scores rcoa against them.

Usage:
  measure_multigpu.py [CONFIGS] [-o OUT.jsonl] [--only NAME ...]   # on a GPU
  measure_multigpu.py --list                # the default sweep as JSON lines
  measure_multigpu.py [CONFIGS] --dry-run   # check configurations; no torch run
  measure_multigpu.py [CONFIGS] --device cpu [-o OUT.jsonl]
                                            # every configuration at tiny size on
                                            # the CPU under the fake group (no peaks)

Without CONFIGS the default sweep runs (--list prints it). Configuration keys
are measure_pytorch.py's (its --help), plus:
  world_size         ranks in the job (rank 0 is measured)
  engine             ddp | fsdp2 | tp | deepspeed
  tensor_parallel    tp's degree (= world_size; tensor parallelism only)
  sequence_parallel  false (HF Llama's layers take no sequence-sharded input)
  zero_stage         deepspeed's ZeRO stage, 0-3
  fsdp_mp            fsdp2's MixedPrecisionPolicy: null or
                     {"param_dtype": "bf16"|"fp32", "reduce_dtype": "bf16"|"fp32"}
  reshard_after_forward  fsdp2: true
  master_weights     "fp32" for deepspeed's bf16 mode (bf16 weights, fp32 master
                     copies in the optimizer), else "none"

Exit status: 0 every configuration ran (an OOM counts as a result), 1 some
configuration failed otherwise, 2 bad input, no CUDA device, or an engine
that is not installed.
"""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure_pytorch as mp  # noqa: E402

ENGINES = ["ddp", "fsdp2", "tp", "deepspeed"]
MULTI_DEFAULTS = {
    "tensor_parallel": None,  # tp: world_size, else 1
    "sequence_parallel": False,
    "zero_stage": None,
    "fsdp_mp": None,
    "reshard_after_forward": True,
    "master_weights": "none",
}
# DDP's defaults, recorded in each row: what the gradient buckets hold.
DDP_BUCKET_CAP_MB = 25
DDP_GRADIENT_AS_BUCKET_VIEW = False


def normalize_config(raw):
    """A multi-GPU configuration with every default filled in; mp.ConfigError says what is wrong."""
    c = mp.normalize_config(raw)
    name = c["name"]
    for k in ["world_size", "engine"]:
        if k not in c:
            raise mp.ConfigError(f"{name}: missing {k}")
    for k, v in MULTI_DEFAULTS.items():
        c.setdefault(k, v)
    engine, n = c["engine"], c["world_size"]
    if engine not in ENGINES:
        raise mp.ConfigError(f"{name}: engine = {engine!r}; expected one of {', '.join(ENGINES)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise mp.ConfigError(f"{name}: world_size = {n!r}; expected a whole number >= 1")
    if c["tensor_parallel"] is None:
        c["tensor_parallel"] = n if engine == "tp" else 1
    tp = c["tensor_parallel"]
    if engine == "tp":
        if tp != n or tp < 2:
            raise mp.ConfigError(f"{name}: engine tp runs tensor_parallel = world_size >= 2, "
                                 f"not {tp} of {n}")
        for k in ["heads", "kv_heads", "intermediate", "vocab"]:
            if c[k] % tp:
                raise mp.ConfigError(f"{name}: {k} {c[k]} is not divisible by tensor_parallel {tp}")
        if c["tie_embeddings"]:
            raise mp.ConfigError(f"{name}: tensor parallelism here splits the embedding and the "
                                 "head apart; tie_embeddings must be false")
    elif tp != 1:
        raise mp.ConfigError(f"{name}: tensor_parallel {tp} with engine {engine}; only tp splits layers")
    if c["family"] != "llama" or c["loss"] != "lm":
        raise mp.ConfigError(f"{name}: the multi-GPU engines run Llama with the causal-LM loss")
    if c["sequence_parallel"]:
        raise mp.ConfigError(f"{name}: sequence_parallel is not measured (Hugging Face's Llama "
                             "layers take no sequence-sharded input)")
    if engine == "deepspeed":
        if c["zero_stage"] not in (0, 1, 2, 3):
            raise mp.ConfigError(f"{name}: zero_stage = {c['zero_stage']!r}; DeepSpeed's stages are 0-3")
        if c["optimizer"] not in ("adamw", "adamw_fused"):
            raise mp.ConfigError(f"{name}: engine deepspeed runs adamw (torch's, foreach) or "
                                 "adamw_fused (DeepSpeed's FusedAdam)")
        if c["autocast"] != "none":
            raise mp.ConfigError(f"{name}: DeepSpeed casts the model itself; autocast must be none")
        if c["lora"] is not None:
            raise mp.ConfigError(f"{name}: LoRA is not measured under DeepSpeed")
        if c["grad_accum"] != 1:
            # DeepSpeed counts micro-batches in step() and scales the loss itself.
            raise mp.ConfigError(f"{name}: engine deepspeed is measured with grad_accum 1")
    elif c["zero_stage"] is not None:
        raise mp.ConfigError(f"{name}: zero_stage is DeepSpeed's (fsdp2 is ZeRO-3 by construction)")
    if c["master_weights"] not in ("none", "fp32"):
        raise mp.ConfigError(f"{name}: master_weights = {c['master_weights']!r}; expected none or fp32")
    if c["master_weights"] == "fp32" and (engine != "deepspeed" or c["weight_dtype"] != "bf16"):
        raise mp.ConfigError(f"{name}: master_weights fp32 is DeepSpeed's bf16 mode "
                             "(engine deepspeed, weight_dtype bf16)")
    if engine == "deepspeed" and c["weight_dtype"] == "bf16" and c["master_weights"] != "fp32":
        raise mp.ConfigError(f"{name}: DeepSpeed's bf16 mode keeps fp32 master weights; "
                             "set master_weights fp32")
    if c["fsdp_mp"] is not None:
        if engine != "fsdp2":
            raise mp.ConfigError(f"{name}: fsdp_mp is FSDP2's setting, not {engine}'s")
        policy = c["fsdp_mp"]
        if not isinstance(policy, dict) or set(policy) != {"param_dtype", "reduce_dtype"} or \
                not all(v in ("bf16", "fp32") for v in policy.values()):
            raise mp.ConfigError(f"{name}: fsdp_mp = {policy!r}; expected "
                                 '{"param_dtype": "bf16"|"fp32", "reduce_dtype": "bf16"|"fp32"}')
        if c["autocast"] != "none":
            raise mp.ConfigError(f"{name}: fsdp_mp casts the gathered weights; autocast must be none")
    if c["reshard_after_forward"] is not True:
        raise mp.ConfigError(f"{name}: reshard_after_forward false is not measured "
                             "(rcoa's plans cannot say it)")
    return c


# ---------------------------------------------------------------- the sweep

# A 1.1B Llama (TinyLlama's shape): weights, gradients and optimizer state
# are large enough against the activations that sharding shows, and every
# dimension divides by a tensor-parallel degree of 8.
LLAMA_1B = {"family": "llama", "hidden": 2048, "layers": 16, "heads": 16, "kv_heads": 8,
            "intermediate": 5632, "vocab": 32000, "max_pos": 2048, "batch": 4, "seq": 1024,
            "timeout_s": 300}
FSDP_MP = {"fsdp_mp": {"param_dtype": "bf16", "reduce_dtype": "fp32"}, "autocast": "none",
           "weight_dtype": "fp32"}
FSDP_BF16 = {"autocast": "none", "weight_dtype": "bf16"}
FSDP_FP32 = {"autocast": "none", "weight_dtype": "fp32"}
DS_BF16 = {"autocast": "none", "weight_dtype": "bf16", "master_weights": "fp32"}


def default_sweep():
    """The configurations measured by default (about 6 minutes on one H100)."""
    rows = []

    def add(name, **over):
        rows.append({"name": name, **LLAMA_1B, **over})

    for n in [2, 4, 8, 16, 32, 64]:
        add(f"fsdp2_mp_n{n}", engine="fsdp2", world_size=n, **FSDP_MP)
    for n in [2, 8, 64]:
        add(f"fsdp2_bf16_n{n}", engine="fsdp2", world_size=n, **FSDP_BF16)
        add(f"fsdp2_fp32_n{n}", engine="fsdp2", world_size=n, **FSDP_FP32)
    add("fsdp2_mp_n8_ckpt", engine="fsdp2", world_size=8, grad_ckpt=True, **FSDP_MP)
    add("fsdp2_mp_n8_accum2", engine="fsdp2", world_size=8, grad_accum=2, **FSDP_MP)
    add("fsdp2_mp_n8_fused", engine="fsdp2", world_size=8, optimizer="adamw_fused", **FSDP_MP)
    # DDP: every rank holds the whole model, its gradients and one more
    # gradient copy in the buckets; only the bucket layout could depend on
    # N, and it does not (DDP_BUCKET_CAP_MB), so two world sizes show it.
    for n in [2, 8]:
        add(f"ddp_autocast_n{n}", engine="ddp", world_size=n)
    add("ddp_bf16_n8", engine="ddp", world_size=8, weight_dtype="bf16", autocast="none")
    add("ddp_lora_n8", engine="ddp", world_size=8, weight_dtype="bf16", autocast="none",
        lora={"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.0})
    for n in [2, 4, 8]:
        add(f"tp_autocast_n{n}", engine="tp", world_size=n)
        add(f"tp_bf16_n{n}", engine="tp", world_size=n, weight_dtype="bf16", autocast="none")
    add("tp_autocast_n4_ckpt", engine="tp", world_size=4, grad_ckpt=True)
    for stage in [0, 1, 2, 3]:
        add(f"deepspeed_z{stage}_n8", engine="deepspeed", world_size=8, zero_stage=stage, **DS_BF16)
    add("deepspeed_z2_n2", engine="deepspeed", world_size=2, zero_stage=2, **DS_BF16)
    add("deepspeed_z3_n2", engine="deepspeed", world_size=2, zero_stage=3, **DS_BF16)
    add("deepspeed_z3_n32", engine="deepspeed", world_size=32, zero_stage=3, **DS_BF16)
    return rows


def tiny(c):
    """c at a size the CPU runs in seconds, every degree of the sweep still dividing it."""
    small = {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 8, "intermediate": 128,
             "vocab": 256, "max_pos": 64, "batch": 2, "seq": 16, "steps": 2}
    if c["family"] == "xlmr":
        small["max_pos"] = small["seq"] + 2
    return normalize_config({**c, **small})


# ---------------------------------------------------------------- one rank

def deepspeed_config(c):
    """DeepSpeed's JSON configuration for c: its defaults (buckets included), made explicit
    where they decide memory."""
    opt = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
    if c["optimizer"] == "adamw":
        opt["params"]["torch_adam"] = True  # torch.optim.AdamW, foreach on the GPU
    return {"train_micro_batch_size_per_gpu": c["batch"],
            "gradient_accumulation_steps": c["grad_accum"],
            "bf16": {"enabled": c["weight_dtype"] == "bf16"},
            "zero_optimization": {"stage": c["zero_stage"]},
            "optimizer": opt,
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False}


def tp_plans():
    """(model-level, per-decoder-layer) parallelize_module plans: Megatron's split of
    attention and MLP (column-parallel in, row-parallel out) and of the vocabulary
    (the embedding by rows, the head by columns with a vocabulary-parallel loss)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    model = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
             "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel()}
    return model, layer


def import_deepspeed(dev):
    if dev.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    if dev.type == "cpu":
        # DeepSpeed's CPU backend compiles a shared-memory allreduce for ranks on one
        # host; under the fake group nothing is reduced, so it is not built.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def wrap(c, model, dev, mesh, meta):
    """Shards `model` the way c's engine does on rank 0. Returns (model, optimizer,
    backward, step, zero_grad): the engine's own calls for those phases."""
    import torch
    engine = c["engine"]
    if engine == "deepspeed":
        deepspeed = import_deepspeed(dev)
        cfg = deepspeed_config(c)
        meta["deepspeed_config"] = cfg
        eng, opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=cfg, dist_init_required=False)
        # DeepSpeed's step() also zeroes the gradients: the zero phase has nothing to do.
        return eng, opt, eng.backward, eng.step, lambda: None
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(
            model, device_ids=[dev.index] if dev.type == "cuda" else None,
            bucket_cap_mb=DDP_BUCKET_CAP_MB, gradient_as_bucket_view=DDP_GRADIENT_AS_BUCKET_VIEW)

        def no_allreduce(_, bucket):
            # The fake group's allreduce leaves the future without a value, which DDP
            # rejects; the bucket (allocated as in a real run) is returned as reduced.
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, no_allreduce)
        meta.update(ddp_bucket_cap_mb=DDP_BUCKET_CAP_MB,
                    gradient_as_bucket_view=DDP_GRADIENT_AS_BUCKET_VIEW)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        policy = c["fsdp_mp"]
        mp_policy = MixedPrecisionPolicy(
            param_dtype=dtypes[policy["param_dtype"]], reduce_dtype=dtypes[policy["reduce_dtype"]]
        ) if policy else MixedPrecisionPolicy()
        for layer in mp.encoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
        fully_shard(mp.base_of(model), mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    elif engine == "tp":
        from torch.distributed.tensor.parallel import parallelize_module
        whole, per_layer = tp_plans()
        base = mp.base_of(model)
        parallelize_module(base, mesh, whole)
        for layer in mp.encoder_layers(model):
            parallelize_module(layer, mesh, per_layer)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = mp.make_optimizer(c, param_groups(params))
    return (model, opt, lambda loss: loss.backward(), opt.step,
            lambda: opt.zero_grad(set_to_none=True))


def param_groups(params):
    """`params` as optimizer groups that torch's foreach kernels accept: DTensors
    (tensor-parallel weights) and plain tensors (the norms, replicated) apart."""
    from torch.distributed.tensor import DTensor
    dist = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    if not dist or not plain:
        return params
    return [{"params": dist}, {"params": plain}]


def local_bytes(model):
    """Parameter bytes rank 0 holds between steps (its shards, not the whole tensors)."""
    from torch.distributed.tensor import DTensor
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 keeps the shard beside an empty parameter
            t = p.ds_tensor
        else:
            t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def measure(c, device):
    """Run c as rank 0 of a fake world on `device` (cuda: cuda:0); returns its row."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    on_gpu = device == "cuda"
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    n = c["world_size"]
    # DeepSpeed and DDP read these; the fake group needs no address.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    if on_gpu:
        torch.cuda.set_device(dev)
        torch.cuda.init()
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    meta = {"device": device, "pid": os.getpid(), "fake_process_group": True, "rank": 0,
            "alloc_conf_effective": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if on_gpu:
        free, total = torch.cuda.mem_get_info(dev)
        meta.update(device_total_B=total, device_used_after_init_B=total - free)
    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    steps = []
    try:
        mesh = None
        if c["engine"] in ("fsdp2", "tp"):
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(dev.type, (n,))
        t0 = time.perf_counter()
        try:
            model = mp.build_model(c, dev)
            meta.update(mp.model_facts(c, model, [p for p in model.parameters() if p.requires_grad],
                                       dev))
            # No reference to the unsharded parameters may outlive the wrap: fully_shard and
            # parallelize_module replace them with shards, and a list held here would keep every
            # whole weight allocated through the run (rank 0 would hold the model twice).
            model, opt, backward, step, zero_grad = wrap(c, model, dev, mesh, meta)
        except torch.OutOfMemoryError as e:
            meta.update(oom=True, oom_phase="build", error=f"OutOfMemoryError: {e}")
            return summarize(c, steps, meta)
        if on_gpu:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        meta["build_s"] = round(time.perf_counter() - t0, 3)
        meta["param_bytes_local"] = local_bytes(model)
        batches = mp.random_batches(c, dev)
        if on_gpu:
            meta["alloc_setup_B"] = torch.cuda.memory_allocated(dev)
        if c["engine"] == "tp":
            from torch.distributed.tensor.parallel import loss_parallel

            # The head's logits stay sharded over the vocabulary; the loss reduces
            # across the shards (Megatron's vocabulary-parallel cross-entropy), in
            # the forward and the backward.
            def forward(m):
                with loss_parallel():
                    return model(input_ids=batches[m], labels=batches[m]).loss

            def backward_tp(loss):
                with loss_parallel():
                    backward(loss)

            run_phase = mp.phase_runner(c, dev, forward, backward_tp, step, zero_grad)
        else:
            run_phase = mp.phase_runner(c, dev, lambda m: mp.loss_of(c, model, batches[m]),
                                        backward, step, zero_grad)
        mp.run_steps(c, dev, run_phase, steps, meta)
        return summarize(c, steps, meta)
    finally:
        dist.destroy_process_group()


def summarize(c, steps, meta):
    """measure_pytorch's row; a CPU run has no peaks to report."""
    row = mp.summarize(c, steps, meta)
    if meta.get("device") == "cpu":
        row["peak_train_B"] = row["reserved_peak_train_B"] = None
        if row["status"] == "ok":
            row["status"] = "cpu"
    return row


# ---------------------------------------------------------------- driver

def engines_missing(configs):
    """Names of engines the configurations need that cannot be imported."""
    need = {c["engine"] for c in configs}
    missing = []
    if "deepspeed" in need:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            missing.append("deepspeed")
    return missing


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="?", help="JSON list or JSON lines of configurations "
                    "('-': stdin; default: the built-in sweep)")
    ap.add_argument("-o", "--out", help="write the rows here (default: stdout)")
    ap.add_argument("--timeout", type=float, help="seconds per configuration (default: its timeout_s)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="measure only these configurations")
    ap.add_argument("--skip-engine", nargs="+", default=[], choices=ENGINES,
                    help="leave out configurations of these engines")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="configurations run at once, each in its own process (default 1)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: run every configuration at tiny size under the fake group (no peaks)")
    ap.add_argument("--list", action="store_true", help="print the configurations as JSON lines")
    ap.add_argument("--dry-run", action="store_true", help="check and print the configurations; no run")
    ap.add_argument("--child", nargs="?", const="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        c = normalize_config(json.loads(sys.stdin.read()))
        print(json.dumps(measure(c, args.child)))
        return 0
    try:
        if args.configs:
            configs = mp.read_configs(args.configs, normalize=normalize_config)
        else:
            configs = [normalize_config(c) for c in default_sweep()]
    except (mp.ConfigError, OSError) as e:
        print(f"measure_multigpu: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {c["name"] for c in configs})
        if unknown:
            print(f"measure_multigpu: no configuration named {', '.join(unknown)}", file=sys.stderr)
            return 2
        configs = [c for c in configs if c["name"] in args.only]
    configs = [c for c in configs if c["engine"] not in args.skip_engine]
    if args.list:
        for c in configs:
            print(json.dumps(c))
        return 0
    if args.dry_run:
        for c in configs:
            cls, kwargs = mp.model_config_kwargs(c)
            print(json.dumps({"name": c["name"], "engine": c["engine"], "world_size": c["world_size"],
                              "model_class": cls, "model_config": kwargs, "lora": mp.lora_kwargs(c),
                              "deepspeed": deepspeed_config(c) if c["engine"] == "deepspeed" else None,
                              "phases": mp.phase_names(c["grad_accum"])}))
        return 0
    missing = engines_missing(configs)
    if missing:
        print(f"measure_multigpu: {', '.join(missing)} is not installed; install it "
              "(tools/requirements.txt) or pass --skip-engine " + " ".join(missing), file=sys.stderr)
        return 2
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("measure_multigpu: no CUDA device (this script measures GPU memory; "
              "--device cpu checks the configurations run)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        configs = [tiny(c) for c in configs]
    out = open(args.out, "w") if args.out else sys.stdout
    env = mp.env_record(args.device)
    env["fake_process_group"] = True
    try:
        env["deepspeed"] = __import__("deepspeed").__version__
    except ImportError:
        env["deepspeed"] = None
    print(json.dumps(env), file=out, flush=True)
    if args.jobs < 1:
        print("measure_multigpu: --jobs must be at least 1", file=sys.stderr)
        return 2
    failed = 0
    t0 = time.perf_counter()

    def one(c):
        return mp.run_child(c, args.timeout or c["timeout_s"], script=__file__, args=[args.device])

    # Each process reads its own allocator's peak, so configurations running
    # side by side measure what they measure alone; they share the device's
    # memory, though, and one that runs out of it beside another is to be run
    # again alone (tools/README.md).
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = pool.map(one, configs)  # in the configurations' order
        for c, row in zip(configs, rows):
            failed += row["status"] == "error"
            row["concurrent_jobs"] = args.jobs
            print(json.dumps(row), file=out, flush=True)
            peak = row.get("peak_train_B")
            print(f"{c['name']:24s} {row['status']:5s} "
                  f"{'' if peak is None else f'{peak / 2**30:.2f} GiB'} {row.get('error') or ''}",
                  file=sys.stderr, flush=True)
    print(f"measure_multigpu: {len(configs)} configurations in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
