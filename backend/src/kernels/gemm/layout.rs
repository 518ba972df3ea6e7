//! A row-major product `C [n, m] = A [n, k] · B [k, m]` as one column-major
//! BLAS call, for operands in either memory order.
//!
//! BLAS reads a row-major `X [r, c]` as the column-major `Xᵀ [c, r]`, so the
//! row-major product is the column-major `Cᵀ = Bᵀ · Aᵀ`: B's memory goes in
//! BLAS's first operand slot and A's in the second, with `m` and `n` swapped
//! from the row-major names. An operand stored transposed (a `swap_dims`
//! view, as autodiff's backward hands them over) is read with BLAS's
//! transpose flag instead of being copied.

/// BLAS's per-operand flag: read the stored column-major matrix as it is
/// (`N`) or transposed (`T`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

/// How BLAS reaches the column-major `Xᵀ` of a row-major operand `X`: the
/// flag to apply to its memory and that memory's leading dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub op: Op,
    pub ld: usize,
}

impl Operand {
    /// A row-major `[rows, cols]` with element strides `(row_stride,
    /// col_stride)`: stored row by row (memory is `Xᵀ` column-major, `N`),
    /// column by column (memory is `X` column-major, `T`), or neither
    /// (`None`: the caller copies it contiguous first). A dimension of size
    /// 1 has no stride to honour, so a vector fits either order.
    pub fn of(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<Self> {
        if (col_stride == 1 || cols == 1) && (row_stride >= cols || rows == 1) {
            let ld = if rows == 1 { cols } else { row_stride };
            return Some(Operand {
                op: Op::N,
                ld: ld.max(1),
            });
        }
        if (row_stride == 1 || rows == 1) && (col_stride >= rows || cols == 1) {
            let ld = if cols == 1 { rows } else { col_stride };
            return Some(Operand {
                op: Op::T,
                ld: ld.max(1),
            });
        }
        None
    }
}

/// The arguments of the column-major call `C = op(P) · op(Q)`, `C [m, n]`
/// with leading dimension `ldc`: `P` is the row-major B's memory, `Q` A's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub trans_p: Op,
    pub trans_q: Op,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub ld_p: i32,
    pub ld_q: i32,
    pub ldc: i32,
}

impl Call {
    /// The call for the row-major `C [n, m] = A [n, k] · B [k, m]` into a C
    /// whose rows start `ldc` elements apart (`m` for a contiguous C; more
    /// where the allocator pads rows, as CubeCL's CUDA one does). `None`
    /// where BLAS's 32-bit arguments cannot hold it, a dimension is empty
    /// (the caller's own matmul takes those: nothing to multiply, or a C of
    /// zeros), or `ldc` is below `m`.
    pub fn new(n: usize, k: usize, m: usize, a: Operand, b: Operand, ldc: usize) -> Option<Self> {
        if n == 0 || k == 0 || m == 0 {
            return None;
        }
        let int = |x: usize| i32::try_from(x).ok();
        let call = Call {
            trans_p: b.op,
            trans_q: a.op,
            m: int(m)?,
            n: int(n)?,
            k: int(k)?,
            ld_p: int(b.ld)?,
            ld_q: int(a.ld)?,
            ldc: int(ldc)?,
        };
        // BLAS refuses a leading dimension below the stored matrix's rows:
        // P is stored [m, k] (N) or [k, m] (T), Q [k, n] or [n, k].
        let rows = |op, r: i32, c: i32| if op == Op::N { r } else { c };
        (call.ld_p >= rows(call.trans_p, call.m, call.k)
            && call.ld_q >= rows(call.trans_q, call.k, call.n)
            && call.ldc >= call.m)
            .then_some(call)
    }
}

#[cfg(test)]
/// BLAS's column-major GEMM as its reference defines it (alpha 1, beta
/// 0): `C[i + j·ldc] = Σ_l op(P)[i, l] · op(Q)[l, j]`.
pub(crate) fn reference_gemm(call: &Call, p: &[f64], q: &[f64]) -> Vec<f64> {
    let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
    let at = |op, x: &[f64], ld: usize, i: usize, l: usize| match op {
        Op::N => x[i + l * ld],
        Op::T => x[l + i * ld],
    };
    let mut c = vec![f64::NAN; call.ldc as usize * n];
    for j in 0..n {
        for i in 0..m {
            c[i + j * call.ldc as usize] = (0..k)
                .map(|l| {
                    at(call.trans_p, p, call.ld_p as usize, i, l)
                        * at(call.trans_q, q, call.ld_q as usize, l, j)
                })
                .sum();
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A row-major `[rows, cols]` laid out in memory with the given
    /// strides (padding holds NaN, so a read of it shows), from values
    /// `f(i, j)`.
    fn store(
        rows: usize,
        cols: usize,
        strides: (usize, usize),
        f: impl Fn(usize, usize) -> f64,
    ) -> Vec<f64> {
        let len = (rows.max(1) - 1) * strides.0 + (cols.max(1) - 1) * strides.1 + 1;
        let mut mem = vec![f64::NAN; len];
        for i in 0..rows {
            for j in 0..cols {
                mem[i * strides.0 + j * strides.1] = f(i, j);
            }
        }
        mem
    }

    /// How an operand is stored: row by row, column by column, each with
    /// `pad` extra elements in its leading dimension.
    #[derive(Clone, Copy, Debug)]
    enum Order {
        Rows(usize),
        Cols(usize),
    }

    fn strides(rows: usize, cols: usize, order: Order) -> (usize, usize) {
        match order {
            Order::Rows(pad) => (cols + pad, 1),
            Order::Cols(pad) => (1, rows + pad),
        }
    }

    /// The call's C, with `c_pad` elements after each row, against the
    /// row-major product computed directly.
    fn check(n: usize, k: usize, m: usize, a_order: Order, b_order: Order, c_pad: usize) {
        let a = |i: usize, l: usize| ((i * 7 + l * 3) % 11) as f64 - 5.0;
        let b = |l: usize, j: usize| ((l * 5 + j * 2) % 13) as f64 - 6.0;
        let (sa, sb) = (strides(n, k, a_order), strides(k, m, b_order));
        let a_op = Operand::of(n, k, sa.0, sa.1).expect("A's layout");
        let b_op = Operand::of(k, m, sb.0, sb.1).expect("B's layout");
        let ldc = m + c_pad;
        let call = Call::new(n, k, m, a_op, b_op, ldc).expect("a valid call");
        let c = reference_gemm(&call, &store(k, m, sb, b), &store(n, k, sa, a));
        for i in 0..n {
            for j in 0..m {
                let want: f64 = (0..k).map(|l| a(i, l) * b(l, j)).sum();
                // C [n, m] row-major: C[i, j] at i·ldc + j.
                assert_eq!(
                    c[i * ldc + j],
                    want,
                    "C[{i}, {j}] for {n}×{k}×{m}, {a_order:?}, {b_order:?}, ldc {ldc}"
                );
            }
        }
    }

    #[test]
    fn every_pair_of_orders_gives_the_row_major_product() {
        for (n, k, m) in [
            (3, 4, 5),
            (1, 4, 5),
            (3, 1, 5),
            (3, 4, 1),
            (1, 1, 1),
            (6, 2, 6),
        ] {
            for a in [
                Order::Rows(0),
                Order::Rows(2),
                Order::Cols(0),
                Order::Cols(3),
            ] {
                for b in [
                    Order::Rows(0),
                    Order::Rows(1),
                    Order::Cols(0),
                    Order::Cols(2),
                ] {
                    check(n, k, m, a, b, 0);
                    check(n, k, m, a, b, 3);
                }
            }
        }
    }

    #[test]
    fn the_linear_layers_products_read_without_copies() {
        // Forward x [n, k] · w [k, m]; backward dy · wᵀ and xᵀ · dy, where
        // the transposes are stride swaps of contiguous tensors.
        let (n, k, m) = (8, 3, 5);
        let contiguous = |r: usize, c: usize| Operand::of(r, c, c, 1).unwrap();
        let transposed = |r: usize, c: usize| Operand::of(r, c, 1, r).unwrap();
        assert_eq!(contiguous(n, k), Operand { op: Op::N, ld: k });
        assert_eq!(transposed(m, k), Operand { op: Op::T, ld: m });
        check(n, m, k, Order::Rows(0), Order::Cols(0), 0); // dx = dy · wᵀ
        check(k, n, m, Order::Cols(0), Order::Rows(0), 0); // dw = xᵀ · dy
    }

    #[test]
    fn strided_both_ways_needs_a_copy() {
        // Every other column of a row-major matrix: neither order.
        assert_eq!(Operand::of(4, 3, 6, 2), None);
        // Rows that overlap (a broadcast row stride of 0 over 2+ columns).
        assert_eq!(Operand::of(4, 3, 0, 1), None);
        // A broadcast row is fine: one row, any stride.
        assert_eq!(Operand::of(1, 3, 0, 1), Some(Operand { op: Op::N, ld: 3 }));
    }

    #[test]
    fn empty_or_oversized_products_are_left_to_the_caller() {
        let op = Operand { op: Op::N, ld: 4 };
        assert_eq!(Call::new(0, 4, 4, op, op, 4), None);
        assert_eq!(Call::new(4, 0, 4, op, op, 4), None);
        assert_eq!(Call::new(4, 4, 0, op, op, 4), None);
        let wide = Operand {
            op: Op::N,
            ld: 1 << 31,
        };
        assert_eq!(Call::new(4, 4, 1 << 31, op, wide, 1 << 31), None);
    }

    #[test]
    fn a_leading_dimension_below_the_rows_is_refused() {
        // P = B's memory must have ld ≥ m when read as it is.
        let a = Operand { op: Op::N, ld: 4 };
        assert_eq!(Call::new(2, 4, 5, a, Operand { op: Op::N, ld: 4 }, 5), None);
        assert!(Call::new(2, 4, 5, a, Operand { op: Op::N, ld: 5 }, 5).is_some());
        // And C's rows must not overlap.
        let b = Operand { op: Op::N, ld: 5 };
        assert_eq!(Call::new(2, 4, 5, a, b, 4), None);
        assert_eq!(Call::new(2, 4, 5, a, b, 8).map(|c| c.ldc), Some(8));
    }

    proptest! {
        #[test]
        fn any_shape_and_padding(
            n in 1usize..7, k in 1usize..7, m in 1usize..7,
            a_cols in any::<bool>(), b_cols in any::<bool>(),
            pa in 0usize..3, pb in 0usize..3, pc in 0usize..3,
        ) {
            let order = |cols, pad| if cols { Order::Cols(pad) } else { Order::Rows(pad) };
            check(n, k, m, order(a_cols, pa), order(b_cols, pb), pc);
        }
    }
}
