//! Runtime profiles: what differs between the executors a plan can target.
//!
//! The memory model ([`crate::memory`]) is written once, as mechanisms (which
//! tensors exist, which are saved for the backward pass, which temporaries an
//! optimizer allocates). What an executor adds on top — autocast, attention
//! kernels, allocator rounding, library workspaces, the CUDA context — lives
//! here as data, one constant per fact, each commented with where it was
//! measured. Invariant: a profile holds no per-configuration corrections;
//! every number applies to every plan that targets that executor.

pub mod engines;

pub use engines::Engine;

use crate::spec::{Attention, Target};
use serde::Serialize;

/// Does rcoa's Burn executor run ZeRO-3 and parameter offload (`offload = [params]`, with
/// ZeRO-3 or alone on one rank)? The one switch for `target burn`: when false the sharding
/// and offload passes refuse them again, so the search never picks what `rcoa run` refuses.
pub const BURN_RUNS_ZERO3: bool = true;

/// Units (embedding, a layer, the head) the Burn executor's ZeRO-3 gathers ahead of the one
/// running: at most `1 + ZERO3_PREFETCH_UNITS` gathered units are in flight besides those
/// kept by graphs (non-checkpointed layers keep theirs until their backward).
pub const ZERO3_PREFETCH_UNITS: usize = 1;

/// Does the Burn executor's ZeRO-3 / parameter offload keep the fp32 gradient-shard
/// accumulator in host memory when the optimizer is there (each unit's reduced shard sent
/// down as the backward leaves the unit, as DeepSpeed's ZeRO-Offload does)? It does:
/// `backend/src/shard/zero3.rs` adds each unit's shard into a host accumulator and the host
/// optimizer steps from it, so the device holds only the transient unit gradient. That is
/// what fits a 7B full fine-tune on one 24 GB GPU (its fp32 accumulator alone is 29 GB).
/// Clear it only if the executor moves the accumulator back to the device.
pub const ZERO3_HOST_GRAD_ACCUMULATOR: bool = true;

/// Bytes rcoa's Burn executor allocates per dequantized value of an NF4 chunk
/// (`backend/src/quant/qlora.rs`: the byte indices widened to integers, the two nibble
/// halves, their interleaving, the scaled values), plus [`BURN_NF4_CHUNK_FIXED_BYTES`] per
/// use. Measured on the CPU (ndarray, fp32, counting allocator): `201/16 · C + 1184` bytes
/// for a chunk of `C` values. Not measured on CUDA, where the indices are i32 rather than
/// i64 and a bf16 compute dtype adds the chunk's 2-byte cast: about 10 to 13 bytes a
/// value, so the CPU figure stands for it until a GPU trace replaces it.
pub const BURN_NF4_CHUNK_BYTES_PER_VALUE: f64 = 201.0 / 16.0;
/// The per-use constant of the same measurement (the chunk's block scales and the table).
pub const BURN_NF4_CHUNK_FIXED_BYTES: u64 = 1184;

/// How the executor dequantizes a QLoRA NF4 base weight when a matmul uses it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Nf4Dequant {
    /// The whole weight in the compute dtype, per use in the forward and again in the
    /// backward (bitsandbytes' `dequantize_4bit` inside `MatMul4Bit`).
    WholeWeight,
    /// [`crate::memory::quant::QLORA_CHUNK_VALUES`] values at a time (rcoa's Burn
    /// executor): `bytes_per_value · C + fixed_bytes` for a chunk of `C` values
    /// ([`crate::memory::quant::qlora_dequant_transient`]), scratch of the projection's
    /// forward and of its input gradient, never saved for the backward.
    Chunked {
        bytes_per_value: f64,
        fixed_bytes: u64,
    },
}

// At start-up the Burn executor builds the model one unit at a time (embedding, each layer,
// head: `backend/src/setup.rs`), loading, casting or sharding each before the next is made,
// so the whole model never exists in fp32: `memory::burn_setup` charges that build as the
// `setup` point (what the units before leave + the unit being made).

/// What differs between executors, for the memory and time models.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Profile {
    pub name: &'static str,
    /// The engine whose own allocations (buckets, flat partitions, gathered units) are added
    /// to the tape (`memory::engines`).
    pub engine: Engine,
    /// `params = fp32, compute = bf16` runs as autocast: per-op casts of
    /// activations, cached 16-bit copies of trainable weights for the whole
    /// forward, fp32 residual stream. Without it the executor computes in the
    /// element type of the weights.
    pub autocast: bool,
    /// SDPA/flash kernels exist: attention keeps q, k, v, the output and a
    /// log-sum-exp, never the `[batch, heads, seq, seq]` scores.
    pub fused_attention: bool,
    /// Grouped-query attention runs without materialising repeated k/v
    /// (`enable_gqa` in SDPA).
    pub gqa_without_repeat: bool,
    /// The causal-LM loss upcasts the logits to fp32 before the cross entropy
    /// (the fp32 copy and the fp32 log-softmax both exist at the loss).
    pub loss_upcasts_logits: bool,
    /// The masked-LM loss upcasts too (otherwise log_softmax runs in the logits' dtype).
    pub mlm_upcasts_logits: bool,
    /// Weights stored wider than the compute dtype are cast at every use (not cached); the
    /// copies are saved for the backward like any matmul operand.
    pub weight_cast_per_use: bool,
    /// LoRA adapter weights are kept in fp32 whatever the base dtype (PEFT),
    /// and the adapter input is cast to the adapter dtype before `lora_A`.
    pub adapters_fp32: bool,
    /// Adapter targets match module names by suffix (PEFT): on encoders `o` (`dense`)
    /// also adapts the MLP's `intermediate.dense` and `output.dense`.
    pub adapter_suffix_match: bool,
    /// RMSNorm computes in fp32 whatever the input dtype (HF's `LlamaRMSNorm`).
    pub norm_in_fp32: bool,
    /// Allocation granularity of the device allocator, bytes.
    pub alloc_round: u64,
    /// Large allocations come from segments rounded up to this (0: no such rule), and a
    /// block whose leftover is at most `split_min` is handed out whole, so the leftover
    /// counts as allocated.
    pub large_segment_round: u64,
    pub split_min: u64,
    /// Below this size a large allocation is carved from a fresh `large_buffer` segment.
    pub min_large_alloc: u64,
    pub large_buffer: u64,
    /// Library workspaces allocated through the allocator and kept for the
    /// whole run (counted in the peak), bytes.
    pub workspace_bytes: u64,
    /// Device memory the executor uses outside its allocator (CUDA context,
    /// kernels, communication buffers): not in the predicted peak, kept out
    /// of the budget when `fit.reserve` is not given.
    pub default_reserve_bytes: u64,
    /// The tape mirrors rcoa's Burn executor op for op (`backend/src/model.rs`, `loss.rs`)
    /// under Burn 0.21's autodiff save rules instead of PyTorch/Hugging Face's: see
    /// `memory::build` (`burn_*` helpers) for each op and what its backward keeps.
    pub burn_ops: bool,
    /// ZeRO-2 frees each gradient as the backward produces it (PyTorch engines' bucketed
    /// reduce-scatter during the backward). rcoa's Burn executor reduce-scatters one flat
    /// vector after the backward (`backend/src/shard`), so every gradient is whole until then.
    pub grads_sharded_in_backward: bool,
    /// QLoRA's NF4 base stores its block scales double-quantized (bitsandbytes'
    /// `compress_statistics`, `bnb_4bit_use_double_quant`): 8-bit scale codes plus an fp32
    /// scale per 256 blocks, instead of one fp32 absmax per 64-value block.
    pub nf4_double_quant: bool,
    /// What a use of an NF4 base weight dequantizes at once, and so the scratch it takes.
    pub nf4_dequant: Nf4Dequant,
    /// Bytes a host optimizer step touches per second per GPU's share of the host
    /// (`offload = [optimizer]`): weights, gradients and state read, weights and state written.
    pub host_optimizer_bytes_per_s: f64,
    /// What one process sends per second to another through the executor's own transport
    /// between nodes, whatever the network offers (`None`: the engine uses NCCL, and the
    /// network is the limit). Priced as the rate of the node's one ring, since the
    /// executor reduces a node's devices locally first.
    pub process_transport_bytes_per_s: Option<f64>,
    /// An element-wise op writes into an input buffer nothing else references (CubeCL's
    /// in-place kernels when a tensor handle is uniquely owned): the output takes no new
    /// bytes when an input of the same size dies at that op.
    pub inplace_elementwise: bool,
    /// The executor measures bytes in use only at segment boundaries (after each layer's
    /// forward and backward, the loss, the optimizer): `peak_bytes` is the highest of
    /// those, and the transients inside a segment are covered by the pool factor below.
    pub peak_sampled_at_segments: bool,
    /// A checkpointed layer's recompute keeps the layer's output until the layer's backward
    /// starts (the Burn executor backpropagates `sum(y · dy)` from it); autograd engines
    /// recompute only what the backward saved.
    pub recompute_holds_output: bool,
    /// Device memory the allocator's pool reserves per byte in use at the highest point of
    /// the step, transients inside segments included (1.0: the reserve covers it): `fits`
    /// checks `highest in use x factor + reserve` against the budget.
    pub pool_factor: f64,
    /// The same when some layer is recomputed in the backward.
    pub pool_factor_recompute: f64,
    /// Fraction of the GPU's dense rate for the compute type a step's matmuls reach.
    pub matmul_efficiency: f64,
    /// The same for fp32 compute (TF32 where the GPU has it), where the executor's
    /// products reach a different fraction than its 16-bit ones; `None`: `matmul_efficiency`.
    pub fp32_matmul_efficiency: Option<f64>,
    /// Fraction of the dense rate eager attention's two products (`q kᵀ`, `probs v`)
    /// reach, counted as the model counts them (half the square under a causal mask),
    /// where the executor runs them apart from its linear layers; `None`:
    /// `matmul_efficiency`.
    pub attention_matmul_efficiency: Option<f64>,
    /// Fraction of the dense bf16 rate the executor's own fused attention kernels
    /// (`attention = flash`) reach on their block products, when it differs from
    /// `matmul_efficiency`'s.
    pub fused_attention_efficiency: Option<f64>,
    /// Fraction of the GPU's fp32 CUDA-core rate (`GpuSpec::cuda_core_tflops`) the
    /// executor's `Rows` attention kernels reach, where its tensor-core kernels do not run
    /// (`burn_flash_one_pass`); `None`: `fused_attention_efficiency`'s rate.
    pub fused_attention_rows_efficiency: Option<f64>,
    /// Fraction of the memory bandwidth element-wise ops reach.
    pub bandwidth_efficiency: f64,
    /// Fixed time per step (optimizer launch, Python overhead), seconds.
    pub step_overhead_s: f64,
    /// Launch and framework overhead per kernel (eager execution), seconds: what makes
    /// many small micro-batches slower than few large ones.
    pub kernel_overhead_s: f64,
}

impl Profile {
    /// Whether `attention` runs as a fused kernel that keeps no `[batch, heads, seq, seq]`
    /// tensor: SDPA/flash where the engine has them, and rcoa's own flash kernel
    /// (`attention = flash`) in the Burn executor.
    pub fn fused(&self, attention: Attention) -> bool {
        attention != Attention::Eager
            && (self.fused_attention || (self.burn_ops && attention == Attention::Flash))
    }

    /// Bytes the allocator counts for a request of `raw` bytes.
    pub fn allocated(&self, raw: u64) -> u64 {
        let r = self.alloc_round.max(1);
        let size = raw.div_ceil(r) * r;
        if self.large_segment_round == 0 || size <= self.split_min {
            return size;
        }
        let segment = if size < self.min_large_alloc {
            self.large_buffer
        } else {
            size.div_ceil(self.large_segment_round) * self.large_segment_round
        };
        if segment.saturating_sub(size) > self.split_min {
            size
        } else {
            segment.max(size)
        }
    }

    pub fn for_target(target: Target) -> Profile {
        match target {
            Target::Pytorch => Profile::pytorch(),
            Target::Burn => Profile::burn(),
            Target::Fsdp => Profile::fsdp(),
            Target::Deepspeed => Profile::deepspeed(),
            Target::Megatron => Profile::megatron(),
        }
    }

    /// PyTorch eager with Hugging Face modules and PEFT adapters, calibrated on
    /// `tests/groundtruth/h100-pytorch.jsonl` (torch 2.11, H100 80GB).
    pub fn pytorch() -> Profile {
        Profile {
            name: "pytorch",
            engine: Engine::Eager,
            // DSL.md: `target pytorch` runs fp32 weights with bf16 compute as autocast.
            autocast: true,
            // groundtruth llama*_base vs llama350m_eager: SDPA rows save no score matrix.
            fused_attention: true,
            // groundtruth llama1b_eager_s512 vs llama1b_s512: SDPA saves k/v at kv_heads width
            // (12.6 MB per layer less than eager, which repeats k/v to all heads).
            gqa_without_repeat: true,
            // transformers' ForCausalLMLoss calls `logits.float()`; MLM/CE under autocast
            // runs log_softmax in fp32: the backward peak of every `lm` row is
            // 2 x tokens x vocab x 4 bytes above the end of the forward (llama1b_base).
            loss_upcasts_logits: true,
            // XLMRobertaForMaskedLM calls CrossEntropyLoss on the bf16 logits
            // (groundtruth xlmrl_mlm_b16: no fp32 copy of the logits at the forward peak).
            mlm_upcasts_logits: false,
            // Autocast's casts (cached for trainable weights) stand for this.
            weight_cast_per_use: false,
            // groundtruth README: PEFT adapter weights are fp32 even with bf16 base weights.
            adapters_fp32: true,
            // PEFT `target_modules=["query","key","value","dense"]` on XLM-R adapts every
            // `*.dense` module: groundtruth xlmrl_con_lora32_b64 saves the MLP adapters'
            // inputs (4.2 GB more at the end of the forward than q/k/v/o alone).
            adapter_suffix_match: true,
            // LlamaRMSNorm: `hidden_states.to(torch.float32)`; the fp32 copy is saved
            // (groundtruth llama1b_bf16 activations).
            norm_in_fp32: true,
            // CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): blocks are multiples
            // of 512 B; allocations over 1 MiB come from segments of 20 MiB (under 10 MiB) or
            // rounded up to 2 MiB, and a leftover of at most 1 MiB is not split off. groundtruth
            // xlmrxl_*: each 2560x2560 fp32 weight (exactly 25 MiB) takes 26 MiB, 151 MB over
            // the parameter bytes at setup.
            alloc_round: 512,
            large_segment_round: 2 << 20,
            split_min: 1 << 20,
            min_large_alloc: 10 << 20,
            large_buffer: 20 << 20,
            // Allocated bytes after `zero_grad` minus params and optimizer state is
            // 67,108,864 in every llama1b row: two 32 MiB cuBLAS workspaces (main
            // thread and the autograd device thread) on sm90.
            workspace_bytes: 64 << 20,
            // `device_used_after_init_B` = 552,402,944 (CUDA context + kernels) plus
            // headroom for the allocator's fragmentation at the peak.
            default_reserve_bytes: 1 << 30,
            burn_ops: false,
            grads_sharded_in_backward: true,
            // The QLoRA recipe (Dettmers et al. 2023, `bnb_4bit_use_double_quant=True`) that
            // `plans/mistral-7b-qlora-1x24gb.plan` follows.
            nf4_double_quant: true,
            // bitsandbytes' `MatMul4Bit` dequantizes the whole weight per use.
            nf4_dequant: Nf4Dequant::WholeWeight,
            host_optimizer_bytes_per_s: crate::cost::parallel::CPU_OPTIMIZER_BYTES_PER_S,
            process_transport_bytes_per_s: None,
            inplace_elementwise: false,
            peak_sampled_at_segments: false,
            recompute_holds_output: false,
            // The 1 GiB reserve above covers the caching allocator's fragmentation.
            pool_factor: 1.0,
            pool_factor_recompute: 1.0,
            // groundtruth step3_ms: the large rows (llama8b_lora16_gc, xlmrxl_*_gc) reach
            // 35-45% of 989 TFLOP/s in their matmuls; 42% (with the per-kernel overhead
            // below) puts the median predicted/measured step time of the 45 measured rows
            // at 1.03 (range 0.67-1.38).
            matmul_efficiency: 0.42,
            fp32_matmul_efficiency: None,
            attention_matmul_efficiency: None,
            fused_attention_efficiency: None,
            fused_attention_rows_efficiency: None,
            bandwidth_efficiency: 0.8,
            step_overhead_s: 0.015,
            // Eager PyTorch dispatch + launch, ~10 us a kernel (groundtruth llama1b_b1_accum4:
            // four micro-batches of 1 take 2.5x one micro-batch of 4, not 1x).
            kernel_overhead_s: 10e-6,
        }
    }

    /// rcoa's Burn 0.21 executor (`rcoa run`, CubeCL CUDA backend), calibrated on the H100
    /// measurements of `docs/burn-h100.md` (raw samples in `backend/bench/h100-results/`).
    /// The tape mirrors the executor's ops (`burn_ops`); what was measured:
    /// - no autocast: bf16 is an element type; fp32 weights are cast at every use and the
    ///   copy is saved by the matmul that reads it (25.7 MB per 350M layer, part of the
    ///   1,229,800,000 B each layer's forward keeps in `llama350m_eager.plan-trace.err`);
    ///   fp32 compute keeps fp32 activations (llama125m_fp32: 24.29 GB vs 13.74 GB);
    /// - 16-bit weights with an fp32 master: a persistent 16-bit working copy, the fp32
    ///   master and fp32 gradients (llama125m_bf16 measures exactly like autocast);
    /// - attention keeps one `[b, h, s, s]` tensor per layer, the probabilities
    ///   (`backend/src/ops.rs` `softmax_last`; Burn's composite softmax kept three:
    ///   3 x 268,435,456 B of the 1,229,800,000 B per 350M layer);
    /// - the loss: `log_softmax(logits.cast(F32))` keeps the shifted fp32 logits (+1,148 MB
    ///   over the last layer in the 350M trace, with the head's saves);
    /// - the peak in use is sampled at segment boundaries (`backend/src/train.rs` `mark`).
    pub fn burn() -> Profile {
        Profile {
            name: "burn",
            engine: Engine::Burn,
            // BURN.md: "bf16/f16 are element types of the backend".
            autocast: false,
            // BURN.md: "Burn's multi-head attention keeps the full [batch, heads, seq, seq]
            // score matrix; model it as eager attention".
            fused_attention: false,
            gqa_without_repeat: false,
            // backend/src/loss.rs: `log_softmax(logits.cast(F32))` for causal and masked LM.
            loss_upcasts_logits: true,
            mlm_upcasts_logits: true,
            // backend/src/model.rs `Linear::forward`: `to_dtype(weight, compute)` per call.
            weight_cast_per_use: true,
            // rcoa's adapters are built in the model's element type.
            adapters_fp32: false,
            // rcoa's DSL names projections, not module paths.
            adapter_suffix_match: false,
            // backend/src/model.rs `NormLayer::forward` computes in the element type.
            norm_in_fp32: false,
            // CubeCL's `bytes_in_use` counts tensor bytes: the 350M trace's per-layer and
            // loss increments match the tensors' sizes to within 50 KB (docs/burn-h100.md).
            alloc_round: 512,
            large_segment_round: 0,
            split_min: 0,
            min_large_alloc: 0,
            large_buffer: 0,
            // No cuBLAS workspace: CubeCL matmul kernels take no workspace buffer.
            workspace_bytes: 0,
            // docs/burn-h100.md: nvidia-smi's max memory.used is 0.57-0.59 GB above CubeCL's
            // reserved peak on every measured row (CUDA context and kernels).
            default_reserve_bytes: 640 << 20,
            burn_ops: true,
            grads_sharded_in_backward: false,
            // backend/src/model.rs quantizes QLoRA's base double-quantized
            // (`QLORA_DOUBLE_QUANT`, the QLoRA recipe); `backend/src/quant/nf4.rs` does both.
            nf4_double_quant: true,
            // backend/src/quant/qlora.rs: chunks of 4 Mi values, forward and input gradient.
            nf4_dequant: Nf4Dequant::Chunked {
                bytes_per_value: BURN_NF4_CHUNK_BYTES_PER_VALUE,
                fixed_bytes: BURN_NF4_CHUNK_FIXED_BYTES,
            },
            // backend/bench/host-optimizer on the 2-core machine this was written on (no GPU):
            // the executor's AdamW over 32 Mi fp32 parameters on 2 threads, 0.048 s, i.e.
            // 19.6 GB/s of 28 bytes per parameter (0.47 of a plain copy's 42 GB/s read + write).
            // This machine's figure; a GPU server's host share is to be measured there.
            host_optimizer_bytes_per_s: 19.6e9,
            // burn-collective's ring between processes: device to host, WebSocket, host to
            // device (backend/vendor/RCOA-PATCH.md). `cargo bench -p rcoa-backend --bench
            // transport` on the H100 machine (16 cores), two processes on loopback, 256 MiB of
            // fp32: bus bandwidth 0.53 GB/s all-reduce, 0.31 reduce-scatter, 0.34 all-gather
            // (bare TCP 2.2-2.7 GB/s; backend/bench/h100-results/2026-11-25b/call1/transport.txt).
            // ZeRO exchanges are reduce-scatters and all-gathers: the slower of the two is taken.
            process_transport_bytes_per_s: Some(0.31e9),
            inplace_elementwise: true,
            // backend/src/train.rs samples `bytes_in_use` after every layer's forward and
            // backward, the loss and the optimizer: what `rcoa run` reports as measured.
            peak_sampled_at_segments: true,
            // `Trainer::recompute` returns the recomputed output `y`, alive at the recompute's
            // sample: QLoRA at Mistral-7B's shape measured one [4, 2048, 4096] bf16 tensor
            // (64 MiB) over the prediction there, at 8 and at 32 layers alike
            // (docs/burn-h100.md, "2026-11-27").
            recompute_holds_output: true,
            // `rcoa run`'s pools on CUDA (`--memory-pool compact`, the default since
            // 2026-11-28f), which keep pages once grown. Measured reserved over the model's
            // highest bytes in use (transients inside segments included: the loss's fp32
            // log-softmax adds 3.1 GB over the sampled 350M peak): 1.045 (speed350m, H100,
            // cold), 1.053 (speed350m with flash attention, H200), 1.004 (llama125m_selective,
            // H200, cold); with layers recomputed 1.107 to 1.264 (the 125M rows and QLoRA's
            // 8 layers on an H200, cold: one 1 GiB page is a sixth of their 6 GB). Replays of
            // other shapes reach 1.114 and, with everything recomputed at a 152k vocabulary,
            // 1.252 (docs/memory-pool.md). The worst of each, rounded up, so a plan predicted
            // to fit does not OOM. Compact's pages do not depend on the card; CubeCL's own
            // pools (`--memory-pool cubecl`, not what this predicts) reserve 1.2–1.7
            // × on an H100 and, by replay, up to 2.1 × on an H200, whose pages are larger.
            pool_factor: 1.15,
            pool_factor_recompute: 1.30,
            // The step's terms fitted together (2026-11-30j, `docs/burn-h100.md`) to the seven
            // steps measured without per-layer GPU syncs: on an H100, 350m eager 0.2125 s, 350m
            // gc 0.288 s, 350m fp32 0.392 s, 125m fp32 0.147 s and the GQA holdout 0.1625 s
            // (2 micro-steps); on an H200 with the register flash kernels, 350M 0.1684 s and
            // 1.24B 0.4165 s. Every row within 2.5 % (`compiler/tests/burn_step_time.rs`);
            // leaving one out predicts it within 6 %, the 1.24B's within 12 %. One efficiency
            // for all products (0.13 until then) could not hold them: it paid for eager
            // attention's products, which Burn runs whole under a causal mask and at K = 64,
            // so the flash plans, which have none, read 30 % and 45 % slow. CubeCL's 16-bit
            // linear products: 0.21 of the dense rate (the 350M's kernel profile measured 0.18
            // of its matmul kernels alone; the 1.24B's larger products run faster).
            matmul_efficiency: 0.21,
            // CubeCL's f32 products, of the TF32 rate.
            fp32_matmul_efficiency: Some(0.18),
            // Eager attention's scores and `probs v`, counted as the model counts them.
            attention_matmul_efficiency: Some(0.0575),
            // rcoa's tensor-core flash kernels on an H200 (2026-11-28f, after the staged
            // tiles were padded): 20.0 TFLOP/s forward and 14.1 backward in FlashAttention's
            // count, i.e. 0.86 and 0.87 ms per block product of the 350M shape (2 forward, 7
            // backward): 20 TFLOP/s of the products the model counts, 0.020 of the dense
            // bf16 rate (an H100's SMs and clocks are the H200's). The linear layers' 0.13
            // of then priced them 6.5 times too fast: the 350M flash plan predicted 0.227 s
            // a step against 0.314 s measured. Since 2026-11-30h the register kernels run by default: 0.404
            // ms forward and 1.053 ms backward (one pass) at that shape on an H200, 5.2 times
            // the block kernels' 1.714 + 6.093 ms above (`docs/flash-attention.md`).
            fused_attention_efficiency: Some(0.10),
            // The `Rows` kernels on an H200 (2026-11-28f, docs/flash-attention.md): 7.307 ms
            // forward and 20.939 ms backward at the 350M shape, 34.4 GFLOP forward and 3.5
            // times that backward as the model counts them, 5.48 TFLOP/s in all: 0.082 of
            // the CUDA cores' 66.9 TFLOP/s. Scalar FMAs scale with those, not with the tensor
            // cores (an L40S has 1.4 times an H100's, at 0.37 times its bf16 rate).
            fused_attention_rows_efficiency: Some(0.082),
            // Fitted with the rates above. The 350M flash step's kernel profile (H200) puts
            // 37 ms in memory-bound kernels, which move about half the bytes the tape counts
            // at the full bandwidth (12.9 ms): fusion joins passes the tape counts apart, and
            // what is left runs well under the bandwidth. Its 2,254 launches and the host
            // leave the GPU idle 12.6 ms a step.
            bandwidth_efficiency: 0.45,
            step_overhead_s: 0.0075,
            // CubeCL launches (fused element-wise kernels are fewer than PyTorch's).
            kernel_overhead_s: 6e-6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Profile;
    use crate::spec::{Attention, Target};

    /// The Burn executor fuses only `attention = flash` (its own kernel); PyTorch fuses
    /// SDPA and flash; eager keeps the scores everywhere.
    #[test]
    fn which_attention_is_fused() {
        let burn = Profile::for_target(Target::Burn);
        let torch = Profile::for_target(Target::Pytorch);
        assert!(burn.fused(Attention::Flash));
        assert!(!burn.fused(Attention::Sdpa));
        assert!(!burn.fused(Attention::Eager));
        assert!(torch.fused(Attention::Sdpa) && torch.fused(Attention::Flash));
        assert!(!torch.fused(Attention::Eager));
    }

    #[test]
    fn caching_allocator_rounding() {
        let p = Profile::pytorch();
        const MIB: u64 = 1 << 20;
        assert_eq!(p.allocated(1), 512);
        assert_eq!(p.allocated(513), 1024);
        // Under 10 MiB: carved from a 20 MiB segment, the rest split off.
        assert_eq!(p.allocated(4 * MIB), 4 * MIB);
        // Exactly 16 MiB: a 16 MiB segment, nothing left.
        assert_eq!(p.allocated(16 * MIB), 16 * MIB);
        // 25 MiB (a 2560x2560 fp32 weight): a 26 MiB segment, the 1 MiB left is not split.
        assert_eq!(p.allocated(25 * MIB), 26 * MIB);
        // 24.5 MiB: leftover 1.5 MiB is split off.
        assert_eq!(p.allocated(24 * MIB + MIB / 2), 24 * MIB + MIB / 2);
        // Burn has no such rule.
        assert_eq!(Profile::burn().allocated(25 * MIB), 25 * MIB);
    }
}
