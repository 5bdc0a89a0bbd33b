//! x86-64 paths chosen at run time ([`super::vector_isa`]): AVX2 and AVX-512 builds of
//! the generic loops (two and four times the vector width of the SSE2 baseline, which
//! matters most for the narrow types whose conversions are computed), and F16C hardware
//! conversions for `f16`.
//!
//! The CPU's features are read once; a check costs two relaxed loads per call.

use std::arch::x86_64::{
    __m256, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128,
    _mm256_add_ps, _mm256_blendv_ps, _mm256_cmp_ps, _mm256_cvtph_ps, _mm256_cvtps_ph,
    _mm256_div_ps, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_set1_ps,
};
use std::ptr;

use super::num::{Arith, f16_to_f32};
use super::{Op, VectorIsa, reduce_body, scale_body};

/// Whether the kernels may use AVX2 and F16C (every AVX2 CPU has F16C in practice).
#[inline]
pub(super) fn has_f16c() -> bool {
    super::vector_isa() >= VectorIsa::Avx2 && std::arch::is_x86_feature_detected!("f16c")
}

/// The generic loops compiled for one instruction set: `reduce`, `scale` and `post`
/// functions whose bodies are [`reduce_body`], [`scale_body`] and [`Arith::div_all`],
/// built with `features` enabled so that LLVM vectorises them that wide.
macro_rules! isa_build {
    ($features:literal, $what:literal, $reduce:ident, $scale:ident, $post:ident) => {
        #[doc = concat!("[`reduce_body`] compiled for ", $what, ".")]
        ///
        /// # Safety
        #[doc = concat!("The CPU supports ", $what, "; otherwise as [`super::Kernel::reduce`], in")]
        /// elements of `T`.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $reduce<T: Arith>(
            op: Op,
            scalar: u64,
            dst: *mut T,
            a: *const T,
            b: *const T,
            n: usize,
        ) {
            // SAFETY: forwarded from the caller.
            unsafe { reduce_body(op, scalar, dst, a, b, n) }
        }

        #[doc = concat!("[`scale_body`] compiled for ", $what, ".")]
        ///
        /// # Safety
        #[doc = concat!("The CPU supports ", $what, "; otherwise as [`super::Kernel::pre`].")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $scale<T: Arith>(s: T, dst: *mut T, src: *const T, n: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { scale_body(s, dst, src, n) }
        }

        #[doc = concat!("[`Arith::div_all`] compiled for ", $what, ".")]
        ///
        /// # Safety
        #[doc = concat!("The CPU supports ", $what, "; otherwise as [`super::Kernel::post`].")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $post<T: Arith>(nranks: usize, buf: *mut T, n: usize) {
            // SAFETY: forwarded from the caller.
            unsafe { T::div_all(buf, n, nranks) }
        }
    };
}

isa_build!("avx2", "AVX2", reduce_avx2, scale_avx2, post_avx2);
isa_build!(
    "avx512f,avx512bw,avx512vl",
    "AVX-512 F, BW and VL",
    reduce_avx512,
    scale_avx512,
    post_avx512
);

/// Loads 8 `f16` (unaligned) widened to `f32`.
///
/// # Safety
/// `p` is valid for reads of 8 `u16`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load8(p: *const u16) -> __m256 {
    // SAFETY: 16 readable bytes (caller); loadu has no alignment requirement.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// Rounds 8 `f32` to `f16` (to nearest even) and stores them (unaligned).
///
/// # Safety
/// `p` is valid for writes of 8 `u16`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn store8(p: *mut u16, v: __m256) {
    let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
    // SAFETY: 16 writable bytes (caller); storeu has no alignment requirement.
    unsafe { _mm_storeu_si128(p.cast(), h) }
}

/// Rounds each lane to the nearest `f16` value, keeping it in `f32`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn round_f16(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// IEEE maxNum per lane (a NaN loses to a number), as `f32::max`. `maxps` returns its
/// second operand when either is NaN, so `max(y, x)` gives `x` then, and a NaN `x` is
/// replaced by `y` afterwards.
#[target_feature(enable = "avx2")]
#[inline]
fn max_num(x: __m256, y: __m256) -> __m256 {
    _mm256_blendv_ps(_mm256_max_ps(y, x), y, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

/// IEEE minNum per lane, as `f32::min` (see [`max_num`]).
#[target_feature(enable = "avx2")]
#[inline]
fn min_num(x: __m256, y: __m256) -> __m256 {
    _mm256_blendv_ps(_mm256_min_ps(y, x), y, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

/// Copies `count` (< 8) `u16` from `src` into an 8-lane scratch array, zero-padded.
///
/// # Safety
/// `src` is valid for reads of `count` `u16` (any alignment).
#[inline(always)]
unsafe fn tail(src: *const u16, count: usize) -> [u16; 8] {
    let mut t = [0u16; 8];
    // SAFETY: count < 8 elements fit in t; src is readable for them; byte copies need
    // no alignment; t is a fresh local, so no overlap.
    unsafe { ptr::copy_nonoverlapping(src.cast::<u8>(), t.as_mut_ptr().cast::<u8>(), count * 2) };
    t
}

/// `dst[i] = f(a[i], b[i])` over `f16` in 8-lane `f32` vectors; a partial last vector goes
/// through zero-padded scratch. Each vector is loaded before it is stored, so `dst` may
/// be exactly `a` or `b`.
///
/// # Safety
/// `a`, `b` readable and `dst` writable for `n` `u16`; `dst` equals or does not overlap
/// each source; the CPU supports AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn zip8(
    dst: *mut u16,
    a: *const u16,
    b: *const u16,
    n: usize,
    f: impl Fn(__m256, __m256) -> __m256,
) {
    let full = n - n % 8;
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= n, all three valid for n elements (caller).
        unsafe { store8(dst.add(i), f(load8(a.add(i)), load8(b.add(i)))) };
        i += 8;
    }
    if full < n {
        let rest = n - full;
        // SAFETY: rest elements remain at offset `full` of each buffer (caller); the
        // scratch arrays hold 8; the write-back copies rest elements as bytes.
        unsafe {
            let (ta, tb) = (tail(a.add(full), rest), tail(b.add(full), rest));
            let mut out = [0u16; 8];
            store8(out.as_mut_ptr(), f(load8(ta.as_ptr()), load8(tb.as_ptr())));
            ptr::copy_nonoverlapping(
                out.as_ptr().cast::<u8>(),
                dst.add(full).cast::<u8>(),
                rest * 2,
            );
        }
    }
}

/// `dst[i] = f(src[i])` over `f16`, as [`zip8`].
///
/// # Safety
/// `src` readable and `dst` writable for `n` `u16`; `dst` equals or does not overlap
/// `src`; the CPU supports AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn map8(dst: *mut u16, src: *const u16, n: usize, f: impl Fn(__m256) -> __m256) {
    // SAFETY: forwarded; reading src twice is harmless and f ignores the second lane set.
    unsafe { zip8(dst, src, src, n, |x, _| f(x)) }
}

/// [`super::Kernel::reduce`] for `f16` with F16C conversions: each operation in `f32`,
/// rounded back once to nearest even (pre-mul-sum rounds the product first).
///
/// # Safety
/// As [`super::Kernel::reduce`] in `f16` elements; the CPU supports AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn reduce_f16(
    op: Op,
    scalar: u16,
    dst: *mut u16,
    a: *const u16,
    b: *const u16,
    n: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match op {
            Op::Sum | Op::Avg => zip8(dst, a, b, n, |x, y| _mm256_add_ps(x, y)),
            Op::Prod => zip8(dst, a, b, n, |x, y| _mm256_mul_ps(x, y)),
            Op::Max => zip8(dst, a, b, n, |x, y| max_num(x, y)),
            Op::Min => zip8(dst, a, b, n, |x, y| min_num(x, y)),
            Op::PreMulSum => {
                let s = _mm256_set1_ps(f16_to_f32(scalar));
                zip8(dst, a, b, n, |x, y| {
                    _mm256_add_ps(x, round_f16(_mm256_mul_ps(y, s)))
                })
            }
        }
    }
}

/// [`super::Kernel::pre`] for pre-mul-sum on `f16`: `dst[i] = s * src[i]`, rounded once.
///
/// # Safety
/// As [`super::Kernel::pre`] in `f16` elements; the CPU supports AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn scale_f16(scalar: u16, dst: *mut u16, src: *const u16, n: usize) {
    let s = _mm256_set1_ps(f16_to_f32(scalar));
    // SAFETY: forwarded from the caller.
    unsafe { map8(dst, src, n, |x| _mm256_mul_ps(x, s)) }
}

/// [`super::Kernel::post`] for avg on `f16`: `buf[i] / nranks` in `f32`, rounded once.
///
/// # Safety
/// As [`super::Kernel::post`] in `f16` elements; the CPU supports AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn post_f16(nranks: usize, buf: *mut u16, n: usize) {
    let d = _mm256_set1_ps(nranks as f32);
    // SAFETY: forwarded from the caller.
    unsafe { map8(buf, buf, n, |x| _mm256_div_ps(x, d)) }
}
