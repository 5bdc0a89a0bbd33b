//! Element types and reduction operations, numbered exactly as NCCL numbers them.
//!
//! The numeric values are part of the ABI: `ncclDataType_t` and `ncclRedOp_t` in the C
//! header use the same integers, so [`DataType::from_nccl`] / [`DataType::to_nccl`] are
//! plain conversions.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// An element type, with NCCL's numbering (`ncclDataType_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum DataType {
    /// Signed 8-bit integer (`ncclInt8`, also `ncclChar`).
    Int8 = 0,
    /// Unsigned 8-bit integer (`ncclUint8`).
    Uint8 = 1,
    /// Signed 32-bit integer (`ncclInt32`, also `ncclInt`).
    Int32 = 2,
    /// Unsigned 32-bit integer (`ncclUint32`).
    Uint32 = 3,
    /// Signed 64-bit integer (`ncclInt64`).
    Int64 = 4,
    /// Unsigned 64-bit integer (`ncclUint64`).
    Uint64 = 5,
    /// IEEE 754 half precision (`ncclFloat16`, also `ncclHalf`).
    Float16 = 6,
    /// IEEE 754 single precision (`ncclFloat32`, also `ncclFloat`).
    Float32 = 7,
    /// IEEE 754 double precision (`ncclFloat64`, also `ncclDouble`).
    Float64 = 8,
    /// bfloat16 (`ncclBfloat16`).
    Bfloat16 = 9,
    /// 8-bit float, 4 exponent and 3 mantissa bits (`ncclFloat8e4m3`).
    Float8E4M3 = 10,
    /// 8-bit float, 5 exponent and 2 mantissa bits (`ncclFloat8e5m2`).
    Float8E5M2 = 11,
}

impl DataType {
    /// All twelve types, in NCCL order.
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// True for the floating-point types (including the 16- and 8-bit ones).
    pub const fn is_float(self) -> bool {
        !self.is_integer()
    }

    /// True for the integer types.
    pub const fn is_integer(self) -> bool {
        matches!(
            self,
            DataType::Int8
                | DataType::Uint8
                | DataType::Int32
                | DataType::Uint32
                | DataType::Int64
                | DataType::Uint64
        )
    }

    /// The `ncclDataType_t` value.
    pub const fn to_nccl(self) -> i32 {
        self as i32
    }

    /// Converts an `ncclDataType_t` value, rejecting values outside 0..=11.
    pub fn from_nccl(value: i32) -> Result<Self> {
        usize::try_from(value)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
            .ok_or_else(|| Error::invalid(format!("data type {value} is not in 0..=11")))
    }

    /// The name nccl-tests prints for this type (`float`, `half`, `bfloat16`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8E4M3 => "f8e4m3",
            DataType::Float8E5M2 => "f8e5m2",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;

    /// Parses nccl-tests names (`float`, `half`, `double`, …) and the usual aliases
    /// (`float32`, `fp16`, `bf16`, `char`, `int`, …).
    fn from_str(s: &str) -> Result<Self> {
        let t = match s.to_ascii_lowercase().as_str() {
            "int8" | "char" | "i8" => DataType::Int8,
            "uint8" | "u8" => DataType::Uint8,
            "int32" | "int" | "i32" => DataType::Int32,
            "uint32" | "u32" => DataType::Uint32,
            "int64" | "i64" => DataType::Int64,
            "uint64" | "u64" => DataType::Uint64,
            "half" | "float16" | "fp16" | "f16" => DataType::Float16,
            "float" | "float32" | "fp32" | "f32" => DataType::Float32,
            "double" | "float64" | "fp64" | "f64" => DataType::Float64,
            "bfloat16" | "bf16" => DataType::Bfloat16,
            "f8e4m3" | "float8e4m3" | "fp8_e4m3" | "e4m3" => DataType::Float8E4M3,
            "f8e5m2" | "float8e5m2" | "fp8_e5m2" | "e5m2" => DataType::Float8E5M2,
            _ => {
                return Err(Error::invalid(format!(
                    "unknown data type {s:?} (expected one of int8, uint8, int32, uint32, \
                     int64, uint64, half, float, double, bfloat16, f8e4m3, f8e5m2)"
                )));
            }
        };
        Ok(t)
    }
}

/// The scalar of a pre-multiplied sum, converted to the element type when the reduction
/// runs (NCCL passes it as a pointer to one element of the collective's type).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// A signed integer scalar.
    Int(i64),
    /// An unsigned integer scalar.
    Uint(u64),
    /// A floating-point scalar.
    Float(f64),
}

/// A reduction operation, with NCCL's numbering for the built-in ones (`ncclRedOp_t`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    /// Element-wise sum (`ncclSum` = 0).
    Sum,
    /// Element-wise product (`ncclProd` = 1).
    Prod,
    /// Element-wise maximum (`ncclMax` = 2).
    Max,
    /// Element-wise minimum (`ncclMin` = 3).
    Min,
    /// Sum divided by the number of ranks (`ncclAvg` = 4).
    Avg,
    /// Each input multiplied by `scalar`, then summed (`ncclRedOpCreatePreMulSum`).
    PreMulSum(Scalar),
}

impl ReduceOp {
    /// The `ncclRedOp_t` value of a built-in op; `None` for pre-mul-sum, whose value is
    /// a handle allocated by `ncclRedOpCreatePreMulSum`.
    pub const fn to_nccl(self) -> Option<i32> {
        match self {
            ReduceOp::Sum => Some(0),
            ReduceOp::Prod => Some(1),
            ReduceOp::Max => Some(2),
            ReduceOp::Min => Some(3),
            ReduceOp::Avg => Some(4),
            ReduceOp::PreMulSum(_) => None,
        }
    }

    /// Converts a built-in `ncclRedOp_t` value (0..=4).
    pub fn from_nccl(value: i32) -> Result<Self> {
        match value {
            0 => Ok(ReduceOp::Sum),
            1 => Ok(ReduceOp::Prod),
            2 => Ok(ReduceOp::Max),
            3 => Ok(ReduceOp::Min),
            4 => Ok(ReduceOp::Avg),
            _ => Err(Error::invalid(format!(
                "reduction op {value} is not a built-in op (0..=4)"
            ))),
        }
    }

    /// The name nccl-tests prints (`sum`, `prod`, `max`, `min`, `avg`, `mulsum`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "mulsum",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rounds `x` to an 8-bit float with `M` mantissa bits and exponent bias `BIAS`, to
/// nearest with ties to even, saturating to the code `MAX` (the largest finite value);
/// NaN becomes the code 0x7F with `x`'s sign. Branch-free, so kernels vectorise it.
#[inline(always)]
fn f32_to_f8<const M: u32, const BIAS: u32, const MAX: u32>(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal results: rebias the exponent, then round the mantissa at bit 23 - M to
    // nearest even; a carry out of the mantissa correctly bumps the exponent. Results
    // above MAX (including infinities, which land far above it) saturate.
    let shift = 23 - M;
    let rebiased = abs.wrapping_sub((127 - BIAS) << 23);
    let odd = (rebiased >> shift) & 1;
    // (Below the normal range `rebiased` wraps; that lane is discarded by the select.)
    let normal = (rebiased.wrapping_add((1 << (shift - 1)) - 1 + odd) >> shift).min(MAX);
    // Subnormal results: adding 2^k, whose ulp is the subnormal spacing 2^(1-BIAS-M),
    // makes the FPU round to that spacing (ties to even); the difference of the bit
    // patterns is then the mantissa count, and a count of 2^M is the smallest normal.
    let magic = f32::from_bits((127 + 24 - BIAS - M) << 23);
    let sub = (f32::from_bits(abs) + magic).to_bits() - magic.to_bits();
    let code = if abs < (127 + 1 - BIAS) << 23 {
        sub
    } else {
        normal
    };
    let code = if abs > 0x7F80_0000 { 0x7F } else { code };
    (code | sign) as u8
}

/// [`f32_to_f8`] for an `f64` input, rounding once (a detour through `f32` could round
/// twice).
fn f64_to_f8<const M: u64, const BIAS: u64, const MAX: u64>(x: f64) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 56) & 0x80;
    let abs = bits & 0x7FFF_FFFF_FFFF_FFFF;
    let code = if abs > 0x7FF0_0000_0000_0000 {
        0x7F
    } else if abs < (1023 + 1 - BIAS) << 52 {
        let magic = f64::from_bits((1023 + 53 - BIAS - M) << 52);
        (f64::from_bits(abs) + magic).to_bits() - magic.to_bits()
    } else {
        let shift = 52 - M;
        let rebiased = abs - ((1023 - BIAS) << 52);
        let odd = (rebiased >> shift) & 1;
        ((rebiased + (1 << (shift - 1)) - 1 + odd) >> shift).min(MAX)
    };
    (code | sign) as u8
}

/// An 8-bit float in the OCP E4M3 ("fn") format, as NVIDIA's `__nv_fp8_e4m3`: 1 sign,
/// 4 exponent (bias 7) and 3 mantissa bits; no infinities; `0x7F` and `0xFF` are NaN;
/// largest finite value 448; subnormals down to 2^-9. The field is the raw bit pattern.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct F8E4M3(pub u8);

impl F8E4M3 {
    /// The largest finite value, 448.
    pub const MAX: F8E4M3 = F8E4M3(0x7E);

    /// The exact value as an `f32` (NaN for the two NaN patterns).
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        let b = u32::from(self.0);
        let sign = (b & 0x80) << 24;
        let exp = (b >> 3) & 0xF;
        let man = b & 7;
        let normal = f32::from_bits(sign | ((exp + 120) << 23) | (man << 20));
        let sub = f32::from_bits(sign | ((man as i32 as f32) * (1.0 / 512.0)).to_bits());
        let nan = f32::from_bits(sign | 0x7FC0_0000);
        if exp == 0 {
            sub
        } else if b & 0x7F == 0x7F {
            nan
        } else {
            normal
        }
    }

    /// Rounds to nearest (ties to even), saturating out-of-range values and infinities
    /// to ±448 like CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`;
    /// NaN becomes NaN.
    #[inline(always)]
    pub fn from_f32(x: f32) -> Self {
        F8E4M3(f32_to_f8::<3, 7, 0x7E>(x))
    }

    /// [`from_f32`](Self::from_f32) for an `f64`, rounding once.
    pub fn from_f64(x: f64) -> Self {
        F8E4M3(f64_to_f8::<3, 7, 0x7E>(x))
    }

    /// True for the NaN patterns `0x7F` and `0xFF`.
    pub const fn is_nan(self) -> bool {
        self.0 & 0x7F == 0x7F
    }
}

/// An 8-bit float in the E5M2 format, as NVIDIA's `__nv_fp8_e5m2`: 1 sign, 5 exponent
/// (bias 15) and 2 mantissa bits, IEEE-like with infinities (`0x7C`) and NaNs; largest
/// finite value 57344; subnormals down to 2^-16. The field is the raw bit pattern.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct F8E5M2(pub u8);

impl F8E5M2 {
    /// The largest finite value, 57344.
    pub const MAX: F8E5M2 = F8E5M2(0x7B);

    /// The exact value as an `f32` (infinities and NaNs included).
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        let b = u32::from(self.0);
        let sign = (b & 0x80) << 24;
        let exp = (b >> 2) & 0x1F;
        let man = b & 3;
        let normal = f32::from_bits(sign | ((exp + 112) << 23) | (man << 21));
        let sub = f32::from_bits(sign | ((man as i32 as f32) * (1.0 / 65536.0)).to_bits());
        let special = f32::from_bits(sign | if man == 0 { 0x7F80_0000 } else { 0x7FC0_0000 });
        if exp == 0 {
            sub
        } else if exp == 31 {
            special
        } else {
            normal
        }
    }

    /// Rounds to nearest (ties to even), saturating out-of-range values and infinities
    /// to ±57344 like CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)`;
    /// NaN becomes NaN.
    #[inline(always)]
    pub fn from_f32(x: f32) -> Self {
        F8E5M2(f32_to_f8::<2, 15, 0x7B>(x))
    }

    /// [`from_f32`](Self::from_f32) for an `f64`, rounding once.
    pub fn from_f64(x: f64) -> Self {
        F8E5M2(f64_to_f8::<2, 15, 0x7B>(x))
    }

    /// True for the NaN patterns (exponent all ones, mantissa non-zero).
    pub const fn is_nan(self) -> bool {
        self.0 & 0x7F > 0x7C
    }
}

mod sealed {
    /// Keeps [`super::Element`] closed: kernels reinterpret raw bytes as the element type,
    /// which is only sound for the types listed here.
    pub trait Sealed {}
}

/// A Rust type that holds one element of a [`DataType`]: the bridge between typed
/// slices and the byte-level reduction kernels.
///
/// Implemented for `i8`, `u8`, `i32`, `u32`, `i64`, `u64`, [`half::f16`],
/// [`half::bf16`], `f32`, `f64`, [`F8E4M3`] and [`F8E5M2`]; the trait is sealed, because
/// its users reinterpret bytes as `Self` on the strength of [`Element::DTYPE`].
pub trait Element: sealed::Sealed + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The NCCL data type whose elements have this representation.
    const DTYPE: DataType;

    /// Converts from `f64`: floats round to nearest even (the 8-bit floats saturate to
    /// their largest finite value); integers use an `as` cast (truncating toward zero,
    /// saturating at the bounds, NaN to 0).
    fn from_f64(v: f64) -> Self;

    /// Converts to `f64` (exact for every type except 64-bit integers beyond 2^53).
    fn to_f64(self) -> f64;
}

macro_rules! element_by_cast {
    ($($t:ty => $dt:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$dt;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}

element_by_cast!(
    i8 => Int8,
    u8 => Uint8,
    i32 => Int32,
    u32 => Uint32,
    i64 => Int64,
    u64 => Uint64,
    f32 => Float32,
    f64 => Float64,
);

/// Rounds an `f64` to `f32` toward zero and sets the last bit when inexact ("round to
/// odd"). Rounding that result to any format with at most 22 significant bits (f16,
/// bf16) gives the correctly rounded value of the `f64`, which a plain `as f32` detour
/// (round to nearest twice) does not always give.
fn f64_to_f32_round_odd(v: f64) -> f32 {
    let t = v as f32;
    if v.is_nan() || f64::from(t) == v {
        return t;
    }
    // Inexact: step back toward zero if round-to-nearest went away from zero (this also
    // turns an overflow to infinity into f32::MAX), then mark the lost bits.
    let toward_zero = if f64::from(t).abs() > v.abs() {
        t.to_bits() - 1
    } else {
        t.to_bits()
    };
    f32::from_bits(toward_zero | 1)
}

macro_rules! element_half {
    ($($t:ty => $dt:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$dt;
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f32(f64_to_f32_round_odd(v))
            }
            #[inline]
            fn to_f64(self) -> f64 {
                f64::from(self.to_f32())
            }
        }
    )*};
}

element_half!(half::f16 => Float16, half::bf16 => Bfloat16);

macro_rules! element_f8 {
    ($($t:ty => $dt:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$dt;
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                f64::from(self.to_f32())
            }
        }
    )*};
}

element_f8!(F8E4M3 => Float8E4M3, F8E5M2 => Float8E5M2);

/// Runs `$body` with the type alias `$T` bound to the Rust type of the [`DataType`]
/// value `$dtype` — the bridge from a run-time data type to generic code over
/// [`Element`]:
///
/// ```
/// use ferroccl::{DataType, Element, with_element_type};
/// fn size_of_elem(d: DataType) -> usize {
///     with_element_type!(d, T => std::mem::size_of::<T>())
/// }
/// assert_eq!(size_of_elem(DataType::Bfloat16), 2);
/// ```
#[macro_export]
macro_rules! with_element_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DataType::Int8 => {
                type $T = i8;
                $body
            }
            $crate::DataType::Uint8 => {
                type $T = u8;
                $body
            }
            $crate::DataType::Int32 => {
                type $T = i32;
                $body
            }
            $crate::DataType::Uint32 => {
                type $T = u32;
                $body
            }
            $crate::DataType::Int64 => {
                type $T = i64;
                $body
            }
            $crate::DataType::Uint64 => {
                type $T = u64;
                $body
            }
            $crate::DataType::Float16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DataType::Float32 => {
                type $T = f32;
                $body
            }
            $crate::DataType::Float64 => {
                type $T = f64;
                $body
            }
            $crate::DataType::Bfloat16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DataType::Float8E4M3 => {
                type $T = $crate::F8E4M3;
                $body
            }
            $crate::DataType::Float8E5M2 => {
                type $T = $crate::F8E5M2;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_numbering_round_trips() {
        for (i, t) in DataType::ALL.iter().enumerate() {
            assert_eq!(t.to_nccl(), i as i32);
            assert_eq!(DataType::from_nccl(i as i32).unwrap(), *t);
            assert_eq!(t.name().parse::<DataType>().unwrap(), *t);
        }
        assert!(DataType::from_nccl(12).is_err());
        assert!(DataType::from_nccl(-1).is_err());
        for v in 0..5 {
            assert_eq!(ReduceOp::from_nccl(v).unwrap().to_nccl(), Some(v));
        }
        assert!(ReduceOp::from_nccl(5).is_err());
    }

    #[test]
    fn sizes_match_nccl() {
        let sizes: Vec<usize> = DataType::ALL.iter().map(|t| t.size()).collect();
        assert_eq!(sizes, [1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1]);
    }

    #[test]
    fn unknown_type_names_the_input() {
        let err = "float128".parse::<DataType>().unwrap_err().to_string();
        assert!(err.contains("float128"), "{err}");
    }

    /// Every finite non-negative value of an 8-bit format, ascending, with its code.
    fn positive_finite(to_f32: fn(u8) -> f32) -> Vec<(u8, f32)> {
        let mut v: Vec<(u8, f32)> = (0..0x80u8)
            .map(|b| (b, to_f32(b)))
            .filter(|(_, x)| x.is_finite())
            .collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1));
        v
    }

    /// The slow, obviously right rounding: nearest finite value, ties to the even code,
    /// saturating beyond the largest finite value, sign copied.
    fn reference_round(x: f64, table: &[(u8, f32)]) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        let max = table[table.len() - 1];
        if a >= f64::from(max.1) {
            return max.0 | sign;
        }
        let mut best = table[0];
        for &(code, v) in table {
            let (d, db) = ((f64::from(v) - a).abs(), (f64::from(best.1) - a).abs());
            if d < db || (d == db && code & 1 == 0) {
                best = (code, v);
            }
        }
        best.0 | sign
    }

    /// A format's name, its widening, and its two narrowing conversions, on raw bits.
    type F8Format = (&'static str, fn(u8) -> f32, fn(f32) -> u8, fn(f64) -> u8);

    fn f8_formats() -> [F8Format; 2] {
        [
            (
                "e4m3",
                |b| F8E4M3(b).to_f32(),
                |x| F8E4M3::from_f32(x).0,
                |x| F8E4M3::from_f64(x).0,
            ),
            (
                "e5m2",
                |b| F8E5M2(b).to_f32(),
                |x| F8E5M2::from_f32(x).0,
                |x| F8E5M2::from_f64(x).0,
            ),
        ]
    }

    #[test]
    fn f8_every_bit_pattern_round_trips() {
        for (name, to_f32, from_f32, from_f64) in f8_formats() {
            for b in 0..=u8::MAX {
                let x = to_f32(b);
                if x.is_nan() {
                    assert!(from_f32(x) & 0x7F == 0x7F, "{name} {b:#04x}");
                    assert!(to_f32(from_f32(x)).is_nan() && to_f32(from_f64(x.into())).is_nan());
                } else if x.is_infinite() {
                    // Only E5M2 has infinities; SATFINITE turns them into ±max.
                    assert_eq!(name, "e5m2");
                    assert_eq!(from_f32(x), 0x7B | (b & 0x80), "{b:#04x}");
                } else {
                    assert_eq!(from_f32(x), b, "{name} {b:#04x} = {x:e}");
                    assert_eq!(from_f64(x.into()), b, "{name} {b:#04x} = {x:e}");
                }
            }
        }
        // Exactly two NaN codes in E4M3 and six in E5M2, two infinities in E5M2.
        assert_eq!((0..=255u8).filter(|&b| F8E4M3(b).is_nan()).count(), 2);
        assert_eq!(
            (0..=255u8).filter(|&b| F8E4M3(b).to_f32().is_nan()).count(),
            2
        );
        assert_eq!((0..=255u8).filter(|&b| F8E5M2(b).is_nan()).count(), 6);
        assert_eq!(
            (0..=255u8).filter(|&b| F8E5M2(b).to_f32().is_nan()).count(),
            6
        );
        assert_eq!(
            (0..=255u8)
                .filter(|&b| F8E5M2(b).to_f32().is_infinite())
                .count(),
            2
        );
    }

    #[test]
    fn f8_known_values() {
        let e = |b| F8E4M3(b).to_f32();
        assert_eq!(e(0x7E), 448.0);
        assert_eq!(e(0xFE), -448.0);
        assert_eq!(e(0x08), 2f32.powi(-6));
        assert_eq!(e(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e(0x01), 2f32.powi(-9));
        assert_eq!(e(0x38), 1.0);
        assert_eq!(e(0x39), 1.125);
        assert_eq!(e(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(e(0x7F).is_nan() && e(0xFF).is_nan());
        let m = |b| F8E5M2(b).to_f32();
        assert_eq!(m(0x7B), 57344.0);
        assert_eq!(m(0x7C), f32::INFINITY);
        assert_eq!(m(0xFC), f32::NEG_INFINITY);
        assert!(m(0x7D).is_nan() && m(0x7E).is_nan() && m(0x7F).is_nan() && m(0xFF).is_nan());
        assert_eq!(m(0x04), 2f32.powi(-14));
        assert_eq!(m(0x01), 2f32.powi(-16));
        assert_eq!(m(0x03), 3.0 * 2f32.powi(-16));
        assert_eq!(m(0x3C), 1.0);
        assert_eq!(m(0x3D), 1.25);
        assert_eq!(F8E4M3::MAX.to_f32(), 448.0);
        assert_eq!(F8E5M2::MAX.to_f32(), 57344.0);
    }

    #[test]
    fn f8_midpoints_round_to_even() {
        for (name, to_f32, from_f32, from_f64) in f8_formats() {
            let table = positive_finite(to_f32);
            for w in table.windows(2) {
                let ((lo_code, lo), (hi_code, hi)) = (w[0], w[1]);
                let mid = (f64::from(lo) + f64::from(hi)) / 2.0;
                let even = if lo_code & 1 == 0 { lo_code } else { hi_code };
                let mid32 = mid as f32;
                assert_eq!(f64::from(mid32), mid, "midpoints are exact in f32");
                for sign in [1.0f32, -1.0] {
                    let s = if sign < 0.0 { 0x80 } else { 0 };
                    let ctx = format!("{name} between {lo:e} and {hi:e}, sign {sign}");
                    assert_eq!(from_f32(sign * mid32), even | s, "{ctx}");
                    assert_eq!(from_f64(f64::from(sign) * mid), even | s, "{ctx}");
                    let above = f32::from_bits(mid32.to_bits() + 1);
                    let below = f32::from_bits(mid32.to_bits() - 1);
                    assert_eq!(from_f32(sign * above), hi_code | s, "{ctx} (above)");
                    assert_eq!(from_f32(sign * below), lo_code | s, "{ctx} (below)");
                    // Just above the midpoint in f64 but rounding to it in f32: a naive
                    // f64 -> f32 -> f8 path would tie to even here.
                    let nudge = f64::from(sign) * (mid + mid * 2f64.powi(-40));
                    assert_eq!(from_f64(nudge), hi_code | s, "{ctx} (f64 nudge)");
                }
            }
        }
    }

    #[test]
    fn f8_saturates_and_matches_the_reference() {
        // Beyond the largest finite value, including past the next would-be value and
        // infinity, everything saturates (SATFINITE); NaN stays NaN.
        for x in [449.0f32, 464.0, 479.0, 480.0, 1e6, 3e38, f32::INFINITY] {
            assert_eq!(F8E4M3::from_f32(x), F8E4M3::MAX, "{x}");
            assert_eq!(F8E4M3::from_f32(-x), F8E4M3(0xFE), "{x}");
            assert_eq!(F8E4M3::from_f64(f64::from(x)), F8E4M3::MAX, "{x}");
        }
        for x in [57345.0f32, 61440.0, 65536.0, 1e9, f32::INFINITY] {
            assert_eq!(F8E5M2::from_f32(x), F8E5M2::MAX, "{x}");
            assert_eq!(F8E5M2::from_f32(-x), F8E5M2(0xFB), "{x}");
            assert_eq!(F8E5M2::from_f64(f64::from(x)), F8E5M2::MAX, "{x}");
        }
        assert_eq!(F8E4M3::from_f64(1e300), F8E4M3::MAX);
        assert!(F8E4M3::from_f32(f32::NAN).is_nan() && F8E5M2::from_f32(-f32::NAN).is_nan());
        assert!(F8E4M3::from_f64(f64::NAN).is_nan() && F8E5M2::from_f64(f64::NAN).is_nan());
        // Tiny values flush to a signed zero; half the smallest subnormal ties to zero.
        assert_eq!(F8E4M3::from_f32(2f32.powi(-10)), F8E4M3(0));
        assert_eq!(F8E4M3::from_f32(-1e-30), F8E4M3(0x80));
        assert_eq!(F8E4M3::from_f32(1.5 * 2f32.powi(-10)), F8E4M3(1));
        assert_eq!(F8E5M2::from_f32(2f32.powi(-17)), F8E5M2(0));
        assert_eq!(F8E5M2::from_f32(f32::from_bits(1)), F8E5M2(0));

        // A stride through all f32 bit patterns against the slow reference.
        for (name, to_f32, from_f32, from_f64) in f8_formats() {
            let table = positive_finite(to_f32);
            // Dense through the formats' range (2^-20 ..= 2^17), sparse elsewhere.
            let dense = (0x3580_0000u32..0x4800_0000).step_by(1021);
            for bits in (0..u32::MAX).step_by(65_521).chain(dense) {
                let x = f32::from_bits(bits);
                if x.is_nan() {
                    continue;
                }
                let want = reference_round(x.into(), &table);
                assert_eq!(from_f32(x), want, "{name} {x:e} ({bits:#010x})");
                assert_eq!(from_f64(x.into()), want, "{name} {x:e} ({bits:#010x})");
            }
        }
    }

    #[test]
    fn element_conversions() {
        assert_eq!(<i8 as Element>::from_f64(-3.9), -3);
        assert_eq!(<u8 as Element>::from_f64(300.0), 255);
        assert_eq!(<u64 as Element>::from_f64(-1.0), 0);
        assert_eq!(<i64 as Element>::from_f64(f64::NAN), 0);
        assert_eq!(<f32 as Element>::from_f64(0.1), 0.1f32);
        assert_eq!(<f64 as Element>::to_f64(0.1), 0.1);
        assert_eq!(<i32 as Element>::to_f64(-7), -7.0);
        assert_eq!(<F8E4M3 as Element>::from_f64(1000.0), F8E4M3::MAX);
        assert_eq!(F8E5M2(0x3C).to_f64(), 1.0);
        // f16 / bf16 round once from f64: 1 + 2^-11 + 2^-40 lies above the f16 midpoint
        // 1 + 2^-11 but rounds to it in f32, where a detour through f32 would tie down.
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(
            <half::f16 as Element>::from_f64(x).to_f64(),
            1.0 + 2f64.powi(-10)
        );
        let y = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(
            <half::bf16 as Element>::from_f64(y).to_f64(),
            1.0 + 2f64.powi(-7)
        );
        assert_eq!(<half::f16 as Element>::from_f64(1e10), half::f16::INFINITY);
        assert_eq!(
            <half::bf16 as Element>::from_f64(1e300),
            half::bf16::INFINITY
        );
        assert_eq!(
            <half::f16 as Element>::from_f64(-0.1).to_f64(),
            half::f16::from_f32(-0.1).to_f64()
        );
        assert!(<half::f16 as Element>::from_f64(f64::NAN).is_nan());
        let dtypes = [
            i8::DTYPE,
            u8::DTYPE,
            i32::DTYPE,
            u32::DTYPE,
            i64::DTYPE,
            u64::DTYPE,
            half::f16::DTYPE,
            f32::DTYPE,
            f64::DTYPE,
            half::bf16::DTYPE,
            F8E4M3::DTYPE,
            F8E5M2::DTYPE,
        ];
        assert_eq!(dtypes, DataType::ALL);
        let sizes = [
            size_of::<i8>(),
            size_of::<u8>(),
            size_of::<i32>(),
            size_of::<u32>(),
            size_of::<i64>(),
            size_of::<u64>(),
            size_of::<half::f16>(),
            size_of::<f32>(),
            size_of::<f64>(),
            size_of::<half::bf16>(),
            size_of::<F8E4M3>(),
            size_of::<F8E5M2>(),
        ];
        for (t, size) in DataType::ALL.iter().zip(sizes) {
            assert_eq!(t.size(), size, "{t}");
        }
    }
}
