//! Check data: integer-valued inputs whose reductions are exact in every data type
//! whatever the order of operations (as nccl-tests' `-c 1` does), and the serial
//! reference of every collective. Shared by the perf tools and the tests.

use crate::plan::Collective;
use crate::types::{DataType, Element, ReduceOp, Scalar};

/// Every reduction op, pre-mul-sum with the scalar 2 (the one the check data is made for).
pub fn ops() -> [ReduceOp; 6] {
    [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(Scalar::Int(2)),
    ]
}

fn signed(dtype: DataType) -> bool {
    !matches!(dtype, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
}

fn is_fp8(dtype: DataType) -> bool {
    matches!(dtype, DataType::Float8E4M3 | DataType::Float8E5M2)
}

/// Element `i` of rank `rank`'s input (as f64), for op `op` on `nranks` ranks.
///
/// Chosen so that every partial result is exactly representable: sums of values in
/// 0..=3 (0..=1 for 8-bit floats, where only integers up to 8 or 16 are exact);
/// products of at most two 2s; max/min over small values, negative ones for signed
/// types; avg over `(rank + i) % nranks`, whose mean `(n-1)/2` is exact.
pub fn value(dtype: DataType, op: Option<ReduceOp>, nranks: usize, rank: usize, i: usize) -> f64 {
    let mix = rank.wrapping_mul(7).wrapping_add(i.wrapping_mul(3));
    match op {
        None => ((rank * 31 + i) % if is_fp8(dtype) { 8 } else { 100 }) as f64,
        Some(ReduceOp::Prod) => {
            if (rank + i).is_multiple_of(4) {
                2.0
            } else {
                1.0
            }
        }
        Some(ReduceOp::Max | ReduceOp::Min) => {
            let v = (mix % 8) as f64;
            if signed(dtype) { v - 4.0 } else { v }
        }
        Some(ReduceOp::Avg) if is_fp8(dtype) => ((rank + i) % 2) as f64,
        Some(ReduceOp::Avg) => ((rank + i) % nranks) as f64,
        Some(_) => (mix % if is_fp8(dtype) { 2 } else { 4 }) as f64,
    }
}

/// The reduction of the values at index `i` of every rank, as the type stores it.
pub fn reduced<T: Element>(op: ReduceOp, nranks: usize, i: usize) -> T {
    let vals = (0..nranks).map(|r| value(T::DTYPE, Some(op), nranks, r, i));
    let v = match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.fold(f64::MAX, f64::min),
        ReduceOp::Avg => {
            let s: f64 = vals.sum();
            if T::DTYPE.is_integer() {
                (s / nranks as f64).trunc()
            } else {
                s / nranks as f64
            }
        }
        ReduceOp::PreMulSum(_) => vals.map(|v| 2.0 * v).sum(),
    };
    T::from_f64(v)
}

/// Rank `rank`'s input of `len` elements.
pub fn input<T: Element>(op: Option<ReduceOp>, nranks: usize, rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(value(T::DTYPE, op, nranks, rank, i)))
        .collect()
}

/// What rank `rank`'s output must be after `c` with `count`, or `None` if the call
/// leaves it undefined on this rank.
pub fn expected<T: Element>(
    c: Collective,
    op: ReduceOp,
    count: usize,
    nranks: usize,
    rank: usize,
) -> Option<Vec<T>> {
    let raw = |r: usize, i: usize| T::from_f64(value(T::DTYPE, None, nranks, r, i));
    match c {
        Collective::AllReduce => Some((0..count).map(|i| reduced(op, nranks, i)).collect()),
        Collective::Reduce { root } => {
            (rank == root).then(|| (0..count).map(|i| reduced(op, nranks, i)).collect())
        }
        Collective::ReduceScatter => Some(
            (0..count)
                .map(|i| reduced(op, nranks, rank * count + i))
                .collect(),
        ),
        Collective::Broadcast { root } => Some((0..count).map(|i| raw(root, i)).collect()),
        Collective::AllGather => Some(
            (0..nranks)
                .flat_map(|r| (0..count).map(move |i| (r, i)))
                .map(|(r, i)| raw(r, i))
                .collect(),
        ),
        Collective::Gather { root } => (rank == root).then(|| {
            (0..nranks)
                .flat_map(|r| (0..count).map(move |i| (r, i)))
                .map(|(r, i)| raw(r, i))
                .collect()
        }),
        Collective::Scatter { root } => {
            Some((0..count).map(|i| raw(root, rank * count + i)).collect())
        }
        Collective::AllToAll => Some(
            (0..nranks)
                .flat_map(|r| (0..count).map(move |i| (r, i)))
                .map(|(r, i)| raw(r, rank * count + i))
                .collect(),
        ),
        Collective::Send { .. } | Collective::Recv { .. } => None,
    }
}
