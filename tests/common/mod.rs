//! Shared by the collective tests: integer-valued inputs whose reductions are exact in
//! every data type whatever the order of operations (as nccl-tests does), and a serial
//! reference for every collective.

#![allow(dead_code)]

use ferroccl::plan::Collective;
use ferroccl::{Communicator, DataType, Element, ReduceOp, Scalar};

/// Every reduction op the tests use (pre-mul-sum with scalar 2).
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

/// Runs `c` on `comm` with typed buffers (in place or not) and checks the output
/// against the reference. Returns a description of the first wrong element, if any.
pub fn run_and_check<T: Element + Default>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    let (n, rank) = (comm.size(), comm.rank());
    let data_op = c.is_reducing().then_some(op);
    let (in_len, out_len) = c.buffer_lens(count, rank, n);
    // Inputs: reductions use the op's data; movement collectives use raw data, laid out
    // so that rank r's element i is value(r, i).
    let mine: Vec<T> = input(data_op, n, rank, in_len.max(count * n));
    let fail = |e: ferroccl::Error| format!("{c} {op} count {count} in_place {in_place}: {e}");
    let got: Vec<T> = if in_place {
        match (
            c.input_in_output(count, rank),
            c.output_in_input(count, rank),
        ) {
            (_, Some(at)) => {
                let mut buf = mine[..in_len].to_vec();
                call_in_place(comm, c, op, &mut buf).map_err(fail)?;
                buf[at..at + out_len].to_vec()
            }
            (Some(at), _) => {
                let mut buf = vec![T::default(); out_len.max(at + in_len)];
                buf[at..at + in_len].copy_from_slice(&mine[..in_len]);
                call_in_place(comm, c, op, &mut buf).map_err(fail)?;
                buf[..out_len].to_vec()
            }
            (None, None) => {
                let mut buf = mine[..in_len.max(out_len)].to_vec();
                call_in_place(comm, c, op, &mut buf).map_err(fail)?;
                buf[..out_len].to_vec()
            }
        }
    } else {
        let send = &mine[..in_len];
        let mut recv = vec![T::default(); out_len];
        call(comm, c, op, send, &mut recv).map_err(fail)?;
        recv
    };
    if let Some(want) = expected::<T>(c, op, count, n, rank) {
        if got.len() != want.len() {
            return Err(format!(
                "{c} {op}: output of {} elements, want {}",
                got.len(),
                want.len()
            ));
        }
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            return Err(format!(
                "{c} {} {op} count {count} in_place {in_place} rank {rank}/{n}: element {i} is \
                 {:?}, want {:?}",
                T::DTYPE,
                got[i],
                want[i]
            ));
        }
    }
    Ok(())
}

fn call<T: Element>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    send: &[T],
    recv: &mut [T],
) -> ferroccl::Result<()> {
    match c {
        Collective::AllReduce => comm.all_reduce(send, recv, op),
        Collective::Broadcast { root } => comm.broadcast(send, recv, root),
        Collective::Reduce { root } => comm.reduce(send, recv, op, root),
        Collective::AllGather => comm.all_gather(send, recv),
        Collective::ReduceScatter => comm.reduce_scatter(send, recv, op),
        Collective::AllToAll => comm.all_to_all(send, recv),
        Collective::Gather { root } => comm.gather(send, recv, root),
        Collective::Scatter { root } => comm.scatter(send, recv, root),
        Collective::Send { peer } => comm.send(send, peer),
        Collective::Recv { peer } => comm.recv(recv, peer),
    }
}

fn call_in_place<T: Element>(
    comm: &Communicator,
    c: Collective,
    op: ReduceOp,
    buf: &mut [T],
) -> ferroccl::Result<()> {
    match c {
        Collective::AllReduce => comm.all_reduce_in_place(buf, op),
        Collective::Broadcast { root } => comm.broadcast_in_place(buf, root),
        Collective::Reduce { root } => comm.reduce_in_place(buf, op, root),
        Collective::AllGather => comm.all_gather_in_place(buf),
        Collective::ReduceScatter => comm.reduce_scatter_in_place(buf, op),
        Collective::Gather { .. } | Collective::Scatter { .. } => {
            // In place as NCCL defines it: the root's buffer holds both sides.
            let (n, rank) = (comm.size(), comm.rank());
            let count = match c {
                Collective::Gather { root } if rank == root => buf.len() / n,
                Collective::Scatter { root } if rank == root => buf.len() / n,
                _ => buf.len(),
            };
            let base = buf.as_mut_ptr() as *mut u8;
            let elem = std::mem::size_of::<T>();
            let (input, output) = match (
                c.input_in_output(count, rank),
                c.output_in_input(count, rank),
            ) {
                (Some(at), _) => (base.wrapping_add(at * elem) as *const u8, base),
                (_, Some(at)) => (base as *const u8, base.wrapping_add(at * elem)),
                _ => (base as *const u8, base),
            };
            // SAFETY: `buf` holds the whole in-place layout for this rank (the caller
            // sized it from `buffer_lens`), borrowed mutably for the call.
            unsafe { comm.collective_raw(c, count, T::DTYPE, ReduceOp::Sum, input, output) }
        }
        Collective::AllToAll | Collective::Send { .. } | Collective::Recv { .. } => {
            unreachable!("no in-place form")
        }
    }
}

/// Every collective with every root of `n` ranks.
pub fn collectives(n: usize) -> Vec<Collective> {
    let mut all = vec![
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
    ];
    for root in 0..n {
        all.extend([
            Collective::Broadcast { root },
            Collective::Reduce { root },
            Collective::Gather { root },
            Collective::Scatter { root },
        ]);
    }
    all
}
