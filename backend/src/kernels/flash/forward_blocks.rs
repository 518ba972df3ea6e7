//! The forward kernel with both block products over shared-memory tiles
//! (`mma.rs`), so that on a GPU with tensor cores they run on them:
//! FlashAttention-2's forward as `flash_forward` computes it, with
//! `S = Q Kᵀ` and `P V` as cube-wide products instead of per-row FMA loops.

use cubecl::prelude::*;

use super::mma::{block_product, Products, PAD_F32, PAD_HALF};
use super::tile::{excluded, key_blocks, pad_bias, stage_rows, unmasked, MASKED};

/// One cube computes `block` query rows of one `(batch, head)`; unit `u`
/// owns row `CUBE_POS_X · block + u`: its running maximum, sum and fp32
/// output live in its registers, as in `flash_forward`. Per key block:
///
/// 1. the cube stages K and V (Q was staged once);
/// 2. `S = Q Kᵀ` into an fp32 tile (`block_product`);
/// 3. each unit scales and masks its row of S, takes the online softmax
///    step and writes its row of `P` in the input type (FlashAttention-2
///    rounds P the same way before its second product);
/// 4. `P V` into the same fp32 tile, which each unit adds to its output.
///
/// `exp` and `ln` may use the GPU's approximate intrinsics (`fast_math`;
/// CUDA's `__expf`, `__logf`: a few ulp, two instructions instead of a
/// range-reduced series), as FlashAttention's `exp2f` does. Their inputs are
/// finite (masked scores are `MASKED`), as `NotNaN` and `NotInf` promise.
/// wgpu has no fast math and ignores it. The backward kernels do the same.
///
/// Same arguments and outputs as `flash_forward`. `head_dim` must equal
/// the tensors' last extent; with `Products::TensorCores`, F must be f16 or bf16
/// and `head_dim` and `block` multiples of 16 (the host checks).
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_blocks<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_bias: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    group: u32,
    #[comptime] head_dim: usize,
    #[comptime] block: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    #[comptime] products: Products,
    #[define(F)] _dtype: StorageType,
) {
    let heads = q.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let dim = q.shape(3);
    let bh = CUBE_POS_Y as usize;
    let bi = bh / heads;
    let hi = bh % heads;
    let kvh = hi / group as usize;
    let unit = UNIT_POS_X as usize;
    let first = CUBE_POS_X as usize * block;
    let row = first + unit;
    let live = row < s;
    let r = min(row, s - 1);

    let mut qs = SharedMemory::<F>::new_aligned(block * head_dim, 128usize);
    let mut ks = SharedMemory::<F>::new_aligned(block * head_dim, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(block * head_dim, 128usize);
    // Row strides of the tiles units take one row each (`PAD_F32`).
    let s_ld = block + PAD_F32;
    let out_ld = head_dim + PAD_F32;
    let p_ld = block + PAD_HALF;
    let mut ps = SharedMemory::<F>::new_aligned(block * p_ld, 128usize);
    // S, then P V: never alive at once.
    let mut s32 = SharedMemory::<f32>::new_aligned(block * comptime![s_ld.max(out_ld)], 128usize);

    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    stage_rows::<F>(q, &mut qs, qbase, first, s, block, head_dim);

    let mut acc = Array::<f32>::new(head_dim);
    #[unroll(products == Products::TensorCores)]
    for c in 0..head_dim {
        acc[c] = f32::new(0.0);
    }
    let mut m = f32::new(MASKED);
    let mut l = f32::new(0.0);

    for kb in 0..key_blocks(first, block, s, t, causal) {
        let j0 = kb * block;
        stage_rows::<F>(k, &mut ks, kbase, j0, t, block, head_dim);
        stage_rows::<F>(v, &mut vs, vbase, j0, t, block, head_dim);
        sync_cube();

        block_product::<F>(
            &qs, dim, &ks, dim, true, &mut s32, 0, s_ld, block, block, dim, products,
        );
        sync_cube();

        // This unit's row of S: scaled, masked, its maximum.
        let n = min(block, t - j0);
        let mut mb = m;
        if unmasked(first, j0, block, s, t, causal, padding) {
            for jl in 0..block {
                let x = s32[unit * s_ld + jl] * scale;
                s32[unit * s_ld + jl] = x;
                mb = max(mb, x);
            }
        } else {
            for jl in 0..block {
                let j = j0 + jl;
                let mut x = f32::new(MASKED);
                if jl < n && !excluded(j, r, t, causal) {
                    x = s32[unit * s_ld + jl] * scale;
                    if padding {
                        x += pad_bias(key_bias, bi, j);
                    }
                }
                s32[unit * s_ld + jl] = x;
                mb = max(mb, x);
            }
        }
        let alpha = (m - mb).exp();
        l *= alpha;
        #[unroll(products == Products::TensorCores)]
        for c in 0..head_dim {
            acc[c] *= alpha;
        }
        for jl in 0..block {
            let x = s32[unit * s_ld + jl];
            let p = select(x > f32::new(MASKED), (x - mb).exp(), f32::new(0.0));
            l += p;
            ps[unit * p_ld + jl] = F::cast_from(p);
        }
        m = mb;
        sync_cube();

        block_product::<F>(
            &ps, p_ld, &vs, dim, false, &mut s32, 0, out_ld, block, dim, block, products,
        );
        sync_cube();
        #[unroll(products == Products::TensorCores)]
        for c in 0..head_dim {
            acc[c] += s32[unit * out_ld + c];
        }
    }

    if live {
        let ob = bi * out.stride(0) + hi * out.stride(1) + row * out.stride(2);
        let inv = f32::new(1.0) / l;
        #[unroll(products == Products::TensorCores)]
        for c in 0..head_dim {
            out[ob + c * out.stride(3)] = F::cast_from(acc[c] * inv);
        }
        lse[bi * lse.stride(0) + hi * lse.stride(1) + row * lse.stride(2)] = m + l.ln();
    }
}
