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

/// The period in `i` of [`value`] for `dtype`, `op` and `nranks`, the same for every
/// rank (so the reductions of [`reduced`] repeat with it too). Every case of [`value`]
/// is an index taken modulo a constant or `nranks`: 100 or 8 for raw data, 4 for
/// products, 8 for max/min (`3i` modulo 8 runs through every residue), `nranks` or 2
/// for averages, 4 or 2 for sums.
fn period(dtype: DataType, op: Option<ReduceOp>, nranks: usize) -> usize {
    let fp8 = is_fp8(dtype);
    match op {
        None if fp8 => 8,
        None => 100,
        Some(ReduceOp::Prod) => 4,
        Some(ReduceOp::Max | ReduceOp::Min) => 8,
        Some(ReduceOp::Avg) if fp8 => 2,
        Some(ReduceOp::Avg) => nranks.max(1),
        Some(_) if fp8 => 2,
        Some(_) => 4,
    }
}

/// Elements `start..start + len` of the sequence that repeats `table` (one period).
fn tiled<T: Copy>(table: &[T], start: usize, len: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    let mut at = start % table.len().max(1);
    while out.len() < len {
        let take = (table.len() - at).min(len - out.len());
        out.extend_from_slice(&table[at..at + take]);
        at = 0;
    }
    out
}

/// Elements `start..start + len` of rank `rank`'s input: one period computed from
/// [`value`], then repeated (the tests' grids check millions of elements, and computing
/// each one was most of their time).
fn input_from<T: Element>(
    op: Option<ReduceOp>,
    nranks: usize,
    rank: usize,
    start: usize,
    len: usize,
) -> Vec<T> {
    let p = period(T::DTYPE, op, nranks);
    let table: Vec<T> = (0..p)
        .map(|i| T::from_f64(value(T::DTYPE, op, nranks, rank, i)))
        .collect();
    tiled(&table, start, len)
}

/// Rank `rank`'s input of `len` elements.
pub fn input<T: Element>(op: Option<ReduceOp>, nranks: usize, rank: usize, len: usize) -> Vec<T> {
    input_from(op, nranks, rank, 0, len)
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
    let reduced_from = |start: usize| {
        let table: Vec<T> = (0..period(T::DTYPE, Some(op), nranks))
            .map(|i| reduced(op, nranks, i))
            .collect();
        tiled(&table, start, count)
    };
    let raw = |r: usize, start: usize| input_from::<T>(None, nranks, r, start, count);
    let every_rank = |start: usize| (0..nranks).flat_map(|r| raw(r, start)).collect();
    match c {
        Collective::AllReduce => Some(reduced_from(0)),
        Collective::Reduce { root } => (rank == root).then(|| reduced_from(0)),
        Collective::ReduceScatter => Some(reduced_from(rank * count)),
        Collective::Broadcast { root } => Some(raw(root, 0)),
        Collective::AllGather => Some(every_rank(0)),
        Collective::Gather { root } => (rank == root).then(|| every_rank(0)),
        Collective::Scatter { root } => Some(raw(root, rank * count)),
        Collective::AllToAll => Some(every_rank(rank * count)),
        Collective::Send { .. } | Collective::Recv { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serial reference element by element, straight from [`value`] and
    /// [`reduced`]: what [`input`] and [`expected`] must equal.
    fn expected_element_by_element<T: Element>(
        c: Collective,
        op: ReduceOp,
        count: usize,
        nranks: usize,
        rank: usize,
    ) -> Option<Vec<T>> {
        let raw = |r: usize, i: usize| T::from_f64(value(T::DTYPE, None, nranks, r, i));
        let every_rank = |at: &dyn Fn(usize, usize) -> T| -> Vec<T> {
            (0..nranks)
                .flat_map(|r| (0..count).map(move |i| (r, i)))
                .map(|(r, i)| at(r, i))
                .collect()
        };
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
            Collective::AllGather => Some(every_rank(&raw)),
            Collective::Gather { root } => (rank == root).then(|| every_rank(&raw)),
            Collective::Scatter { root } => {
                Some((0..count).map(|i| raw(root, rank * count + i)).collect())
            }
            Collective::AllToAll => Some(every_rank(&|r, i| raw(r, rank * count + i))),
            Collective::Send { .. } | Collective::Recv { .. } => None,
        }
    }

    fn check<T: Element>() {
        for nranks in 1..=9 {
            // Counts shorter than, equal to, and longer than every period (a prime).
            for count in [0usize, 1, 3, 8, 100, 251] {
                for op in std::iter::once(None).chain(ops().map(Some)) {
                    for rank in 0..nranks {
                        let want: Vec<T> = (0..count)
                            .map(|i| T::from_f64(value(T::DTYPE, op, nranks, rank, i)))
                            .collect();
                        assert_eq!(input::<T>(op, nranks, rank, count), want, "{op:?}");
                    }
                }
                for op in ops() {
                    let root = nranks / 2;
                    for c in [
                        Collective::AllReduce,
                        Collective::Reduce { root },
                        Collective::ReduceScatter,
                        Collective::Broadcast { root },
                        Collective::AllGather,
                        Collective::Gather { root },
                        Collective::Scatter { root },
                        Collective::AllToAll,
                    ] {
                        for rank in 0..nranks {
                            assert_eq!(
                                expected::<T>(c, op, count, nranks, rank),
                                expected_element_by_element::<T>(c, op, count, nranks, rank),
                                "{:?} {c} {op} {nranks} ranks, count {count}, rank {rank}",
                                T::DTYPE
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn repeated_periods_equal_the_data_element_by_element() {
        for dtype in DataType::ALL {
            crate::with_element_type!(dtype, T => check::<T>());
        }
    }
}
