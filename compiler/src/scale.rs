//! The largest plans rcoa models: a bound on the elements of one tensor.
//!
//! 2^40 bf16 elements are 2 TiB, far past any GPU, and below that bound the
//! memory model's u64 byte sums stay exact (a layer holds a few dozen
//! tensors, a model at most 65,536 layers). The pipeline refuses a plan whose
//! tensors pass the bound at micro-batch 1, and the batch pass keeps `auto`
//! micro-batches under it, so no candidate the search evaluates can overflow.

use crate::spec::Spec;

pub const MAX_TENSOR_ELEMENTS: u128 = 1 << 40;

/// The first tensor of the step at `micro_batch` that passes the bound: what it is, and
/// its element count.
pub fn too_large(spec: &Spec, micro_batch: u64) -> Option<(&'static str, u128)> {
    let m = &spec.model;
    let t = &spec.train;
    let sequences = micro_batch as u128 * t.sequences_per_item() as u128;
    let tokens = sequences * t.seq_len as u128;
    let widest = [
        m.hidden,
        m.ffn,
        m.vocab,
        m.heads * m.head_dim,
        m.kv_heads * m.head_dim,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u128;
    [
        ("an activation (tokens × width)", tokens * widest),
        (
            "the attention scores (sequences × heads × seq_len²)",
            sequences * m.heads as u128 * (t.seq_len as u128).pow(2),
        ),
        (
            "the embedding (vocab × hidden)",
            m.vocab as u128 * m.hidden as u128,
        ),
        (
            "an MLP weight (hidden × ffn)",
            m.hidden as u128 * m.ffn as u128,
        ),
    ]
    .into_iter()
    .find(|(_, elements)| *elements > MAX_TENSOR_ELEMENTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_grows_with_the_micro_batch() {
        let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 8192  global_batch = 4096 }\n";
        let file = rcoa_grammar::parse("t.plan", src).unwrap();
        let ctx = crate::resolve::ResolveContext::new("t.plan", src, ".");
        let spec = crate::resolve::resolve(&file, &ctx).unwrap();
        assert_eq!(too_large(&spec, 1), None);
        // 4096 × 8192 tokens × 128,256 vocabulary logits: 4.3e12 elements.
        assert!(too_large(&spec, 4096).is_some());
    }
}
