#!/usr/bin/env python3
"""Trace the tensor bytes of a PyTorch training step without a GPU.

Runs the training step that tools/measure_pytorch.py runs on an H100 (the same
Hugging Face model, PEFT adapter, loss, optimizer and checkpointing, from the
same configuration format) on the `meta` device, where every tensor has its
shape, dtype and storage but no data, so a full-size 3.5B-parameter step
takes seconds on a laptop. A TorchDispatchMode sees every tensor each aten op
creates; a weak reference to its storage says when the storage dies (autograd
keeps the storage of a saved tensor alive, so saved activations are counted
until their backward runs). Each storage is counted with the CUDA caching
allocator's rounding (the rule `Profile::allocated` in the compiler follows),
so the live total is what `torch.cuda.memory_allocated()` would report for
these tensors.

What it cannot see, and what differs from a CUDA run:
- kernel workspaces (cuBLAS's two 32 MiB workspaces, which the compiler's
  pytorch profile holds as `workspace_bytes`; added to `peak_train_B` below
  with --cuda-workspace), cuDNN/flash scratch, NCCL buffers;
- the allocator's segments and fragmentation (only the rounded request);
- autocast: meta tensors have no autocast dispatch key, so CUDA autocast is
  emulated (`CudaAutocast`) at the level of the functions these models call
  (linear/matmul/SDPA in bf16; softmax, log_softmax, layer_norm and the
  losses in fp32; casts of leaf weights cached for the forward). Rotary
  embeddings that disable autocast are cast like the rest (tiny tensors).
- kernels that save other tensors on CUDA are called as CUDA runs them
  (`CudaKernels`): dropout as the fused `native_dropout` (a 1-byte mask, not
  a noise tensor in the input's dtype), SDPA as CUDA picks it for these
  inputs (flash for 16-bit inputs, the memory-efficient kernel for fp32).

Usage:
  memtrace.py CONFIGS [--only NAME...] [-o OUT.jsonl] [--top N] [--steps N]
CONFIGS: JSON list or JSON lines, as tools/measure_pytorch.py reads.
Each output line is a row in the ground-truth schema (so `rcoa validate OUT`
compares it with the compiler) with `"record": "config"`, `"trace": "meta"`,
the peak, its phase, the largest live tensors at the peak, and the bytes
autograd saves per layer.
"""
import argparse
import contextlib
import json
import os
import sys
import weakref
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import measure_pytorch as mp  # noqa: E402

# c10/cuda/CUDACachingAllocator.cpp as the compiler's Profile::pytorch holds it.
ROUND = 512
SPLIT_MIN = 1 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
LARGE_SEGMENT_ROUND = 2 << 20
CUBLAS_WORKSPACES = 64 << 20


def allocated(raw):
    """Bytes the CUDA caching allocator counts for a request of `raw` bytes."""
    size = -(-raw // ROUND) * ROUND
    if size <= SPLIT_MIN:
        return size
    if size < MIN_LARGE_ALLOC:
        segment = LARGE_BUFFER
    else:
        segment = -(-size // LARGE_SEGMENT_ROUND) * LARGE_SEGMENT_ROUND
    return size if segment - size > SPLIT_MIN else max(segment, size)


class StorageTracker(TorchDispatchMode):
    """Live storage bytes: each storage counted once, from its creation to its death."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage key -> (bytes, label)
        self.refs = {}
        self.phase = "setup"
        self.current = 0
        self.peak = 0
        self.peak_phase = None
        self.peak_live = []
        self.phase_peaks = defaultdict(int)

    def track(self, t, label):
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        nbytes = allocated(st.nbytes()) if st.nbytes() else 0
        self.live[key] = (nbytes, label)
        self.current += nbytes

        def died(_ref, key=key):
            b, _ = self.live.pop(key, (0, None))
            self.refs.pop(key, None)
            self.current -= b

        self.refs[key] = weakref.ref(st, died)
        self._note()

    def _note(self):
        if self.current > self.phase_peaks[self.phase]:
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase
            self.peak_live = list(self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        label = f"{self.phase}:{func.__name__}"
        for t in tree_flatten(out)[0]:
            self.track(t, label)
        return out


class SavedPerLayer:
    """Bytes autograd saves in each module's forward (non-parameter storages, each once)."""

    def __init__(self, params, layers):
        self.params = {p.untyped_storage()._cdata for p in params}
        self.layer = None
        self.saved = defaultdict(dict)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_a, i=i: setattr(self, "layer", i))
            layer.register_forward_hook(lambda *_a: setattr(self, "layer", None))

    def pack(self, t):
        if self.layer is not None:
            st = t.untyped_storage()
            if st._cdata not in self.params:
                self.saved[self.layer][st._cdata] = allocated(st.nbytes())
        return t

    def per_layer(self):
        return {i: sum(v.values()) for i, v in sorted(self.saved.items())}


LOW = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
       torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm}
FP32 = {F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax,
        torch.Tensor.log_softmax, F.layer_norm, F.cross_entropy, F.nll_loss, F.mse_loss}


class CudaAutocast(TorchFunctionMode):
    """torch.autocast("cuda", bfloat16)'s policy for the ops these models call, on any
    device: inputs of matmuls cast to bf16 (a leaf weight's cast cached until the region
    ends), inputs of softmax/log_softmax/layer_norm/losses cast to fp32."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def cast(self, t, dtype):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            return t
        if t.is_leaf and t.requires_grad:
            key = (id(t), dtype)
            if key not in self.cache:
                self.cache[key] = t.to(dtype)
            return self.cache[key]
        return t.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LOW:
            args = [self.cast(a, torch.bfloat16) for a in args]
            kwargs = {k: self.cast(v, torch.bfloat16) for k, v in kwargs.items()}
        elif func in FP32:
            args = [self.cast(a, torch.float32) for a in args]
            kwargs = {k: self.cast(v, torch.float32) for k, v in kwargs.items()}
            if func in (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax,
                        torch.log_softmax, torch.Tensor.log_softmax):
                kwargs.pop("dtype", None)
        elif func is F.scaled_dot_product_attention:
            args = [self.cast(a, torch.bfloat16) for a in args[:3]] + list(args[3:])
        return func(*args, **kwargs)


class CudaKernels(TorchFunctionMode):
    """The ops whose CUDA kernels keep other tensors than their CPU/meta versions.
    F.dropout: CUDA runs the fused `native_dropout` (saves a 1-byte mask); elsewhere
    `input * bernoulli_noise` saves a noise tensor in the input's dtype.
    F.scaled_dot_product_attention: flash for 16-bit inputs without a mask, the
    memory-efficient kernel otherwise (what each saves for its backward)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if training and 0 < p < 1 and not inplace and x.numel() > 0:
                return torch.native_dropout(x, p, True)[0]
            return func(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        scale = kwargs.get("scale")
        if q.dtype in (torch.bfloat16, torch.float16) and mask is None:
            # Flash reads grouped k/v at their own width (no repeat).
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout, causal, False, scale=scale)[0]
        if k.shape[1] != q.shape[1]:
            # The memory-efficient kernel takes no grouped-query attention: the math backend.
            return func(*args, **kwargs)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, dropout, causal, scale=scale)[0]


def recompute_like_forward(model, state, autocast):
    """A checkpointed layer's recompute runs in the autograd engine, where the forward's
    torch-function modes are not active: enter them again. torch.utils.checkpoint re-enters
    the forward's autocast state; the emulation has no state to capture, so the recompute
    runs in a fresh autocast region (its own weight-cast cache, gone with the layer)."""
    for layer in mp.encoder_layers(model):
        inner = getattr(layer, "_gradient_checkpointing_func", None)
        if inner is None:
            continue

        def wrapped(fn, *args, inner=inner, **kwargs):
            def run(*a, **k):
                if state["backward"]:
                    with CudaKernels(), (CudaAutocast() if autocast else contextlib.nullcontext()):
                        return fn(*a, **k)
                return fn(*a, **k)

            return inner(run, *args, **kwargs)

        layer._gradient_checkpointing_func = wrapped


def no_packed_sequences():
    """transformers reads the position ids' values (`.all()`) to detect packed sequences when
    no cache is made (checkpointed Llama); meta tensors have no values. The measured runs
    use plain `arange` positions: one sequence per row, no packing."""
    import transformers.masking_utils as mu

    mu.find_packed_sequence_indices = lambda position_ids: None


def trace(c, steps, top, device):
    torch.manual_seed(0)
    if device == "meta":
        no_packed_sequences()
    dev = torch.device(device)
    model = mp.build_model(c, dev)
    state = {"backward": False}
    recompute_like_forward(model, state, c["autocast"] == "bf16")
    params = [p for p in model.parameters() if p.requires_grad]
    tracker = StorageTracker()
    for name, p in model.named_parameters():
        tracker.track(p, "param")
    for name, b in model.named_buffers():
        tracker.track(b, "buffer")
    opt = mp.make_optimizer(c, params)
    low = 3 if c["family"] == "xlmr" else 0
    batches = [torch.randint(low, c["vocab"], (c["batch"], c["seq"]), device=dev)
               for _ in range(c["grad_accum"])]
    for b in batches:
        tracker.track(b, "input")
    saved = SavedPerLayer(list(model.parameters()), mp.encoder_layers(model))
    autocast = c["autocast"] == "bf16"
    step_peaks = []
    phase_ends = {}
    with tracker, CudaKernels():
        tracker.peak = tracker.current  # the training peak excludes the build
        for n in range(1, steps + 1):
            step_peak = 0
            for phase in mp.phase_names(c["grad_accum"]):
                tracker.phase = f"step{n}.{phase}"
                tracker.phase_peaks[tracker.phase] = tracker.current
                if phase.startswith("fwd"):
                    saved.saved.clear()  # the last forward's saves, not every forward's
                    ac = CudaAutocast() if autocast else contextlib.nullcontext()
                    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
                    with ac, hooks:
                        loss = mp.loss_of(c, model, batches[int(phase[3:])]) / c["grad_accum"]
                    del ac  # its cast cache dies with it, as autocast's does when it exits
                elif phase.startswith("bwd"):
                    state["backward"] = True
                    loss.backward()
                    state["backward"] = False
                    loss = None
                elif phase == "opt":
                    opt.step()
                else:
                    opt.zero_grad(set_to_none=True)
                step_peak = max(step_peak, tracker.phase_peaks[tracker.phase])
                phase_ends[tracker.phase] = tracker.current
            step_peaks.append(step_peak)
    by_label = defaultdict(int)
    for b, label in tracker.peak_live:
        by_label[label] += b
    live_top = sorted(by_label.items(), key=lambda kv: -kv[1])[:top]
    return {
        "peak_tensor_B": tracker.peak,
        "peak_phase": tracker.peak_phase,
        "phase_peaks_B": dict(tracker.phase_peaks),
        "phase_ends_B": phase_ends,
        "step_peaks_B": step_peaks,
        "live_at_peak": [{"label": k, "bytes": v} for k, v in live_top],
        "saved_per_layer_B": saved.per_layer(),
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_trainable": sum(p.numel() for p in params),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs")
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("-o", "--out")
    ap.add_argument("--steps", type=int, default=2,
                    help="optimizer steps (2: the second carries the optimizer state)")
    ap.add_argument("--top", type=int, default=12, help="largest live groups to list")
    ap.add_argument("--device", default="meta", help="meta (default) or cpu")
    ap.add_argument("--cuda-workspace", action="store_true",
                    help="add cuBLAS's two 32 MiB workspaces to peak_train_B (as on an H100)")
    args = ap.parse_args()
    configs = mp.read_configs(args.configs)
    if args.only:
        configs = [c for c in configs if c["name"] in args.only]
        if not configs:
            print(f"memtrace: no configuration named {' '.join(args.only)}", file=sys.stderr)
            return 2
    out = open(args.out, "w") if args.out else sys.stdout
    print(json.dumps({"record": "env", "trace": args.device, "torch": torch.__version__,
                      "transformers": __import__("transformers").__version__,
                      "peft": __import__("peft").__version__}), file=out, flush=True)
    failed = 0
    for c in configs:
        try:
            r = trace(c, args.steps, args.top, args.device)
        except Exception as e:  # one configuration's failure is its row, not the run's end
            failed += 1
            row = {"record": "config", "name": c["name"], "config": c, "trace": args.device,
                   "status": "error", "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(row), file=out, flush=True)
            print(f"{c['name']:34s} error {row['error']}", file=sys.stderr)
            continue
        peak = r["peak_tensor_B"] + (CUBLAS_WORKSPACES if args.cuda_workspace else 0)
        row = {"record": "config", "name": c["name"], "config": c, "trace": args.device,
               "oom": False, "peak_train_B": peak, **r}
        print(json.dumps(row), file=out, flush=True)
        print(f"{c['name']:34s} peak {peak / 2**30:8.3f} GiB at {r['peak_phase']}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
