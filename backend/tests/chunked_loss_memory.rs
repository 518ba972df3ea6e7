//! The chunked LM loss never holds the `[tokens, vocab]` fp32 logits: the
//! process's resident high-water mark (`VmHWM`, this test binary alone) grows
//! by less than one full logits tensor through its forward and backward, and
//! by more than two more through the full-logits loss run afterwards.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Distribution, Int, Tensor};
use rcoa_backend::loss::lm_loss;
use rcoa_backend::loss_chunked::chunked_lm_loss;
use rcoa_backend::memory::proc_status;

type Cpu = Autodiff<NdArray<f32>>;

fn hwm() -> u64 {
    proc_status().expect("/proc/self/status has VmHWM").0
}

#[test]
fn chunked_loss_peak_stays_below_one_logits_tensor() {
    let device = Default::default();
    let (tokens, d, vocab) = (1024, 16, 16_384);
    let logits_bytes = (tokens * vocab * 4) as u64; // 64 MiB
    let h0 = Tensor::<Cpu, 3>::random([1, tokens, d], Distribution::Normal(0.0, 1.0), &device);
    let w0 = Tensor::<Cpu, 2>::random([d, vocab], Distribution::Normal(0.0, 0.1), &device);
    let t = Tensor::<Cpu, 2, Int>::random(
        [1, tokens],
        Distribution::Uniform(0.0, vocab as f64),
        &device,
    );

    let before = hwm();
    let h = h0.clone().require_grad();
    let w = w0.clone().require_grad();
    let loss = chunked_lm_loss(h.clone(), w.clone(), t.clone(), None, 64).unwrap();
    let g = loss.backward();
    let chunked_loss: f32 = loss.into_scalar();
    assert!(h.grad(&g).is_some() && w.grad(&g).is_some());
    drop(g);
    let chunked = hwm() - before;

    let h = h0.require_grad();
    let w = w0.require_grad();
    let full = lm_loss(h.clone().matmul(w.clone().unsqueeze()), t, None);
    let g = full.backward();
    let full_loss: f32 = full.into_scalar();
    assert!(h.grad(&g).is_some());
    let full_growth = hwm() - before;

    assert!(
        (chunked_loss - full_loss).abs() < 1e-4,
        "{chunked_loss} vs {full_loss}"
    );
    eprintln!("high-water mark growth: chunked {chunked} B, then full {full_growth} B");
    // The chunked growth includes the allocator's arenas and the worker threads'
    // stacks (about 30 MB here); the full loss holds several logits-sized tensors.
    assert!(
        chunked < logits_bytes,
        "chunked: high-water mark grew {chunked} B, a full logits tensor is {logits_bytes} B"
    );
    assert!(
        full_growth > chunked + 2 * logits_bytes,
        "the full loss should hold the logits and their copies: grew {full_growth} B"
    );
}
