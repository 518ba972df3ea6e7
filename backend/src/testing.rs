//! Small lowered plans built in Rust, for tests here and in the CLI (they do
//! not need the parser or the compiler). The prediction is a placeholder of
//! zero bytes: these plans are for checking the executor, not the memory model.

use rcoa_compiler::lowered::{LoweredPlan, Prediction, Resolved, LOWERED_PLAN_VERSION};
use rcoa_compiler::spec::*;
use std::collections::BTreeMap;

/// A 2-layer decoder (hidden 32, GQA 4/2 heads, SwiGLU, RoPE, untied head),
/// seq 16, micro-batch 2, AdamW, fp32.
pub fn tiny_plan() -> LoweredPlan {
    let model = ModelSpec {
        name: "tiny".into(),
        arch: Arch::Decoder,
        layers: 2,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn: 64,
        mlp: Mlp::Swiglu,
        norm: Norm::Rmsnorm,
        positions: Positions::Rope,
        vocab: 64,
        max_positions: 64,
        tie_embeddings: false,
        experts: 1,
        experts_per_token: 1,
        dropout: 0.0,
        numerics: Default::default(),
        weights: None,
    };
    LoweredPlan {
        version: LOWERED_PLAN_VERSION,
        model,
        adapter: None,
        hardware: HardwareSpec {
            gpu: GpuSpec::custom("cpu", 1 << 30, 1.0, 1e10),
            gpus_per_node: 1,
            nodes: 1,
            host_memory_bytes: None,
            nvme_bytes: None,
            intra_node_bytes_per_s: 1e10,
            inter_node_bytes_per_s: 1e9,
        },
        precision: PrecisionSpec {
            params: Dtype::Fp32,
            compute: Dtype::Fp32,
            master: None,
            grads: Dtype::Fp32,
            autocast: false,
        },
        optimizer: OptimizerSpec {
            kind: OptimizerKind::Adamw,
            lr: 3e-3,
            betas: (0.9, 0.95),
            momentum: 0.0,
            weight_decay: 0.0,
            state: Dtype::Fp32,
            implementation: OptImpl::Foreach,
        },
        train: TrainSpec {
            seq_len: 16,
            global_batch: 2,
            micro_batch: Choice::Fixed(2),
            grad_accum: Choice::Fixed(1),
            steps: None,
            attention: Attention::Eager,
            loss: Loss::CausalLm,
            positives: 0,
            negatives: 0,
            chunked_loss: None,
            assistant_only_loss: false,
            packing: false,
        },
        target: Target::Burn,
        resolved: Resolved {
            micro_batch: 2,
            grad_accum: 1,
            data: 1,
            zero: 0,
            tensor: 1,
            pipeline: 1,
            context: 1,
            expert: 1,
            sequence: false,
            checkpoint: "none".into(),
            checkpoint_layers: vec![],
            offload: vec![],
            virtual_stages: 1,
            optimizer_in_backward: false,
        },
        prediction: Prediction {
            peak_bytes: 0,
            budget_bytes: 1 << 30,
            fits: true,
            breakdown: BTreeMap::new(),
            peak_at: String::new(),
            step_seconds: 0.0,
            tokens_per_second: 0.0,
            in_use_max_bytes: 0,
        },
    }
}

/// The tiny plan as an encoder (LayerNorm, GELU, learned positions, tied).
pub fn tiny_encoder_plan(loss: Loss) -> LoweredPlan {
    let mut p = tiny_plan();
    p.model.arch = Arch::Encoder;
    p.model.norm = Norm::Layernorm;
    p.model.mlp = Mlp::Gelu;
    p.model.positions = Positions::Learned;
    p.model.kv_heads = 4;
    p.model.tie_embeddings = true;
    p.train.loss = loss;
    p
}

/// A one-rank trainer of `plan` on `B`'s default device, seeded with `seed`, with the
/// batches `opts` names (its data file, or synthetic tokens): what most executor
/// tests build.
pub fn trainer<B: crate::ops::ExecAutodiff>(
    plan: &LoweredPlan,
    opts: &crate::RunOptions,
    seed: u64,
) -> Result<crate::train::Trainer<B>, crate::RunError> {
    crate::train::Trainer::<B>::new(
        plan,
        crate::train::TrainerConfig {
            seed,
            batcher: crate::batcher(plan, opts)?,
            sixteen_bit: false,
            collective: None,
        },
        Default::default(),
    )
}

/// Rank `local` of two data-parallel ranks that are threads of this process
/// (no network), each collective timing out after `secs` seconds.
pub fn thread_rank(local: u32, secs: u64) -> crate::distributed::Distributed {
    crate::distributed::Distributed {
        nodes: 1,
        node_rank: 0,
        devices: 2,
        local,
        network: None,
        timeouts: crate::distributed::Timeouts::uniform(std::time::Duration::from_secs(secs)),
    }
}

/// Run the `#[ignore]`d test `test` (its full path, e.g. `setup::tests::x`)
/// of this test binary alone in a child process with `env` set, so what it
/// measures with the counting allocator sees no other test's allocations;
/// fails with the child's output unless it passed.
pub fn run_ignored_in_child(test: &str, env: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(env, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("1 passed"),
        "the child ran the measurement: {text}"
    );
}

/// A loopback port nothing listens on now (the OS picks it; released before use),
/// never one this process was given before: the OS may hand a just-released port out
/// again, and two nodes of one run given the same data port fail to register
/// (`DoubleRegister`).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    // Hold every listener until a new port turns up, so the OS cannot repeat one.
    let mut held = Vec::new();
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
        held.push(l);
    }
}

/// Process `node_rank` of `nodes`, one device each, meeting through the
/// orchestrator at `orchestrator` on loopback, its data service on a free
/// port, every collective call bounded by `limit`.
pub fn loopback_node(
    nodes: u32,
    node_rank: u32,
    orchestrator: String,
    limit: std::time::Duration,
) -> crate::distributed::Distributed {
    let data_port = free_port();
    crate::distributed::Distributed {
        nodes,
        node_rank,
        devices: 1,
        local: 0,
        network: Some(crate::distributed::Network {
            orchestrator,
            node_address: format!("127.0.0.1:{data_port}"),
            data_port,
        }),
        timeouts: crate::distributed::Timeouts::uniform(limit),
    }
}

/// Whether the environment requires the test device or tool `kind`
/// (`vulkan`, `nvrtc`, `cuda`, `cublas`): `RCOA_REQUIRE` lists them, comma-separated.
/// `.ci/run` sets it for what it installed, so that a run where they went
/// missing fails instead of passing with nothing checked.
pub fn required(kind: &str) -> bool {
    std::env::var("RCOA_REQUIRE")
        .map(|v| v.split(',').any(|k| k.trim() == kind))
        .unwrap_or(false)
}

/// A test that cannot run here for want of `kind`: prints `SKIPPED: why`
/// and returns, or, where [`required`], panics with it.
pub fn skip(kind: &str, why: &str) {
    assert!(
        !required(kind),
        "RCOA_REQUIRE has {kind}, but {why} (unset it to skip)"
    );
    eprintln!("SKIPPED: {why}");
}

/// A runtime's client, or `None` (with a note that `what` did not run)
/// where it has no device: cubecl panics when it finds none. `kind` names
/// the device for [`required`] (`vulkan`, `cuda`):
/// where the environment requires it, no device fails the test.
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub fn client_or_skip<R: cubecl::Runtime>(
    device: impl FnOnce() -> R::Device + std::panic::UnwindSafe,
    kind: &str,
    what: &str,
) -> Option<cubecl::prelude::ComputeClient<R>> {
    let found = std::panic::catch_unwind(|| R::client(&device()));
    if found.is_err() {
        skip(
            kind,
            &format!(
                "no {} device; {what} did not run",
                std::any::type_name::<R>()
            ),
        );
    }
    found.ok()
}
