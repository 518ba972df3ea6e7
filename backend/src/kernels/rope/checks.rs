//! The rotation against Burn's composition ([`super::rotate_plain`]) and against the
//! definition computed on the host, on any backend whose `ExecBackend::rope` it is: the CPU's
//! default here, the kernel on wgpu (lavapipe) and CUDA (`fused`, `tests_cuda`).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor, TensorData, TensorPrimitive};

use super::{rotate_plain, SeqAxis};
use crate::ops::ExecBackend;

/// One input: `x`'s logical shape `[a, b, c, d]`, its positions' axis, and whether it is a
/// swapped view (`swap_dims(1, 2)` of a contiguous `[a, c, b, d]`, as the eager path's).
#[derive(Clone, Copy, Debug)]
struct Case {
    dims: [usize; 4],
    seq_axis: SeqAxis,
    swapped: bool,
}

const fn case(dims: [usize; 4], seq_axis: SeqAxis, swapped: bool) -> Case {
    Case {
        dims,
        seq_axis,
        swapped,
    }
}

/// Both orders, both layouts, head dims 2 (one pair), 8, 64 and 96 (not a power of two), and
/// sequences of 5, 7, 37 and 129 positions, which no block size divides; the last spans many
/// cubes.
const CASES: [Case; 8] = [
    case([2, 3, 5, 8], SeqAxis::Third, false),
    case([2, 5, 3, 8], SeqAxis::Second, false),
    case([3, 4, 7, 2], SeqAxis::Third, true),
    case([3, 7, 4, 2], SeqAxis::Second, true),
    case([2, 37, 3, 96], SeqAxis::Second, false),
    case([2, 3, 37, 96], SeqAxis::Third, true),
    case([2, 37, 3, 96], SeqAxis::Second, true),
    case([1, 4, 129, 64], SeqAxis::Third, false),
];

/// Cosines `[seq, d/2]` and signed sines `[seq, d]` as `model::RopeTables` lays them out,
/// scaled by 1.25 (LongRoPE's attention factor) so the rotation is not orthonormal and the
/// backward is not the inverse.
fn tables<B: Backend>(seq: usize, d: usize, dev: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let half = d / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..seq {
        let angle = |i: usize| p as f32 * 10_000f32.powf(-2.0 * i as f32 / d as f32);
        let s: Vec<f32> = (0..half).map(|i| angle(i).sin() * 1.25).collect();
        cos.extend((0..half).map(|i| angle(i).cos() * 1.25));
        sin.extend(s.iter().map(|v| -v));
        sin.extend(&s);
    }
    (
        Tensor::from_data(TensorData::new(cos, [seq, half]), dev),
        Tensor::from_data(TensorData::new(sin, [seq, d]), dev),
    )
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 1013) as f32 / 1013.0 * 4.0 - 2.0)
        .collect()
}

/// `x` in the case's layout, from `v` (in storage order).
fn input<B: Backend>(c: Case, v: Vec<f32>, dev: &B::Device) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [a, b, cc, d] = c.dims;
    let stored = if c.swapped { [a, cc, b, d] } else { c.dims };
    let x = Tensor::<B, 4>::from_data(TensorData::new(v, stored), dev);
    let view = if c.swapped {
        x.clone().swap_dims(1, 2)
    } else {
        x.clone()
    };
    (x, view)
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn float4<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
}

/// The rotation of `x` (logical order) by the tables, in f64, and each output's scale
/// (`|x1 c| + |x2 s|`, what its rounding errors are relative to).
fn reference(c: Case, x: &[f32], cos: &[f32], sin: &[f32], inverse: bool) -> (Vec<f64>, Vec<f64>) {
    let [_, b, cc, d] = c.dims;
    let h = d / 2;
    let (mut out, mut scale) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    for row in 0..x.len() / d {
        let pos = if c.seq_axis == SeqAxis::Second {
            row / cc % b
        } else {
            row % cc
        };
        for i in 0..h {
            let (lo, hi) = (x[row * d + i] as f64, x[row * d + h + i] as f64);
            let co = cos[pos * h + i] as f64;
            let (mut s_lo, mut s_hi) = (sin[pos * d + i] as f64, sin[pos * d + h + i] as f64);
            if inverse {
                std::mem::swap(&mut s_lo, &mut s_hi);
            }
            out[row * d + i] = lo * co + hi * s_lo;
            out[row * d + h + i] = hi * co + lo * s_hi;
            scale[row * d + i] = (lo * co).abs() + (hi * s_lo).abs();
            scale[row * d + h + i] = (hi * co).abs() + (lo * s_hi).abs();
        }
    }
    (out, scale)
}

/// `got` within `tol · (scale + 1)` of `want`, element by element.
fn close(got: &[f32], want: &[f64], scale: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = tol * (scale.get(k).copied().unwrap_or(w.abs()) + 1.0);
        assert!(
            (*g as f64 - w).abs() <= bound,
            "{what} [{k}]: {g} against {w} (bound {bound:e})"
        );
    }
}

/// In f32 through `Autodiff<B>`: `ExecBackend::rope` (the node over `B`'s rotation) equals
/// Burn's autodiff through the composition within `tol` in value and in `x`'s gradient (the
/// backward's rotation), for both directions, and both equal the definition.
pub fn equals_composition<B: ExecBackend>(dev: &B::Device, tol: f64) {
    type A<B> = Autodiff<B>;
    for c in CASES {
        let [_, _, _, d] = c.dims;
        let seq = c.dims[c.seq_axis.index()];
        let n = c.dims.iter().product::<usize>();
        let (cos, sin) = tables::<A<B>>(seq, d, dev);
        let up = Tensor::<A<B>, 4>::from_data(TensorData::new(values(n, 2), c.dims), dev);
        let (cos_h, sin_h) = (host(cos.clone()), host(sin.clone()));
        for inverse in [false, true] {
            let what = format!("{c:?} inverse {inverse}");
            let run = |ours: bool| {
                let (x, _) = input::<A<B>>(c, values(n, 1), dev);
                let x = x.require_grad();
                let view = if c.swapped {
                    x.clone().swap_dims(1, 2)
                } else {
                    x.clone()
                };
                let args = (prim(view.clone()), prim(cos.clone()), prim(sin.clone()));
                let y = float4::<A<B>>(if ours {
                    A::<B>::rope(args.0, args.1, args.2, None, c.seq_axis, inverse)
                } else {
                    rotate_plain::<A<B>>(args.0, args.1, args.2, None, c.seq_axis, inverse)
                });
                let g = (y.clone() * up.clone()).sum().backward();
                let grad = x.grad(&g).expect("x has a gradient");
                let grad = if c.swapped {
                    grad.swap_dims(1, 2)
                } else {
                    grad
                };
                (host(view.inner()), host(y.inner()), host(grad))
            };
            let (x, y, grad) = run(true);
            let (_, y0, grad0) = run(false);
            let as64 = |v: &[f32]| v.iter().map(|&v| v as f64).collect::<Vec<_>>();
            close(&y, &as64(&y0), &[], tol, &format!("{what}: value"));
            close(&grad, &as64(&grad0), &[], tol, &format!("{what}: gradient"));
            let (want, scale) = reference(c, &x, &cos_h, &sin_h, inverse);
            close(
                &y,
                &want,
                &scale,
                1e-6,
                &format!("{what}: value, definition"),
            );
            let up = host(up.clone().inner());
            let (want, scale) = reference(c, &up, &cos_h, &sin_h, !inverse);
            close(
                &grad,
                &want,
                &scale,
                1e-6,
                &format!("{what}: gradient, definition"),
            );
        }
    }
}

/// In a 16-bit type (inputs and tables), both directions: the backend's rotation is the
/// definition on the rounded inputs within one rounding of the result (it computes in f32
/// and rounds once), and the composition, which rounds each product too, within three.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu-kernels")), allow(dead_code))]
pub fn sixteen_bit_within_rounding<B: ExecBackend>(dev: &B::Device, dtype: FloatDType) {
    let eps = match dtype {
        FloatDType::BF16 => 2f64.powi(-8),
        FloatDType::F16 => 2f64.powi(-11),
        _ => panic!("{dtype:?} is not a 16-bit type"),
    };
    for c in CASES {
        let [_, _, _, d] = c.dims;
        let n = c.dims.iter().product::<usize>();
        let (cos, sin) = tables::<B>(c.dims[c.seq_axis.index()], d, dev);
        let (cos, sin) = (cos.cast(dtype), sin.cast(dtype));
        let (x, view) = input::<B>(c, values(n, 3), dev);
        let view = if c.swapped {
            x.cast(dtype).swap_dims(1, 2)
        } else {
            view.cast(dtype)
        };
        let (x_h, cos_h, sin_h) = (host(view.clone()), host(cos.clone()), host(sin.clone()));
        for inverse in [false, true] {
            let what = format!("{dtype:?} {c:?} inverse {inverse}");
            let args = || (prim(view.clone()), prim(cos.clone()), prim(sin.clone()));
            let (xa, ca, sa) = args();
            let ours = float4::<B>(B::rope(xa, ca, sa, None, c.seq_axis, inverse));
            assert_eq!(ours.dtype(), dtype.into(), "{what}: the output's type");
            let (xa, ca, sa) = args();
            let theirs = float4::<B>(rotate_plain::<B>(xa, ca, sa, None, c.seq_axis, inverse));
            let (want, scale) = reference(c, &x_h, &cos_h, &sin_h, inverse);
            let ours = host(ours);
            close(&ours, &want, &scale, eps, &format!("{what}: definition"));
            let theirs: Vec<f64> = host(theirs).iter().map(|&v| v as f64).collect();
            close(
                &ours,
                &theirs,
                &scale,
                3.0 * eps,
                &format!("{what}: composition"),
            );
        }
    }
}

/// The output is contiguous in `x`'s logical shape, from a contiguous input (the flash path's
/// `[b, s, h, d]`) and from a swapped view (the eager path's `[b, h, s, d]`), which reaches
/// the kernel strided, not copied. `strides`: the strides of the backend's stored tensor.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu-kernels")), allow(dead_code))]
pub fn output_is_contiguous<B: ExecBackend>(
    dev: &B::Device,
    strides: impl Fn(FloatTensor<B>) -> Vec<usize>,
) {
    for c in [
        case([2, 5, 3, 8], SeqAxis::Second, false),
        case([2, 3, 37, 96], SeqAxis::Third, true),
    ] {
        let [a, b, cc, d] = c.dims;
        let n = a * b * cc * d;
        let (cos, sin) = tables::<B>(c.dims[c.seq_axis.index()], d, dev);
        let (_, view) = input::<B>(c, values(n, 4), dev);
        let x = prim(view);
        let contiguous = vec![b * cc * d, cc * d, d, 1];
        if c.swapped {
            assert_ne!(
                strides(x.clone()),
                contiguous,
                "{c:?}: the input was copied"
            );
        }
        let y = B::rope(x, prim(cos), prim(sin), None, c.seq_axis, false);
        assert_eq!(strides(y), contiguous, "{c:?}: the output's strides");
    }
}
