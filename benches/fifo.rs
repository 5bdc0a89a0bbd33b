//! The FIFOs' hand-off alone: `cargo bench --bench fifo`.
//!
//! Two threads, pinned to CPUs 0 and 1 where there are two, exchange a message per round
//! through a pair of LL FIFOs in `/dev/shm` (the transport under a 2-rank 8-byte
//! all-reduce): each writes its message, publishes it, waits for the peer's, adds it to
//! its own and hands the slot back. Nothing else of a call runs (no plan, engine or
//! communicator), so the time of a round against `ferroccl-limits`' cache-line floor is
//! what the transport costs, and the rest of an `all_reduce_perf -b 8` call is software
//! (measured 2026-11-27 on the project's 2-core VM: 0.069–0.086 µs a round, 1.5–1.7
//! floors, against 0.31–0.35 µs for the whole call).
//!
//! The same two threads also exchange 256 KiB each way per round through a pair of
//! Simple FIFOs of the default shape (8 × 128 KiB): each copies its message into two
//! slots, then the peer's two slots out. That is what the FIFOs cost a large message
//! whatever the engine does: a 2-rank ring all-reduce of 512 KiB makes two such
//! exchanges. Measured 2026-11-29 on an Intel Xeon host (vCPUs 0.15–0.2 µs apart):
//! 37.4–39.5 µs a round, as a C model of the loop with the two sides in two processes
//! (36–40 µs: copies into slots at 14–17 GB/s, out of them at 13–15), where Intel MPI's
//! whole 512 KiB all-reduce took 75–80 µs and ferroccl's 80–87. The second group does
//! the same with the two FIFOs exchanging slots (`fifo::exchange_slots`, what the
//! transport does between ranks of one host): each side copies into the memory it has
//! just drained. Measured 2026-11-30 on an Intel Xeon host: 37.4–40.1 µs a round with
//! the slots kept, 27.3–30.6 exchanged.

use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ferroccl::plan::Protocol;
use ferroccl::reduce::copy;
use ferroccl::transport::fifo::{Geometry, RecvEnd, SendEnd, exchange_slots, recv_end, send_end};
use ferroccl::transport::segment::{Segment, SegmentKind};

/// The sending end into, and the receiving end out of, a new FIFO of shape `g` in
/// `/dev/shm`.
fn fifo(tag: &str, g: Geometry) -> (SendEnd, RecvEnd) {
    let name = format!("ferroccl-bench-fifo-{tag}-{}", std::process::id());
    let seg = Segment::create(SegmentKind::Shm, &name, g.segment_bytes()).unwrap();
    let rx = recv_end(seg, g).unwrap();
    let seg = Segment::open(SegmentKind::Shm, &name, g.segment_bytes()).unwrap();
    let tx = send_end(seg, g, &name).unwrap();
    Segment::unlink(SegmentKind::Shm, &name);
    (tx, rx)
}

/// Pins this thread to the `i`-th CPU this process could use when it started (a round
/// between two threads on one CPU measures the scheduler, not the hand-off); nothing
/// where there is no such CPU. The list is read once: a thread started after the main
/// thread pinned itself inherits that one CPU.
fn pin(i: usize) {
    static CPUS: OnceLock<Vec<usize>> = OnceLock::new();
    let cpus = CPUS.get_or_init(|| ferroccl::topo::available_cpus().unwrap_or_default());
    if let Some(&cpu) = cpus.get(i) {
        ferroccl::topo::pin_thread_to(cpu).unwrap();
    }
}

/// `rounds` exchanges of `N` f32 on one side; returns the sum of the last one.
fn exchange<const N: usize>(tx: &mut SendEnd, rx: &mut RecvEnd, own: f32, rounds: u64) -> f32 {
    let mine = [own; N];
    let mut sum = [0f32; N];
    let bytes = N * 4;
    for _ in 0..rounds {
        let slot = loop {
            if let Some(p) = tx.try_reserve(bytes) {
                break p;
            }
            std::hint::spin_loop();
        };
        // SAFETY: the reserved slot holds `bytes` (less than its payload) until commit.
        unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr().cast::<u8>(), slot, bytes) };
        tx.commit(bytes);
        let (msg, len) = loop {
            if let Some(m) = rx.try_peek() {
                break m;
            }
            std::hint::spin_loop();
        };
        assert_eq!(len, bytes);
        // SAFETY: the peeked slot holds `len` bytes and is this side's until release.
        let theirs: [f32; N] = unsafe { std::ptr::read_unaligned(msg.cast()) };
        for i in 0..N {
            sum[i] = mine[i] + theirs[i];
        }
        rx.release();
    }
    std::hint::black_box(sum)[0]
}

/// Times rounds on two threads pinned to the first two CPUs, each holding the sending
/// end into its peer's FIFO of shape `g` and the receiving end out of its own: `side0`
/// runs the rounds criterion times, `side1` as many on the other thread. Each side's
/// function runs `rounds` rounds and checks what it received.
fn on_two_threads(
    c: &mut Criterion,
    group: &str,
    id: BenchmarkId,
    g: Geometry,
    exchange: bool,
    mut side0: impl FnMut(&mut SendEnd, &mut RecvEnd, u64),
    mut side1: impl FnMut(&mut SendEnd, &mut RecvEnd, u64) + Send,
) {
    let (mut tx01, mut rx01) = fifo(&format!("{group}-01"), g);
    let (mut tx10, mut rx10) = fifo(&format!("{group}-10"), g);
    if exchange {
        // Rank 0 is the lower of the two.
        exchange_slots(&mut tx01, &mut rx10, true).unwrap();
        exchange_slots(&mut tx10, &mut rx01, false).unwrap();
    }
    let mut group = c.benchmark_group(group);
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    std::thread::scope(|s| {
        let (rounds_tx, rounds_rx) = mpsc::channel::<u64>();
        s.spawn(move || {
            pin(1);
            for rounds in rounds_rx {
                side1(&mut tx10, &mut rx01, rounds);
            }
        });
        pin(0);
        group.bench_function(id, |b| {
            b.iter_custom(|rounds| {
                rounds_tx.send(rounds).unwrap();
                let start = Instant::now();
                side0(&mut tx01, &mut rx10, rounds);
                start.elapsed()
            })
        });
        drop(rounds_tx);
    });
    group.finish();
}

fn ll_exchange(c: &mut Criterion) {
    // Each side sums 1 + 2 = 3 in every element.
    let side = |own: f32| {
        move |tx: &mut SendEnd, rx: &mut RecvEnd, rounds| {
            let last = exchange::<2>(tx, rx, own, rounds);
            assert!(rounds == 0 || last == 3.0, "side {own} summed {last}");
        }
    };
    on_two_threads(
        c,
        "ll_fifo_exchange_2_threads",
        BenchmarkId::new("f32", 8),
        Geometry::ll(8, 16 << 10),
        false,
        side(1.0),
        side(2.0),
    );
}

/// Bytes each side sends per round of [`simple_exchange`]: two slots.
const BULK: usize = 256 << 10;

/// `rounds` exchanges of `mine` (slot-sized pieces copied into the FIFO, all of them,
/// then the peer's pieces copied out into `theirs`).
fn bulk_exchange(tx: &mut SendEnd, rx: &mut RecvEnd, mine: &[u8], theirs: &mut [u8], rounds: u64) {
    let piece = tx.payload();
    for _ in 0..rounds {
        for chunk in mine.chunks(piece) {
            let slot = loop {
                if let Some(p) = tx.try_reserve(chunk.len()) {
                    break p;
                }
                std::hint::spin_loop();
            };
            // SAFETY: the reserved slot holds a payload of `piece` ≥ chunk.len() bytes.
            unsafe { copy::copy(slot, chunk.as_ptr(), chunk.len()) };
            tx.commit(chunk.len());
        }
        for chunk in theirs.chunks_mut(piece) {
            let (msg, len) = loop {
                if let Some(m) = rx.try_peek() {
                    break m;
                }
                std::hint::spin_loop();
            };
            assert_eq!(len, chunk.len());
            // SAFETY: the peeked slot holds `len` bytes and is this side's until release.
            unsafe { copy::copy(chunk.as_mut_ptr(), msg, len) };
            rx.release();
        }
    }
}

fn simple_exchange(c: &mut Criterion) {
    // Side 0 sends ones and side 1 twos, from buffers each side keeps for every round.
    let side = |own: u8| {
        let (mine, mut theirs) = (vec![own; BULK], vec![0u8; BULK]);
        move |tx: &mut SendEnd, rx: &mut RecvEnd, rounds| {
            bulk_exchange(tx, rx, &mine, &mut theirs, rounds);
            let want = 3 - own;
            assert!(
                rounds == 0 || theirs.iter().all(|&b| b == want),
                "side {own}"
            );
        }
    };
    let g = Geometry {
        slots: 8,
        slot_bytes: 128 << 10,
        protocol: Protocol::Simple,
    };
    for (group, exchange) in [
        ("simple_fifo_exchange_2_threads", false),
        ("simple_fifo_exchange_2_threads_slots_exchanged", true),
    ] {
        on_two_threads(
            c,
            group,
            BenchmarkId::new("bytes_each_way", BULK),
            g,
            exchange,
            side(1),
            side(2),
        );
    }
}

criterion_group!(benches, ll_exchange, simple_exchange);
criterion_main!(benches);
