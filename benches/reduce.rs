//! Host reduction kernel throughput: `dst = a ⊕ b` for several element types, with each
//! build of the loops the CPU can run (AVX-512, AVX2, portable), next to a plain copy of
//! the same number of bytes.
//!
//! Throughput is reported per byte of `dst` (one operand), so a memory-bound reduction
//! moves three times that (two reads, one write) and a copy twice that. Sizes: 4 MiB
//! per operand (the three buffers fit in a large L3) and 64 MiB (DRAM-bound).
//!
//! `cargo bench --bench reduce`

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main,
};
use ferroccl::reduce::{Kernel, VectorIsa, copy, cpu_vector_isa, limit_vector_isa};
use ferroccl::{Element, F8E4M3, ReduceOp};
use half::{bf16, f16};

const SIZES: [(usize, &str); 2] = [(4 << 20, "4MiB"), (64 << 20, "64MiB")];

/// Benchmarks `dst = a + b` for `T`, out of place and (when `in_place`) `a += b`, with
/// the kernels limited to `isa`.
fn bench_sum<T: Element>(c: &mut Criterion, name: &str, in_place: bool, isa: VectorIsa) {
    limit_vector_isa(isa);
    let name = &format!("{name}_{}", isa.name());
    let mut group = c.benchmark_group("reduce");
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    for (bytes, label) in SIZES {
        let n = bytes / size_of::<T>();
        let a: Vec<T> = (0..n).map(|i| T::from_f64((i % 13) as f64)).collect();
        let b: Vec<T> = (0..n).map(|i| T::from_f64((i % 7) as f64)).collect();
        let mut dst = a.clone();
        let k = Kernel::new(T::DTYPE, ReduceOp::Sum, 2).unwrap();
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(BenchmarkId::new(format!("{name}_sum"), label), |bench| {
            bench.iter(|| {
                // SAFETY: all three buffers hold n elements of T::DTYPE and are distinct.
                unsafe {
                    k.reduce(
                        dst.as_mut_ptr().cast(),
                        a.as_ptr().cast(),
                        b.as_ptr().cast(),
                        black_box(n),
                    )
                }
                black_box(&mut dst);
            })
        });
        if in_place {
            group.bench_function(
                BenchmarkId::new(format!("{name}_sum_inplace"), label),
                |bench| {
                    bench.iter(|| {
                        let p = dst.as_mut_ptr().cast::<u8>();
                        // SAFETY: dst and b hold n elements of T::DTYPE; dst == a (in place).
                        unsafe { k.reduce(p, p, b.as_ptr().cast(), black_box(n)) }
                        black_box(&mut dst);
                    })
                },
            );
        }
    }
    group.finish();
}

fn bench_copy(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce");
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    for (bytes, label) in SIZES {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(BenchmarkId::new("memcpy", label), |bench| {
            bench.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            })
        });
    }
    group.finish();
}

/// A group of short runs (10 samples of a second) over `bytes` bytes each: for work
/// that stays in the cache.
fn short_group<'a>(c: &'a mut Criterion, name: &str, bytes: usize) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(300));
    group.measurement_time(Duration::from_secs(1));
    group.throughput(Throughput::Bytes(bytes as u64));
    group
}

/// A slice copied from a page-aligned slot into a buffer at `distance` bytes past a page
/// (`malloc`'s large blocks start 16 bytes in): `memcpy` against [`copy::copy`], which
/// avoids `rep movsb` at distances of 1–63 bytes (`ferroccl::reduce::copy`).
fn bench_slot_copy(c: &mut Criterion) {
    const SLICE: usize = 16 << 10;
    let mut group = short_group(c, "slot_copy", SLICE);
    let mut slot = vec![0u8; SLICE + 4096];
    let mut out = vec![0u8; SLICE + 8192];
    let s = slot
        .as_mut_ptr()
        .wrapping_add(slot.as_ptr().align_offset(4096));
    let page = out
        .as_mut_ptr()
        .wrapping_add(out.as_ptr().align_offset(4096));
    for distance in [0usize, 16, 64] {
        let d = page.wrapping_add(distance);
        let label = format!("16KiB_distance_{distance}");
        group.bench_function(BenchmarkId::new("memcpy", &label), |bench| {
            // SAFETY: `s` and `d` hold SLICE bytes inside their own buffers.
            bench.iter(|| unsafe { std::ptr::copy_nonoverlapping(s, black_box(d), SLICE) })
        });
        group.bench_function(BenchmarkId::new("copy", &label), |bench| {
            // SAFETY: as above.
            bench.iter(|| unsafe { copy::copy(black_box(d), s, SLICE) })
        });
    }
    group.finish();
}

/// `dst = a + b` (f32, 256 KiB per operand: in the cache) with all three buffers on a
/// cache line or all 16 bytes past one (where `malloc`'s large blocks start): the
/// kernel starts its vector loop on a line of the destination (`reduce::line_head`),
/// so the two run alike (2026-11-29, Intel Xeon host: 26.0 and 27.4 GiB/s); before it
/// did, a C model of the loop lost 18 % to the split stores (24 against 29 GB/s).
fn bench_line_offset(c: &mut Criterion) {
    const BYTES: usize = 256 << 10;
    let mut group = short_group(c, "reduce_line_offset", BYTES);
    let k = Kernel::new(ferroccl::DataType::Float32, ReduceOp::Sum, 2).unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; BYTES + 128]).collect();
    let lines: Vec<*mut u8> = bufs
        .iter_mut()
        .map(|b| b.as_mut_ptr().wrapping_add(b.as_ptr().align_offset(64)))
        .collect();
    for offset in [0usize, 16] {
        let [d, a, b] = [0, 1, 2].map(|i| lines[i].wrapping_add(offset));
        group.bench_function(BenchmarkId::new("f32_sum_256KiB", offset), |bench| {
            // SAFETY: each pointer has BYTES bytes (a whole number of f32) inside its own
            // buffer (128 bytes of slack); the three are distinct.
            bench.iter(|| unsafe { k.reduce(black_box(d), a, b, BYTES / 4) })
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    bench_copy(c);
    bench_slot_copy(c);
    bench_line_offset(c);
    for isa in VectorIsa::ALL.into_iter().rev() {
        if isa > cpu_vector_isa() {
            continue;
        }
        bench_sum::<f32>(c, "f32", true, isa);
        bench_sum::<f64>(c, "f64", false, isa);
        bench_sum::<bf16>(c, "bf16", false, isa);
        bench_sum::<f16>(c, "f16", false, isa);
        bench_sum::<i32>(c, "i32", false, isa);
        bench_sum::<F8E4M3>(c, "f8e4m3", false, isa);
    }
    limit_vector_isa(VectorIsa::Avx512);
}

criterion_group!(reduce, benches);
criterion_main!(reduce);
