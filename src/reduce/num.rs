//! Per-element arithmetic for every element type, as the kernels apply it.
//!
//! Integers wrap (two's complement). `f32` and `f64` use native arithmetic. `f16`,
//! `bf16` and the 8-bit floats are widened to `f32`, operated on, and rounded back once
//! per operation (to nearest even; the 8-bit floats saturate to their largest finite
//! value). `f32` carries at least 2q + 2 bits for every narrow format of q bits, so one
//! `f32` operation followed by rounding gives the correctly rounded result of the
//! narrow operation (no double-rounding error), matching `__hadd`, `__hmul` and NCCL's
//! fp8 path (via `half` with saturating conversion back).
//!
//! The `f16` and `bf16` conversions here are branch-free re-implementations rather than
//! the `half` crate's, which on x86 without compile-time F16C test for the CPU feature
//! on every call and so keep the loops from vectorising. Tests check them against
//! `half` bit for bit.

use half::{bf16, f16};

use super::loops::{Binary, Unary, map_in_place};
use crate::types::{Element, F8E4M3, F8E5M2, Scalar};

/// Widens an `f16` bit pattern to `f32` exactly (NaN stays NaN).
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    const SHIFTED_EXP: u32 = 0x7C00 << 13;
    // Exponent and mantissa moved into f32 position, exponent rebiased.
    let o = ((h & 0x7FFF) << 13) + ((127 - 15) << 23);
    let exp = (h << 13) & SHIFTED_EXP;
    // Infinity/NaN: push the exponent to all ones.
    let inf_nan = o + ((128 - 16) << 23);
    // Zero/subnormal: renormalise by subtracting 2^-14 from 2^-14 * 1.mantissa.
    let magic = f32::from_bits(113 << 23);
    let sub = (f32::from_bits(o + (1 << 23)) - magic).to_bits();
    let o = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        sub
    } else {
        o
    };
    f32::from_bits(o | ((h & 0x8000) << 16))
}

/// Rounds an `f32` to an `f16` bit pattern, to nearest even; overflow gives infinity,
/// NaN gives a quiet NaN.
#[inline(always)]
pub(super) fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7FFF_FFFF;
    let inf_nan = if a > 0x7F80_0000 { 0x7E00 } else { 0x7C00 };
    // Subnormal results: adding 0.5 (ulp 2^-24, the f16 subnormal spacing) rounds to
    // nearest even in the FPU; the bit difference is the f16 mantissa.
    let magic = f32::from_bits(126 << 23);
    let sub = (f32::from_bits(a) + magic).to_bits() - magic.to_bits();
    // Normal results: rebias and round at bit 13 to nearest even (carries bump the
    // exponent, up to infinity). Wraps below the normal range; that lane is discarded.
    let odd = (a >> 13) & 1;
    let normal = a.wrapping_sub(112 << 23).wrapping_add(0xFFF + odd) >> 13;
    let r = if a >= 0x4780_0000 {
        inf_nan
    } else if a < 0x3880_0000 {
        sub
    } else {
        normal
    };
    (r | sign) as u16
}

/// Widens a `bf16` bit pattern to `f32` exactly.
#[inline(always)]
pub(super) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Rounds an `f32` to a `bf16` bit pattern, to nearest even; NaN stays NaN (quieted).
#[inline(always)]
pub(super) fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    let nan = ((x >> 16) | 0x40) as u16;
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// The per-element operations of one element type.
pub(super) trait Arith: Element {
    /// `a + b`.
    fn add(self, b: Self) -> Self;
    /// `a * b`.
    fn mul(self, b: Self) -> Self;
    /// The larger; for floats IEEE maxNum (a NaN loses to a number), like `fmaxf`.
    fn max(self, b: Self) -> Self;
    /// The smaller; for floats IEEE minNum, like `fminf`.
    fn min(self, b: Self) -> Self;
    /// `buf[i] = buf[i] / nranks` for the average: truncating toward zero for integers,
    /// rounded once for floats (computed in `f32` for the narrow floats).
    ///
    /// # Safety
    /// `buf` is valid for reads and writes of `count` elements (no alignment needed).
    unsafe fn div_all(buf: *mut Self, count: usize, nranks: usize);
    /// Converts a pre-mul-sum scalar: `as` casts for integers, `from_f64` for floats.
    fn from_scalar(s: Scalar) -> Self;
    /// The element's bits, zero-extended, to store the scalar in a `Copy` kernel.
    fn to_raw(self) -> u64;
    /// Inverse of [`to_raw`](Arith::to_raw).
    fn from_raw(raw: u64) -> Self;
}

macro_rules! arith_int {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                self.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                self.wrapping_mul(b)
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                Ord::max(self, b)
            }
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                Ord::min(self, b)
            }
            #[inline(always)]
            unsafe fn div_all(buf: *mut Self, count: usize, nranks: usize) {
                match <$t>::try_from(nranks) {
                    // Rust's `/` truncates toward zero, as NCCL's FuncSumPostDiv does;
                    // d >= 1, so neither division by zero nor MIN / -1 can occur.
                    // SAFETY: forwarded from the caller.
                    Ok(d) => unsafe { map_in_place(buf, count, DivBy(d)) },
                    // A divisor beyond the type's range (only for 8-bit types in
                    // practice): divide exactly in i128.
                    // SAFETY: forwarded from the caller.
                    Err(_) => unsafe { map_in_place(buf, count, DivWide(nranks as i128)) },
                }
            }
            fn from_scalar(s: Scalar) -> Self {
                match s {
                    Scalar::Int(v) => v as $t,
                    Scalar::Uint(v) => v as $t,
                    Scalar::Float(v) => v as $t,
                }
            }
            fn to_raw(self) -> u64 {
                self as u64
            }
            fn from_raw(raw: u64) -> Self {
                raw as $t
            }
        }
    )*};
}

arith_int!(i8, u8, i32, u32, i64, u64);

/// Division by a divisor in the element type (integers truncate toward zero).
#[derive(Clone, Copy)]
struct DivBy<T>(T);

/// Integer division by a divisor beyond the element type's range, done in `i128`.
#[derive(Clone, Copy)]
struct DivWide(i128);

/// Division of a narrow float by an `f32` divisor, computed in `f32`, rounded once.
#[derive(Clone, Copy)]
struct DivF32(f32);

macro_rules! div_int {
    ($($t:ty),*) => {$(
        impl Unary<$t> for DivBy<$t> {
            #[inline(always)]
            fn apply(self, x: $t) -> $t {
                x / self.0
            }
        }
        impl Unary<$t> for DivWide {
            #[inline(always)]
            fn apply(self, x: $t) -> $t {
                (x as i128 / self.0) as $t
            }
        }
    )*};
}

div_int!(i8, u8, i32, u32, i64, u64);

fn scalar_f64(s: Scalar) -> f64 {
    match s {
        Scalar::Int(v) => v as f64,
        Scalar::Uint(v) => v as f64,
        Scalar::Float(v) => v,
    }
}

macro_rules! arith_native_float {
    ($($t:ty, $bits:ty);*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                self + b
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                self * b
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                <$t>::max(self, b)
            }
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                <$t>::min(self, b)
            }
            #[inline(always)]
            unsafe fn div_all(buf: *mut Self, count: usize, nranks: usize) {
                // SAFETY: forwarded from the caller.
                unsafe { map_in_place(buf, count, DivBy(nranks as $t)) }
            }
            fn from_scalar(s: Scalar) -> Self {
                <$t as Element>::from_f64(scalar_f64(s))
            }
            fn to_raw(self) -> u64 {
                u64::from(self.to_bits())
            }
            fn from_raw(raw: u64) -> Self {
                <$t>::from_bits(raw as $bits)
            }
        }
    )*};
}

arith_native_float!(f32, u32; f64, u64);

impl Unary<f32> for DivBy<f32> {
    #[inline(always)]
    fn apply(self, x: f32) -> f32 {
        x / self.0
    }
}

impl Unary<f64> for DivBy<f64> {
    #[inline(always)]
    fn apply(self, x: f64) -> f64 {
        x / self.0
    }
}

/// Narrow floats: widen to `f32`, operate, round back once.
macro_rules! arith_narrow_float {
    ($($t:ty, $widen:path, $narrow:path, $to_bits:path, $from_bits:path);* $(;)?) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                $narrow($widen(self) + $widen(b))
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                $narrow($widen(self) * $widen(b))
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                $narrow(f32::max($widen(self), $widen(b)))
            }
            #[inline(always)]
            fn min(self, b: Self) -> Self {
                $narrow(f32::min($widen(self), $widen(b)))
            }
            #[inline(always)]
            unsafe fn div_all(buf: *mut Self, count: usize, nranks: usize) {
                // The divisor stays exact in f32 (up to 2^24 ranks) rather than being
                // rounded to the narrow type.
                // SAFETY: forwarded from the caller.
                unsafe { map_in_place(buf, count, DivF32(nranks as f32)) }
            }
            fn from_scalar(s: Scalar) -> Self {
                <$t as Element>::from_f64(scalar_f64(s))
            }
            fn to_raw(self) -> u64 {
                u64::from($to_bits(self))
            }
            fn from_raw(raw: u64) -> Self {
                // The raw value came from to_raw, so it fits the bit pattern's width.
                $from_bits(raw.try_into().unwrap_or_default())
            }
        }
        impl Unary<$t> for DivF32 {
            #[inline(always)]
            fn apply(self, x: $t) -> $t {
                $narrow($widen(x) / self.0)
            }
        }
    )*};
}

#[inline(always)]
fn f16_widen(x: f16) -> f32 {
    f16_to_f32(x.to_bits())
}

#[inline(always)]
fn f16_narrow(v: f32) -> f16 {
    f16::from_bits(f32_to_f16(v))
}

#[inline(always)]
fn bf16_widen(x: bf16) -> f32 {
    bf16_to_f32(x.to_bits())
}

#[inline(always)]
fn bf16_narrow(v: f32) -> bf16 {
    bf16::from_bits(f32_to_bf16(v))
}

fn e4m3_bits(x: F8E4M3) -> u8 {
    x.0
}

fn e5m2_bits(x: F8E5M2) -> u8 {
    x.0
}

arith_narrow_float!(
    f16, f16_widen, f16_narrow, f16::to_bits, f16::from_bits;
    bf16, bf16_widen, bf16_narrow, bf16::to_bits, bf16::from_bits;
    F8E4M3, F8E4M3::to_f32, F8E4M3::from_f32, e4m3_bits, F8E4M3;
    F8E5M2, F8E5M2::to_f32, F8E5M2::from_f32, e5m2_bits, F8E5M2;
);

/// `a + b`.
#[derive(Clone, Copy)]
pub(super) struct Add;

/// `a * b`.
#[derive(Clone, Copy)]
pub(super) struct Mul;

/// `max(a, b)`.
#[derive(Clone, Copy)]
pub(super) struct Max;

/// `min(a, b)`.
#[derive(Clone, Copy)]
pub(super) struct Min;

/// `a + s * b`, the product rounded to the element type before the sum.
#[derive(Clone, Copy)]
pub(super) struct PreMulSum<T>(pub(super) T);

/// `s * x`.
#[derive(Clone, Copy)]
pub(super) struct Scale<T>(pub(super) T);

impl<T: Arith> Binary<T> for Add {
    #[inline(always)]
    fn apply(self, a: T, b: T) -> T {
        a.add(b)
    }
}

impl<T: Arith> Binary<T> for Mul {
    #[inline(always)]
    fn apply(self, a: T, b: T) -> T {
        a.mul(b)
    }
}

impl<T: Arith> Binary<T> for Max {
    #[inline(always)]
    fn apply(self, a: T, b: T) -> T {
        Arith::max(a, b)
    }
}

impl<T: Arith> Binary<T> for Min {
    #[inline(always)]
    fn apply(self, a: T, b: T) -> T {
        Arith::min(a, b)
    }
}

impl<T: Arith> Binary<T> for PreMulSum<T> {
    #[inline(always)]
    fn apply(self, a: T, b: T) -> T {
        a.add(b.mul(self.0))
    }
}

impl<T: Arith> Unary<T> for Scale<T> {
    #[inline(always)]
    fn apply(self, x: T) -> T {
        x.mul(self.0)
    }
}
