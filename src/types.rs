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
}
