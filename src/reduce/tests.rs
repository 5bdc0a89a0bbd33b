use half::{bf16, f16};

use super::num::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use super::*;
use crate::types::{F8E4M3, F8E5M2, Scalar};

thread_local! {
    /// Set by [`on_every_path`]: the widest instruction set this thread's kernels may
    /// use (so each build runs even where the CPU has a wider one).
    pub(super) static ISA_LIMIT: std::cell::Cell<VectorIsa> =
        const { std::cell::Cell::new(VectorIsa::Avx512) };
}

/// Runs `f` with the kernels limited to `isa`.
pub(super) fn with_isa<R>(isa: VectorIsa, f: impl FnOnce() -> R) -> R {
    ISA_LIMIT.with(|l| l.set(isa));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    ISA_LIMIT.with(|l| l.set(VectorIsa::Avx512));
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Runs `f` on every build of the loops the CPU can run (AVX-512, AVX2, portable).
pub(super) fn on_every_path(f: impl Fn()) {
    for isa in VectorIsa::ALL.into_iter().rev() {
        if isa <= cpu_vector_isa() {
            with_isa(isa, &f);
        }
    }
}

/// Every op, pre-mul-sum with a float scalar and with an integer one.
pub(super) const EVERY_OP: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
    ReduceOp::PreMulSum(Scalar::Float(0.75)),
    ReduceOp::PreMulSum(Scalar::Int(3)),
];

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn pick(&mut self, values: &[f64]) -> f64 {
        values[(self.next() % values.len() as u64) as usize]
    }
}

/// True if `v` is exactly representable in `T`.
fn exact<T: Element>(v: f64) -> bool {
    T::from_f64(v).to_f64() == v
}

fn is_signed_or_float(dtype: DataType) -> bool {
    !matches!(dtype, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
}

/// The f64 reference of folding `xs` with `op` (avg divides the sum).
fn reference(op: ReduceOp, nranks: usize, xs: &[f64]) -> f64 {
    match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Prod => xs.iter().product(),
        ReduceOp::Max => xs.iter().copied().fold(f64::MIN, f64::max),
        ReduceOp::Min => xs.iter().copied().fold(f64::MAX, f64::min),
        ReduceOp::Avg => xs.iter().sum::<f64>() / nranks as f64,
        ReduceOp::PreMulSum(Scalar::Int(s)) => xs.iter().map(|x| s as f64 * x).sum(),
        ReduceOp::PreMulSum(_) => unreachable!("the grid uses integer scalars"),
    }
}

/// Every partial result of folding `xs` in rank order (what the kernels store), in f64.
fn partials(op: ReduceOp, xs: &[f64]) -> Vec<f64> {
    (1..=xs.len())
        .map(|k| {
            let prefix = &xs[..k];
            match op {
                ReduceOp::Avg => prefix.iter().sum(),
                _ => reference(op, k, prefix),
            }
        })
        .collect()
}

/// Draws, per element, one small integer value per rank such that every partial and the
/// final result are exactly representable in `T`, so any correct kernel must match the
/// f64 reference exactly.
fn grid_data<T: Element>(
    op: ReduceOp,
    nranks: usize,
    count: usize,
    rng: &mut Rng,
) -> Vec<Vec<f64>> {
    let signed = is_signed_or_float(T::DTYPE);
    let values: Vec<f64> = match (op, signed) {
        (ReduceOp::Prod, true) => vec![-2.0, -1.0, 1.0, 2.0],
        (ReduceOp::Prod, false) => vec![1.0, 2.0],
        (_, true) => (-7..=7).map(f64::from).collect(),
        (_, false) => (0..=7).map(f64::from).collect(),
    };
    let mut per_rank = vec![Vec::with_capacity(count); nranks];
    for _ in 0..count {
        let xs = loop {
            let xs: Vec<f64> = (0..nranks).map(|_| rng.pick(&values)).collect();
            let sum: f64 = xs.iter().sum();
            if op == ReduceOp::Avg && sum % nranks as f64 != 0.0 {
                continue;
            }
            let scaled_ok = match op {
                ReduceOp::PreMulSum(Scalar::Int(s)) => xs.iter().all(|x| exact::<T>(s as f64 * x)),
                _ => true,
            };
            let ok = scaled_ok
                && xs.iter().all(|&x| exact::<T>(x))
                && partials(op, &xs).iter().all(|&p| exact::<T>(p))
                && exact::<T>(reference(op, nranks, &xs));
            if ok {
                break xs;
            }
        };
        for (r, x) in xs.into_iter().enumerate() {
            per_rank[r].push(x);
        }
    }
    per_rank
}

fn to_elems<T: Element>(xs: &[f64]) -> Vec<T> {
    xs.iter().map(|&x| T::from_f64(x)).collect()
}

/// Runs the ring-style fold `acc = pre(x0); acc = reduce(acc, x_r) ...; post(acc)` in
/// three aliasing modes and checks each against the f64 reference.
fn check_grid<T: Element>(op: ReduceOp, nranks: usize) {
    let count = 257;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((T::DTYPE as u64) << 8) ^ nranks as u64);
    let data = grid_data::<T>(op, nranks, count, &mut rng);
    let want: Vec<f64> = (0..count)
        .map(|i| {
            let xs: Vec<f64> = data.iter().map(|r| r[i]).collect();
            reference(op, nranks, &xs)
        })
        .collect();
    let k = Kernel::new(T::DTYPE, op, nranks).unwrap();
    let inputs: Vec<Vec<T>> = data.iter().map(|r| to_elems(r)).collect();

    for mode in ["out-of-place", "dst == a", "dst == b"] {
        let mut acc: Vec<T> = vec![T::from_f64(0.0); count];
        pre_slice(&k, &mut acc, &inputs[0]).unwrap();
        for input in &inputs[1..] {
            match mode {
                "out-of-place" => {
                    let mut out = vec![T::from_f64(0.0); count];
                    reduce_slice(&k, &mut out, &acc, input).unwrap();
                    acc = out;
                }
                "dst == a" => {
                    let p = acc.as_mut_ptr().cast::<u8>();
                    // SAFETY: acc and input hold count elements of T::DTYPE; dst == a.
                    unsafe { k.reduce(p, p, input.as_ptr().cast(), count) };
                }
                _ => {
                    // dst == b: the partial arrives in `acc`, this rank's contribution
                    // is reduced in place into a copy of its own buffer.
                    let mut own = input.clone();
                    let p = own.as_mut_ptr().cast::<u8>();
                    // SAFETY: both hold count elements of T::DTYPE; dst == b.
                    unsafe { k.reduce(p, acc.as_ptr().cast(), p, count) };
                    acc = own;
                }
            }
        }
        post_slice(&k, &mut acc).unwrap();
        let got: Vec<f64> = acc.iter().map(|x| x.to_f64()).collect();
        assert_eq!(got, want, "{} {op:?} nranks={nranks} ({mode})", T::DTYPE);
    }
}

fn check_all_ops<T: Element>() {
    let ops = [
        (ReduceOp::Sum, 3),
        (ReduceOp::Sum, 1),
        (ReduceOp::Prod, 3),
        (ReduceOp::Max, 3),
        (ReduceOp::Min, 3),
        (ReduceOp::Avg, 3),
        (ReduceOp::Avg, 2),
        (ReduceOp::Avg, 1),
        (ReduceOp::PreMulSum(Scalar::Int(2)), 3),
        (ReduceOp::PreMulSum(Scalar::Int(3)), 3),
    ];
    for (op, nranks) in ops {
        check_grid::<T>(op, nranks);
    }
}

#[test]
fn every_dtype_and_op_matches_the_f64_reference() {
    on_every_path(|| {
        check_all_ops::<i8>();
        check_all_ops::<u8>();
        check_all_ops::<i32>();
        check_all_ops::<u32>();
        check_all_ops::<i64>();
        check_all_ops::<u64>();
        check_all_ops::<f16>();
        check_all_ops::<f32>();
        check_all_ops::<f64>();
        check_all_ops::<bf16>();
        check_all_ops::<F8E4M3>();
        check_all_ops::<F8E5M2>();
    });
}

/// Reduces `a` and `b` with a fresh kernel and returns the result.
fn fold<T: Element>(op: ReduceOp, nranks: usize, a: &[T], b: &[T]) -> Vec<T> {
    let k = Kernel::new(T::DTYPE, op, nranks).unwrap();
    let mut out = a.to_vec();
    reduce_slice(&k, &mut out, a, b).unwrap();
    post_slice(&k, &mut out).unwrap();
    out
}

#[test]
fn integer_avg_truncates_toward_zero() {
    on_every_path(|| {
        let k = Kernel::new(DataType::Int32, ReduceOp::Avg, 3).unwrap();
        let mut v = [7i32, -7, 8, -8, 2, -2, i32::MIN, i32::MAX];
        post_slice(&k, &mut v).unwrap();
        assert_eq!(v, [2, -2, 2, -2, 0, 0, i32::MIN / 3, i32::MAX / 3]);

        let k = Kernel::new(DataType::Uint8, ReduceOp::Avg, 3).unwrap();
        let mut v = [7u8, 255, 2];
        post_slice(&k, &mut v).unwrap();
        assert_eq!(v, [2, 85, 0]);

        // Sum 3 + 4 over two ranks: 7 / 2 = 3, -7 / 2 = -3.
        assert_eq!(fold(ReduceOp::Avg, 2, &[3i64, -3], &[4, -4]), [3, -3]);

        // A divisor beyond the type's range (8-bit types with many ranks).
        let k = Kernel::new(DataType::Int8, ReduceOp::Avg, 128).unwrap();
        let mut v = [-128i8, 127, -1, 0];
        post_slice(&k, &mut v).unwrap();
        assert_eq!(v, [-1, 0, 0, 0]);
        let k = Kernel::new(DataType::Uint8, ReduceOp::Avg, 1000).unwrap();
        let mut v = [255u8, 0];
        post_slice(&k, &mut v).unwrap();
        assert_eq!(v, [0, 0]);
    });
}

#[test]
fn float_avg_is_a_rounded_division() {
    on_every_path(|| {
        // 1 / 3 rounded once in each type.
        assert_eq!(fold(ReduceOp::Avg, 3, &[0.5f32], &[0.5])[0], 1.0f32 / 3.0);
        assert_eq!(fold(ReduceOp::Avg, 3, &[0.5f64], &[0.5])[0], 1.0f64 / 3.0);
        let one = f16::from_f32(1.0);
        let half = f16::from_f32(0.5);
        assert_eq!(
            fold(ReduceOp::Avg, 3, &[half], &[half])[0],
            f16::from_f64(1.0 / 3.0)
        );
        assert_eq!(
            fold(ReduceOp::Avg, 1, &[one], &[one])[0],
            f16::from_f32(2.0)
        );
        let e = F8E4M3::from_f32(0.5);
        assert_eq!(
            fold(ReduceOp::Avg, 3, &[e], &[e])[0],
            F8E4M3::from_f64(1.0 / 3.0)
        );
    });
}

#[test]
fn has_pre_and_has_post() {
    let k = |op, n| Kernel::new(DataType::Float32, op, n).unwrap();
    assert!(!k(ReduceOp::Sum, 4).has_pre() && !k(ReduceOp::Sum, 4).has_post());
    assert!(k(ReduceOp::PreMulSum(Scalar::Float(0.5)), 4).has_pre());
    assert!(!k(ReduceOp::PreMulSum(Scalar::Float(0.5)), 4).has_post());
    assert!(k(ReduceOp::Avg, 4).has_post() && !k(ReduceOp::Avg, 4).has_pre());
    assert!(!k(ReduceOp::Avg, 1).has_post());
    assert_eq!(k(ReduceOp::Max, 2).dtype(), DataType::Float32);
}

#[test]
fn integer_sum_and_prod_wrap() {
    on_every_path(|| {
        assert_eq!(
            fold(ReduceOp::Sum, 2, &[127i8, -128], &[1, -1]),
            [-128, 127]
        );
        assert_eq!(fold(ReduceOp::Sum, 2, &[255u8, 0], &[1, 0]), [0, 0]);
        assert_eq!(fold(ReduceOp::Sum, 2, &[u64::MAX], &[2]), [1]);
        assert_eq!(fold(ReduceOp::Sum, 2, &[i64::MAX], &[1]), [i64::MIN]);
        assert_eq!(fold(ReduceOp::Prod, 2, &[16i8], &[16]), [0]);
        assert_eq!(
            fold(ReduceOp::Prod, 2, &[0x1_0001u32], &[0x1_0001]),
            [0x2_0001]
        );
        assert_eq!(fold(ReduceOp::Prod, 2, &[i32::MAX], &[2]), [-2]);
        // Pre-mul-sum wraps in the multiply and in the add.
        let op = ReduceOp::PreMulSum(Scalar::Int(2));
        assert_eq!(fold(op, 2, &[100i8], &[100]), [100i8.wrapping_add(-56)]);
    });
}

#[test]
fn max_and_min_with_negatives_and_nans() {
    on_every_path(|| {
        assert_eq!(
            fold(ReduceOp::Max, 2, &[-3i8, -128, 5], &[-4, 127, -5]),
            [-3, 127, 5]
        );
        assert_eq!(
            fold(ReduceOp::Min, 2, &[-3i64, i64::MIN], &[-4, 0]),
            [-4, i64::MIN]
        );
        assert_eq!(
            fold(ReduceOp::Max, 2, &[u32::MAX, 1], &[0, 2]),
            [u32::MAX, 2]
        );
        assert_eq!(
            fold(ReduceOp::Max, 2, &[-1.5f32, -0.5], &[-2.5, -7.0]),
            [-1.5, -0.5]
        );
        assert_eq!(
            fold(ReduceOp::Min, 2, &[-1.5f64, 3.0], &[-2.5, 7.0]),
            [-2.5, 3.0]
        );
        // maxNum / minNum: a NaN loses to a number; two NaNs give NaN.
        let r = fold(
            ReduceOp::Max,
            2,
            &[f32::NAN, 1.0, f32::NAN],
            &[2.0, f32::NAN, f32::NAN],
        );
        assert_eq!(&r[..2], &[2.0, 1.0]);
        assert!(r[2].is_nan());
        let r = fold(ReduceOp::Min, 2, &[f64::NAN], &[-2.0]);
        assert_eq!(r, [-2.0]);
        let h = |v: f32| f16::from_f32(v);
        assert_eq!(
            fold(
                ReduceOp::Min,
                2,
                &[h(-1.0), h(f32::NAN)],
                &[h(-2.0), h(3.0)]
            ),
            [h(-2.0), h(3.0)]
        );
        let b = |v: f32| bf16::from_f32(v);
        assert_eq!(
            fold(
                ReduceOp::Max,
                2,
                &[b(-1.0), b(-300.0)],
                &[b(-2.0), b(f32::NAN)]
            ),
            [b(-1.0), b(-300.0)]
        );
        let e = |v: f32| F8E4M3::from_f32(v);
        assert_eq!(
            fold(
                ReduceOp::Max,
                2,
                &[e(-1.0), F8E4M3(0x7F)],
                &[e(-2.0), e(-448.0)]
            ),
            [e(-1.0), e(-448.0)]
        );
        let m = |v: f32| F8E5M2::from_f32(v);
        assert_eq!(
            fold(
                ReduceOp::Min,
                2,
                &[m(-1.0), F8E5M2(0x7C)],
                &[m(-2.0), m(5.0)]
            ),
            [m(-2.0), m(5.0)]
        );
    });
}

#[test]
fn narrow_float_ops_round_once_to_nearest_even() {
    on_every_path(|| {
        let h = |v: f64| f16::from_f64(v);
        // 2048 + 1: a tie between 2048 and 2050, to even (2048); 2048 + 3 -> 2052.
        assert_eq!(
            fold(ReduceOp::Sum, 2, &[h(2048.0), h(2048.0)], &[h(1.0), h(3.0)]),
            [h(2048.0), h(2052.0)]
        );
        // 1 + 2^-11 (half an ulp) ties to 1; 1 + 3 * 2^-11 (1.5 ulp) ties to 1 + 2 ulp.
        let r = fold(
            ReduceOp::Sum,
            2,
            &[h(1.0), h(1.0)],
            &[h(2f64.powi(-11)), h(3.0 * 2f64.powi(-11))],
        );
        assert_eq!(r, [h(1.0), h(1.0 + 2.0 * 2f64.powi(-10))]);
        // Overflow gives infinity for f16 (IEEE, no saturation).
        assert_eq!(
            fold(ReduceOp::Sum, 2, &[h(65504.0)], &[h(65504.0)]),
            [f16::INFINITY]
        );
        // bf16: 256 + 1 ties to 256; 256 + 3 -> 260 (spacing 2 at 256).
        let b = |v: f64| bf16::from_f64(v);
        assert_eq!(
            fold(ReduceOp::Sum, 2, &[b(256.0), b(256.0)], &[b(1.0), b(3.0)]),
            [b(256.0), b(260.0)]
        );
        // Products computed exactly in f32, rounded once: (1 + 2^-10)^2 = 1 + 2^-9 + 2^-20.
        let x = h(1.0 + 2f64.powi(-10));
        assert_eq!(
            fold(ReduceOp::Prod, 2, &[x], &[x]),
            [h(1.0 + 2f64.powi(-9))]
        );
        // E4M3 (spacing 2 in [16, 32)): 17 ties to 16 (mantissa 000, not 18's 001); 19 ties
        // to 20 (mantissa 010, not 18's 001).
        let e = |v: f32| F8E4M3::from_f32(v);
        assert_eq!(
            fold(ReduceOp::Sum, 2, &[e(16.0), e(16.0)], &[e(1.0), e(3.0)]),
            [e(16.0), e(20.0)]
        );
    });
}

#[test]
fn fp8_sums_saturate() {
    on_every_path(|| {
        let e = |v: f32| F8E4M3::from_f32(v);
        assert_eq!(e(448.0), F8E4M3::MAX);
        assert_eq!(
            fold(
                ReduceOp::Sum,
                2,
                &[e(448.0), e(-448.0)],
                &[e(448.0), e(-448.0)]
            ),
            [F8E4M3::MAX, F8E4M3(0xFE)]
        );
        assert_eq!(
            fold(ReduceOp::Prod, 2, &[e(448.0)], &[e(2.0)]),
            [F8E4M3::MAX]
        );
        let m = |v: f32| F8E5M2::from_f32(v);
        assert_eq!(m(57344.0), F8E5M2::MAX);
        assert_eq!(
            fold(
                ReduceOp::Sum,
                2,
                &[m(57344.0), m(-57344.0)],
                &[m(57344.0), m(-57344.0)]
            ),
            [F8E5M2::MAX, F8E5M2(0xFB)]
        );
        // An E5M2 infinity in a sum saturates too (SATFINITE on the way back).
        assert_eq!(
            fold(ReduceOp::Sum, 2, &[F8E5M2(0x7C)], &[m(1.0)]),
            [F8E5M2::MAX]
        );
        // NaN stays NaN.
        assert!(fold(ReduceOp::Sum, 2, &[F8E4M3(0x7F)], &[e(1.0)])[0].is_nan());
        assert!(fold(ReduceOp::Sum, 2, &[F8E5M2(0x7E)], &[m(1.0)])[0].is_nan());
    });
}

#[test]
fn pre_mul_sum_scalars_of_every_kind_convert() {
    on_every_path(|| {
        fn with_scalar<T: Element>(s: Scalar) -> Vec<f64> {
            let k = Kernel::new(T::DTYPE, ReduceOp::PreMulSum(s), 2).unwrap();
            let a: Vec<T> = to_elems(&[1.0, 2.0]);
            let b: Vec<T> = to_elems(&[3.0, 1.0]);
            let mut own = vec![T::from_f64(0.0); 2];
            pre_slice(&k, &mut own, &a).unwrap();
            let mut out = own.clone();
            reduce_slice(&k, &mut out, &own, &b).unwrap();
            out.iter().map(|x| x.to_f64()).collect()
        }
        fn all<T: Element>() {
            for s in [Scalar::Int(2), Scalar::Uint(2), Scalar::Float(2.0)] {
                assert_eq!(with_scalar::<T>(s), [8.0, 6.0], "{} {s:?}", T::DTYPE);
            }
        }
        all::<i8>();
        all::<u8>();
        all::<i32>();
        all::<u32>();
        all::<i64>();
        all::<u64>();
        all::<f16>();
        all::<f32>();
        all::<f64>();
        all::<bf16>();
        all::<F8E4M3>();
        all::<F8E5M2>();
        // Casts for integers: 2.75 truncates to 2; -1 wraps to 255 for u8.
        assert_eq!(with_scalar::<i32>(Scalar::Float(2.75)), [8.0, 6.0]);
        // s = 255: s * (a + b) mod 256 = 255 * [4, 3] mod 256.
        assert_eq!(with_scalar::<u8>(Scalar::Int(-1)), [252.0, 253.0]);
        // Rounding for floats: 0.1 becomes the nearest bf16.
        let k = Kernel::new(
            DataType::Bfloat16,
            ReduceOp::PreMulSum(Scalar::Float(0.1)),
            2,
        )
        .unwrap();
        let mut out = [bf16::ZERO];
        pre_slice(&k, &mut out, &[bf16::ONE]).unwrap();
        assert_eq!(out, [bf16::from_f64(0.1)]);
    });
}

#[test]
fn pre_copies_or_scales_in_place() {
    on_every_path(|| {
        let k = Kernel::new(DataType::Int32, ReduceOp::Sum, 2).unwrap();
        let mut v = [1i32, 2, 3];
        let p = v.as_mut_ptr().cast::<u8>();
        // SAFETY: dst == src, 3 valid elements.
        unsafe { k.pre(p, p, 3) };
        assert_eq!(v, [1, 2, 3]);
        let k = Kernel::new(DataType::Int32, ReduceOp::PreMulSum(Scalar::Int(-2)), 2).unwrap();
        // SAFETY: as above.
        unsafe { k.pre(p, p, 3) };
        assert_eq!(v, [-2, -4, -6]);
    });
}

#[test]
fn fully_aliased_reduce() {
    on_every_path(|| {
        // dst == a == b: x ⊕ x.
        for (op, want) in [
            (ReduceOp::Sum, [2.0f32, -4.0]),
            (ReduceOp::Prod, [1.0, 4.0]),
        ] {
            let k = Kernel::new(DataType::Float32, op, 2).unwrap();
            let mut v = [1.0f32, -2.0];
            let p = v.as_mut_ptr().cast::<u8>();
            // SAFETY: 2 valid elements; dst == a == b.
            unsafe { k.reduce(p, p, p, 2) };
            assert_eq!(v, want);
        }
    });
}

#[test]
fn count_zero_touches_nothing() {
    on_every_path(|| {
        for dtype in DataType::ALL {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Avg,
                ReduceOp::PreMulSum(Scalar::Int(3)),
            ] {
                let k = Kernel::new(dtype, op, 3).unwrap();
                let dangling = std::ptr::NonNull::<u64>::dangling().as_ptr().cast::<u8>();
                let mut guard = [0xA5u8; 8];
                let g = guard.as_mut_ptr();
                // SAFETY: count is 0, so nothing is read or written.
                unsafe {
                    k.reduce(dangling, dangling, dangling, 0);
                    k.reduce(g, dangling, dangling, 0);
                    k.pre(g, dangling, 0);
                    k.post(g, 0);
                }
                assert_eq!(guard, [0xA5; 8]);
            }
        }
    });
}

/// Writes `vals` into `buf` at byte `offset`, unaligned.
fn put<T: Element>(buf: &mut [u8], offset: usize, vals: &[T]) {
    let size = std::mem::size_of::<T>();
    assert!(buf.len() >= offset + std::mem::size_of_val(vals));
    for (i, v) in vals.iter().enumerate() {
        // SAFETY: in bounds (asserted above); write_unaligned needs no alignment.
        unsafe {
            buf.as_mut_ptr()
                .add(offset + i * size)
                .cast::<T>()
                .write_unaligned(*v)
        }
    }
}

fn get<T: Element>(buf: &[u8], offset: usize, n: usize) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    assert!(buf.len() >= offset + n * size);
    (0..n)
        // SAFETY: in bounds (asserted above); every bit pattern is a valid T.
        .map(|i| unsafe {
            buf.as_ptr()
                .add(offset + i * size)
                .cast::<T>()
                .read_unaligned()
        })
        .collect()
}

fn check_unaligned<T: Element>() {
    let n = 37;
    let size = std::mem::size_of::<T>();
    let a: Vec<T> = (0..n).map(|i| T::from_f64((i % 7) as f64)).collect();
    let b: Vec<T> = (0..n).map(|i| T::from_f64((i % 5) as f64)).collect();
    for op in [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::PreMulSum(Scalar::Int(2)),
        ReduceOp::Avg,
    ] {
        let k = Kernel::new(T::DTYPE, op, 2).unwrap();
        let mut want = vec![T::from_f64(0.0); n];
        reduce_slice(&k, &mut want, &a, &b).unwrap();
        post_slice(&k, &mut want).unwrap();

        let mut bytes = vec![0u8; 3 * n * size + 8];
        let (ao, bo, dout) = (1, 1 + n * size + 2, 1 + 2 * n * size + 4);
        put(&mut bytes, ao, &a);
        put(&mut bytes, bo, &b);
        let base = bytes.as_mut_ptr();
        // SAFETY: the three odd offsets hold n elements each, inside `bytes`, disjoint.
        unsafe {
            k.reduce(base.add(dout), base.add(ao), base.add(bo), n);
            k.post(base.add(dout), n);
        }
        assert_eq!(
            get::<T>(&bytes, dout, n),
            want,
            "{} {op:?} out-of-place",
            T::DTYPE
        );
        // In place, dst == a at an odd offset.
        // SAFETY: as above; dst == a.
        unsafe {
            k.reduce(base.add(ao), base.add(ao), base.add(bo), n);
            k.post(base.add(ao), n);
        }
        assert_eq!(
            get::<T>(&bytes, ao, n),
            want,
            "{} {op:?} in place",
            T::DTYPE
        );
        put(&mut bytes, ao, &a);
        // pre at an odd offset.
        let mut want_pre = vec![T::from_f64(0.0); n];
        pre_slice(&k, &mut want_pre, &a).unwrap();
        // SAFETY: disjoint ranges of n elements inside `bytes`.
        unsafe { k.pre(base.add(dout), base.add(ao), n) };
        assert_eq!(
            get::<T>(&bytes, dout, n),
            want_pre,
            "{} {op:?} pre",
            T::DTYPE
        );
    }
}

#[test]
fn unaligned_pointers() {
    on_every_path(|| {
        check_unaligned::<i8>();
        check_unaligned::<u8>();
        check_unaligned::<i32>();
        check_unaligned::<u32>();
        check_unaligned::<i64>();
        check_unaligned::<u64>();
        check_unaligned::<f16>();
        check_unaligned::<f32>();
        check_unaligned::<f64>();
        check_unaligned::<bf16>();
        check_unaligned::<F8E4M3>();
        check_unaligned::<F8E5M2>();
    });
}

#[test]
fn long_buffers_take_the_vector_path_correctly() {
    on_every_path(|| {
        // Long enough for vector bodies and remainders, for every aliasing mode.
        let n = 1000 + 13;
        let a: Vec<f32> = (0..n).map(|i| (i % 100) as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 37) as f32 - 18.0).collect();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let k = Kernel::new(DataType::Float32, ReduceOp::Sum, 2).unwrap();
        let mut out = vec![0.0f32; n];
        reduce_slice(&k, &mut out, &a, &b).unwrap();
        assert_eq!(out, want);
        let mut x = a.clone();
        let p = x.as_mut_ptr().cast::<u8>();
        // SAFETY: n valid elements; dst == a.
        unsafe { k.reduce(p, p, b.as_ptr().cast(), n) };
        assert_eq!(x, want);
        let mut y = b.clone();
        let p = y.as_mut_ptr().cast::<u8>();
        // SAFETY: n valid elements; dst == b.
        unsafe { k.reduce(p, a.as_ptr().cast(), p, n) };
        assert_eq!(y, want);
    });
}

/// Regions long enough to start their vector loop on a line of the destination, with
/// the destination at every byte of a line (on its elements' alignment or not), out of
/// place and in place: every element equals the reduction of aligned copies.
fn check_every_line_offset<T: Element>() {
    let size = std::mem::size_of::<T>();
    let n = (2 * super::LINE_ALIGNED_FROM) / size + 7;
    let a: Vec<T> = (0..n).map(|i| T::from_f64((i % 11) as f64)).collect();
    let b: Vec<T> = (0..n).map(|i| T::from_f64((i % 3) as f64 - 1.0)).collect();
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let k = Kernel::new(T::DTYPE, op, 2).unwrap();
        let mut want = vec![T::from_f64(0.0); n];
        reduce_slice(&k, &mut want, &a, &b).unwrap();
        for offset in 0..super::LINE {
            // Two lines of slack so that `offset` lands at that byte of a line.
            let mut bytes = vec![0u8; 3 * n * size + 3 * super::LINE];
            let line = bytes.as_ptr().align_offset(super::LINE);
            let dout = line + offset;
            let (ao, bo) = (dout + n * size + 3, dout + 2 * n * size + 5);
            put(&mut bytes, ao, &a);
            put(&mut bytes, bo, &b);
            let base = bytes.as_mut_ptr();
            let head = super::line_head(base.wrapping_add(dout), size, n);
            if head > 0 {
                assert_eq!((base as usize + dout + head * size) % super::LINE, 0);
            }
            // SAFETY: three disjoint ranges of n elements inside `bytes`.
            unsafe { k.reduce(base.add(dout), base.add(ao), base.add(bo), n) };
            let got = get::<T>(&bytes, dout, n);
            assert!(
                got == want,
                "{} {op:?} out of place, offset {offset}",
                T::DTYPE
            );
            // In place: dst == a, at the same offset.
            put(&mut bytes, dout, &a);
            // SAFETY: as above; dst == a.
            unsafe { k.reduce(base.add(dout), base.add(dout), base.add(bo), n) };
            let got = get::<T>(&bytes, dout, n);
            assert!(got == want, "{} {op:?} in place, offset {offset}", T::DTYPE);
        }
    }
}

#[test]
fn destinations_at_every_byte_of_a_line() {
    on_every_path(|| {
        check_every_line_offset::<u8>();
        check_every_line_offset::<i32>();
        check_every_line_offset::<f16>();
        check_every_line_offset::<f32>();
        check_every_line_offset::<f64>();
        check_every_line_offset::<bf16>();
    });
}

#[test]
fn rejects_bad_arguments() {
    let err = Kernel::new(DataType::Float32, ReduceOp::Sum, 0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("nranks"), "{err}");

    let k = Kernel::new(DataType::Float32, ReduceOp::Sum, 2).unwrap();
    let err = reduce_slice(&k, &mut [0i32; 2], &[1, 2], &[3, 4]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(
        err.to_string().contains("int32") && err.to_string().contains("float"),
        "{err}"
    );
    let err = reduce_slice(&k, &mut [0f32; 2], &[1.0], &[3.0, 4.0]).unwrap_err();
    assert!(err.to_string().contains("a has 1"), "{err}");
    let err = reduce_slice(&k, &mut [0f32; 2], &[1.0, 2.0], &[3.0]).unwrap_err();
    assert!(err.to_string().contains("b has 1"), "{err}");
    assert!(pre_slice(&k, &mut [0f32; 2], &[1.0]).is_err());
    assert!(post_slice(&k, &mut [0f64; 2]).is_err());
}

#[test]
fn f16_conversions_match_half_exhaustively() {
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        let got = f16_to_f32(bits);
        if want.is_nan() {
            assert!(got.is_nan(), "{bits:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
        }
        let want = bf16::from_bits(bits).to_f32();
        let got = bf16_to_f32(bits);
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
    }
    // Narrowing: every f16 value, the midpoints around it and their neighbours, plus a
    // stride through all f32 bit patterns.
    let mut inputs: Vec<f32> = Vec::new();
    for bits in 0..=u16::MAX {
        let v = f16::from_bits(bits).to_f32();
        if !v.is_finite() {
            continue;
        }
        let next = f16::from_bits(bits.wrapping_add(1)).to_f32();
        let mid = if next.is_finite() {
            (v + next) / 2.0
        } else {
            v
        };
        for x in [
            v,
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits() - 1),
        ] {
            inputs.push(x);
        }
    }
    inputs.extend((0..u32::MAX).step_by(4093).map(f32::from_bits));
    inputs.extend([
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
    ]);
    for x in inputs {
        for (got, want, name) in [
            (f32_to_f16(x), f16::from_f32(x).to_bits(), "f16"),
            (f32_to_bf16(x), bf16::from_f32(x).to_bits(), "bf16"),
        ] {
            if x.is_nan() {
                let nan = if name == "f16" {
                    f16::from_bits(got).is_nan()
                } else {
                    bf16::from_bits(got).is_nan()
                };
                assert!(nan, "{name} of {x:e} ({:#010x})", x.to_bits());
            } else {
                assert_eq!(got, want, "{name} of {x:e} ({:#010x})", x.to_bits());
            }
        }
    }
}

/// Same results from the fast paths (AVX2 loops, F16C for f16) as from the portable
/// loops, on random bit patterns (NaNs, infinities, subnormals included).
fn check_paths_agree<T: Element>() {
    let n = 1000 + 7;
    let size = std::mem::size_of::<T>();
    let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ T::DTYPE as u64);
    let mut random = |len: usize| -> Vec<u8> { (0..len).map(|_| rng.next() as u8).collect() };
    let (a, b) = (random(n * size), random(n * size));
    let same = |x: &[u8], y: &[u8]| -> bool {
        get::<T>(x, 0, n)
            .iter()
            .zip(get::<T>(y, 0, n))
            .all(|(p, q)| {
                let (p, q) = (p.to_f64(), q.to_f64());
                p == q || (p.is_nan() && q.is_nan())
            })
    };
    for op in EVERY_OP {
        let k = Kernel::new(T::DTYPE, op, 3).unwrap();
        let run = |isa: VectorIsa| -> (Vec<u8>, Vec<u8>) {
            with_isa(isa, || {
                let mut out = vec![0u8; n * size];
                let mut pre = vec![0u8; n * size];
                // SAFETY: all buffers hold n elements of T::DTYPE and are distinct.
                unsafe {
                    k.reduce(out.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n);
                    k.post(out.as_mut_ptr(), n);
                    k.pre(pre.as_mut_ptr(), a.as_ptr(), n);
                }
                (out, pre)
            })
        };
        let portable = run(VectorIsa::Portable);
        for isa in [VectorIsa::Avx2, VectorIsa::Avx512] {
            if isa > cpu_vector_isa() {
                continue;
            }
            let fast = run(isa);
            assert!(
                same(&fast.0, &portable.0),
                "{} {op:?} reduce+post, {isa:?}",
                T::DTYPE
            );
            assert!(
                same(&fast.1, &portable.1),
                "{} {op:?} pre, {isa:?}",
                T::DTYPE
            );
        }
    }
}

#[test]
fn fast_and_portable_paths_agree() {
    check_paths_agree::<i8>();
    check_paths_agree::<u8>();
    check_paths_agree::<i32>();
    check_paths_agree::<u32>();
    check_paths_agree::<i64>();
    check_paths_agree::<u64>();
    check_paths_agree::<f16>();
    check_paths_agree::<f32>();
    check_paths_agree::<f64>();
    check_paths_agree::<bf16>();
    check_paths_agree::<F8E4M3>();
    check_paths_agree::<F8E5M2>();
}
