//! Host reduction kernels for every [`DataType`] × [`ReduceOp`].
//!
//! A collective resolves its reduction once into a [`Kernel`] (data type, op with its
//! scalar converted to the element type, number of ranks) and then calls three
//! byte-level entry points on chunks of its buffers, mirroring NCCL's device functions:
//!
//! - [`Kernel::pre`] on a rank's own contribution when it is first sent unreduced
//!   (a copy, or `scalar * x` for pre-mul-sum);
//! - [`Kernel::reduce`] to fold this rank's contribution into a received partial
//!   (`a ⊕ pre(b)`);
//! - [`Kernel::post`] on the final result (division by the number of ranks for avg).
//!
//! The `(dtype, op)` pair is dispatched once per call to a loop monomorphised for it.
//! The loops are portable Rust that LLVM vectorises; on x86-64 the same loops also run
//! as AVX2 and AVX-512 builds, and `f16` uses the F16C conversion instructions, chosen
//! at run time from the CPU's features ([`vector_isa`]; `benches/reduce.rs` measures
//! each against memcpy). Every build computes the same bits: the arithmetic is
//! element-wise IEEE, with no fused multiply-add.
//!
//! # Semantics (NCCL's)
//!
//! - Integers: sum and product wrap (two's complement); avg sums with wrap-around and
//!   then divides truncating toward zero (`-7 / 3 == -2`), like NCCL's `FuncSumPostDiv`.
//! - `f32` / `f64`: native IEEE arithmetic. Max and min are IEEE maxNum / minNum
//!   (`f32::max`, like CUDA's `fmaxf` / `fminf`): a NaN loses to a number, and two NaNs
//!   give NaN.
//! - `f16`, `bf16`, `f8e4m3`, `f8e5m2`: each operation widens both operands to `f32`,
//!   operates, and rounds the result back once, to nearest even; the 8-bit floats
//!   saturate to their largest finite value (`__NV_SATFINITE`), so an `f8e5m2`
//!   infinity in a sum becomes ±57344. `f32` is wide enough that this equals the
//!   correctly rounded narrow operation (`__hadd`, `__hmul`, and NCCL's fp8-via-half
//!   path).
//! - Pre-mul-sum: `pre(x) = scalar * x`, rounded to the element type before it is added
//!   (NCCL applies the pre-op when a contribution is loaded).
//! - Avg: [`Kernel::reduce`] sums and [`Kernel::post`] divides by `nranks`: integers
//!   truncating; floats by a true division in `f32` (`f64` for `f64`), rounded once.
//!   NCCL instead multiplies by `1/nranks` rounded to the element type (in its post-op,
//!   or as a pre-mul-sum in older releases), so for `nranks` not a power of two results
//!   may differ from NCCL's in the last bit; ours is the correctly rounded quotient of
//!   the computed sum.

pub mod copy;
mod loops;
mod num;
pub mod stream;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::{Error, Result};
use crate::types::{DataType, Element, ReduceOp};

use self::num::Arith;

/// The vector instruction sets the host kernels choose from at run time, narrowest
/// first (on other architectures than x86-64 only `Portable` exists).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum VectorIsa {
    /// The baseline build of the loops (SSE2 on x86-64).
    Portable,
    /// AVX2 (with F16C conversions for `f16`): 256-bit vectors.
    Avx2,
    /// AVX-512 F, BW and VL: 512-bit vectors.
    Avx512,
}

impl VectorIsa {
    /// Every instruction set, narrowest first.
    pub const ALL: [VectorIsa; 3] = [VectorIsa::Portable, VectorIsa::Avx2, VectorIsa::Avx512];

    /// Its name (`portable`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            VectorIsa::Portable => "portable",
            VectorIsa::Avx2 => "avx2",
            VectorIsa::Avx512 => "avx512",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => VectorIsa::Portable,
            1 => VectorIsa::Avx2,
            _ => VectorIsa::Avx512,
        }
    }
}

/// The widest instruction set the kernels may use ([`limit_vector_isa`]).
static ISA_LIMIT: AtomicU8 = AtomicU8::new(VectorIsa::Avx512 as u8);

/// Caps the instruction set the kernels use, process-wide (to compare the builds, as
/// `benches/reduce.rs` does); the CPU's own limit still applies.
pub fn limit_vector_isa(isa: VectorIsa) {
    ISA_LIMIT.store(isa as u8, Ordering::Relaxed);
}

/// The widest instruction set this CPU supports for the kernels.
pub fn cpu_vector_isa() -> VectorIsa {
    static CPU: OnceLock<VectorIsa> = OnceLock::new();
    *CPU.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                return VectorIsa::Avx512;
            }
            if has!("avx2") {
                return VectorIsa::Avx2;
            }
        }
        VectorIsa::Portable
    })
}

/// The instruction set the kernels use now: the CPU's widest, within the limit.
pub fn vector_isa() -> VectorIsa {
    let limit = VectorIsa::from_u8(ISA_LIMIT.load(Ordering::Relaxed));
    #[cfg(test)]
    let limit = limit.min(tests::ISA_LIMIT.with(|l| l.get()));
    cpu_vector_isa().min(limit)
}

/// The reduction, without its scalar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    PreMulSum,
}

/// A reduction resolved for one collective: dtype, op (with its scalar converted to the
/// element type), and the number of ranks (for avg). Cheap to build, `Copy`.
///
/// ```
/// use ferroccl::reduce::{Kernel, reduce_slice};
/// use ferroccl::{DataType, ReduceOp};
///
/// let k = Kernel::new(DataType::Float32, ReduceOp::Sum, 2)?;
/// let mut out = [0.0f32; 3];
/// reduce_slice(&k, &mut out, &[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0])?;
/// assert_eq!(out, [11.0, 22.0, 33.0]);
/// # Ok::<(), ferroccl::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    dtype: DataType,
    op: Op,
    /// The pre-mul-sum scalar's bits in the element type (zero otherwise).
    scalar: u64,
    nranks: usize,
}

impl Kernel {
    /// Resolves `op` for `dtype` over `nranks` ranks.
    ///
    /// [`ReduceOp::PreMulSum`]'s scalar is converted to the element type: every
    /// [`Scalar`](crate::Scalar) variant is accepted for every type, converted with
    /// [`Element::from_f64`] for floats (rounding to nearest, saturating for the 8-bit
    /// floats) and with `as` casts for integers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `nranks` is 0.
    // Inlined: every host call makes two, and returned through memory the result cost
    // store-forwarding stalls (a tenth of a 1-rank 8-byte call, measured with perf).
    #[inline(always)]
    pub fn new(dtype: DataType, op: ReduceOp, nranks: usize) -> Result<Self> {
        if nranks == 0 {
            return Err(Self::no_ranks(dtype, op));
        }
        let (op, scalar) = match op {
            ReduceOp::Sum => (Op::Sum, 0),
            ReduceOp::Prod => (Op::Prod, 0),
            ReduceOp::Max => (Op::Max, 0),
            ReduceOp::Min => (Op::Min, 0),
            ReduceOp::Avg => (Op::Avg, 0),
            ReduceOp::PreMulSum(s) => (Op::PreMulSum, Self::scalar_raw(dtype, s)),
        };
        Ok(Kernel {
            dtype,
            op,
            scalar,
            nranks,
        })
    }

    #[cold]
    fn no_ranks(dtype: DataType, op: ReduceOp) -> Error {
        Error::invalid(format!(
            "reduction kernel for {op} on {dtype}: nranks must be at least 1, got 0"
        ))
    }

    /// A pre-mul-sum scalar in `dtype`'s bits.
    #[inline(never)]
    fn scalar_raw(dtype: DataType, s: crate::Scalar) -> u64 {
        crate::with_element_type!(dtype, T => T::from_scalar(s).to_raw())
    }

    /// The element type.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The op's number in the device kernels (`FCCL_OP_*` in `kernels/ferroccl.cuh`:
    /// sum 0, prod 1, max 2, min 3, avg 4, pre-mul-sum 5).
    pub fn device_op(&self) -> u32 {
        match self.op {
            Op::Sum => 0,
            Op::Prod => 1,
            Op::Max => 2,
            Op::Min => 3,
            Op::Avg => 4,
            Op::PreMulSum => 5,
        }
    }

    /// The pre-mul-sum scalar's bits in the element type, zero-extended (0 for other
    /// ops): what the device kernels take.
    pub fn scalar_bits(&self) -> u64 {
        self.scalar
    }

    /// The number of ranks (avg's divisor).
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Whether [`pre`](Self::pre) changes data: true only for pre-mul-sum (otherwise it
    /// is a plain copy, and a caller may skip it when source and destination coincide).
    pub fn has_pre(&self) -> bool {
        self.op == Op::PreMulSum
    }

    /// Whether [`post`](Self::post) changes data: true only for avg with
    /// `nranks > 1` (dividing by one is the identity for every type, so the pass is
    /// skipped for a single rank).
    pub fn has_post(&self) -> bool {
        self.op == Op::Avg && self.nranks > 1
    }

    /// `dst[i] = a[i] ⊕ pre(b[i])` for `i` in `0..count`, where `a` is an already-reduced
    /// partial (or another rank's contribution already pre-processed) and `b` is this
    /// rank's own contribution. `⊕` is sum for sum / avg / pre-mul-sum, product for
    /// prod, max, min. For pre-mul-sum `pre(b) = scalar * b` (rounded to the element
    /// type); avg only sums here and [`post`](Self::post) divides.
    ///
    /// # Safety
    /// `a` and `b` are valid for reads of `count` elements and `dst` for writes of
    /// `count` elements of [`dtype`](Self::dtype); `dst` may be exactly equal to `a` or to
    /// `b` (in place) but must not partially overlap either. No alignment requirement.
    pub unsafe fn reduce(&self, dst: *mut u8, a: *const u8, b: *const u8, count: usize) {
        let head = line_head(dst, self.dtype.size(), count);
        let at = head * self.dtype.size();
        // SAFETY (block): the caller's contract; the head (often empty) and the rest split
        // all three regions at the same element, so an in-place call stays in place.
        unsafe {
            if head > 0 {
                self.reduce_from(dst, a, b, head);
            }
            self.reduce_from(dst.add(at), a.add(at), b.add(at), count - head);
        }
    }

    /// [`reduce`](Self::reduce) as the kernels run it, wherever `dst` starts.
    ///
    /// # Safety
    /// As [`reduce`](Self::reduce).
    unsafe fn reduce_from(&self, dst: *mut u8, a: *const u8, b: *const u8, count: usize) {
        #[cfg(target_arch = "x86_64")]
        if self.dtype == DataType::Float16 && x86::has_f16c() {
            let s = self.scalar as u16;
            // SAFETY: F16C and AVX2 are present (checked); the rest is the caller's
            // contract, in f16 elements.
            unsafe { x86::reduce_f16(self.op, s, dst.cast(), a.cast(), b.cast(), count) };
            return;
        }
        crate::with_element_type!(self.dtype, T => {
            // SAFETY: the caller's contract, in elements of T (the dtype's type).
            unsafe { reduce_typed::<T>(self.op, self.scalar, dst.cast(), a.cast(), b.cast(), count) }
        })
    }

    /// `dst[i] = pre(src[i])`: a copy, or `scalar * src[i]` for pre-mul-sum.
    ///
    /// # Safety
    /// `src` is valid for reads and `dst` for writes of `count` elements; `dst` is either
    /// exactly `src` or does not overlap it. No alignment requirement.
    pub unsafe fn pre(&self, dst: *mut u8, src: *const u8, count: usize) {
        if self.op != Op::PreMulSum {
            if !ptr::eq(dst, src) {
                // SAFETY: both valid for count elements of the dtype and, being distinct,
                // non-overlapping (caller's contract).
                unsafe { copy::copy(dst, src, count * self.dtype.size()) }
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.dtype == DataType::Float16 && x86::has_f16c() {
            // SAFETY: F16C and AVX2 are present (checked); the rest is the caller's
            // contract, in f16 elements.
            unsafe { x86::scale_f16(self.scalar as u16, dst.cast(), src.cast(), count) };
            return;
        }
        crate::with_element_type!(self.dtype, T => {
            // SAFETY: the caller's contract, in elements of T.
            unsafe { scale_typed::<T>(T::from_raw(self.scalar), dst.cast(), src.cast(), count) }
        })
    }

    /// `buf[i] = post(buf[i])`: for avg, `buf[i] / nranks` (integers: truncating toward
    /// zero, as NCCL does; floats: a division computed in `f32` for `f16`, `bf16` and
    /// the 8-bit floats, in `f64` for `f64`, rounded back once); nothing for other ops
    /// or when `nranks` is 1 (see [`has_post`](Self::has_post)).
    ///
    /// # Safety
    /// `buf` is valid for reads and writes of `count` elements. No alignment requirement.
    pub unsafe fn post(&self, buf: *mut u8, count: usize) {
        if !self.has_post() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.dtype == DataType::Float16 && x86::has_f16c() {
            // SAFETY: F16C and AVX2 are present (checked); the rest is the caller's
            // contract, in f16 elements.
            unsafe { x86::post_f16(self.nranks, buf.cast(), count) };
            return;
        }
        crate::with_element_type!(self.dtype, T => {
            // SAFETY: the caller's contract, in elements of T.
            unsafe { post_typed::<T>(self.nranks, buf.cast(), count) }
        })
    }

    fn check<T: Element>(&self, what: &str) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::invalid(format!(
                "{what}: slices of {} given to a kernel for {}",
                T::DTYPE,
                self.dtype
            )));
        }
        Ok(())
    }
}

/// Reductions of at most this many elements run the portable loop (see [`reduce_typed`]).
const SCALAR_UP_TO: usize = 16;

/// A cache line: vector stores that start on one write one line, not parts of two.
pub(crate) const LINE: usize = 64;

/// Regions of at least this many bytes start their vector loop on a line of the
/// destination ([`line_head`]); shorter ones are not worth the second call.
const LINE_ALIGNED_FROM: usize = 4096;

/// How many of `count` elements of `elem` bytes to handle before `dst` reaches a line
/// boundary, so that the vector loop after them stores whole lines: 0 when `dst` is on
/// a line already, is not aligned to its elements (no element boundary falls on a
/// line), or the region is short. An unaligned 64-byte store spans two lines; measured
/// on an Intel Xeon host (2026-11-29, AVX-512, f32 sum of 128–256 KiB in the cache), a
/// destination 16 bytes past a line ran at 24 GB/s against 29 on a line, and a copy out
/// of a peer's FIFO slot into such a destination at 10.5–11.9 GB/s against 13.3–13.7.
#[inline]
pub(crate) fn line_head(dst: *const u8, elem: usize, count: usize) -> usize {
    let misplaced = dst as usize % LINE;
    if misplaced == 0 || !misplaced.is_multiple_of(elem) || count * elem < LINE_ALIGNED_FROM {
        return 0;
    }
    (LINE - misplaced) / elem
}

/// [`Kernel::reduce`] for one element type. One function per type keeps each small
/// enough for LLVM to inline and vectorise all its loops; on x86-64 it runs the AVX-512
/// or AVX2 build of the same loops when the CPU has them.
///
/// # Safety
/// As [`Kernel::reduce`], in elements of `T`.
#[inline(never)]
unsafe fn reduce_typed<T: Arith>(
    op: Op,
    scalar: u64,
    dst: *mut T,
    a: *const T,
    b: *const T,
    n: usize,
) {
    // A few elements (a small call's) take no vector loop: the dispatch would cost more
    // than the arithmetic. The same loop body, so the same results.
    #[cfg(target_arch = "x86_64")]
    if n > SCALAR_UP_TO {
        match vector_isa() {
            // SAFETY: the CPU has the instruction set (checked by `vector_isa`); the rest
            // is the caller's contract.
            VectorIsa::Avx512 => return unsafe { x86::reduce_avx512(op, scalar, dst, a, b, n) },
            // SAFETY: as above.
            VectorIsa::Avx2 => return unsafe { x86::reduce_avx2(op, scalar, dst, a, b, n) },
            VectorIsa::Portable => {}
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { reduce_body(op, scalar, dst, a, b, n) }
}

/// The loops of [`reduce_typed`], one per op.
///
/// # Safety
/// As [`Kernel::reduce`], in elements of `T`.
#[inline(always)]
unsafe fn reduce_body<T: Arith>(
    op: Op,
    scalar: u64,
    dst: *mut T,
    a: *const T,
    b: *const T,
    n: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match op {
            Op::Sum | Op::Avg => loops::zip(dst, a, b, n, num::Add),
            Op::Prod => loops::zip(dst, a, b, n, num::Mul),
            Op::Max => loops::zip(dst, a, b, n, num::Max),
            Op::Min => loops::zip(dst, a, b, n, num::Min),
            Op::PreMulSum => loops::zip(dst, a, b, n, num::PreMulSum(T::from_raw(scalar))),
        }
    }
}

/// `dst[i] = s * src[i]` for pre-mul-sum's [`Kernel::pre`].
///
/// # Safety
/// As [`Kernel::pre`], in elements of `T`.
#[inline(never)]
unsafe fn scale_typed<T: Arith>(s: T, dst: *mut T, src: *const T, n: usize) {
    #[cfg(target_arch = "x86_64")]
    match vector_isa() {
        // SAFETY: the CPU has the instruction set (checked by `vector_isa`); the rest
        // is the caller's contract.
        VectorIsa::Avx512 => return unsafe { x86::scale_avx512(s, dst, src, n) },
        // SAFETY: as above.
        VectorIsa::Avx2 => return unsafe { x86::scale_avx2(s, dst, src, n) },
        VectorIsa::Portable => {}
    }
    // SAFETY: forwarded from the caller.
    unsafe { scale_body(s, dst, src, n) }
}

/// The loop of [`scale_typed`].
///
/// # Safety
/// As [`Kernel::pre`], in elements of `T`.
#[inline(always)]
unsafe fn scale_body<T: Arith>(s: T, dst: *mut T, src: *const T, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { loops::map(dst, src, n, num::Scale(s)) }
}

/// `buf[i] /= nranks` for avg's [`Kernel::post`].
///
/// # Safety
/// As [`Kernel::post`], in elements of `T`.
#[inline(never)]
unsafe fn post_typed<T: Arith>(nranks: usize, buf: *mut T, n: usize) {
    #[cfg(target_arch = "x86_64")]
    match vector_isa() {
        // SAFETY: the CPU has the instruction set (checked by `vector_isa`); the rest
        // is the caller's contract.
        VectorIsa::Avx512 => return unsafe { x86::post_avx512(nranks, buf, n) },
        // SAFETY: as above.
        VectorIsa::Avx2 => return unsafe { x86::post_avx2(nranks, buf, n) },
        VectorIsa::Portable => {}
    }
    // SAFETY: forwarded from the caller.
    unsafe { T::div_all(buf, n, nranks) }
}

fn check_len(what: &str, dst: usize, name: &str, len: usize) -> Result<()> {
    if dst != len {
        return Err(Error::invalid(format!(
            "{what}: dst has {dst} elements but {name} has {len}"
        )));
    }
    Ok(())
}

/// [`Kernel::reduce`] on typed slices: `dst[i] = a[i] ⊕ pre(b[i])`.
///
/// # Errors
/// [`Error::InvalidArgument`] if the lengths differ or `T` is not the kernel's dtype.
pub fn reduce_slice<T: Element>(k: &Kernel, dst: &mut [T], a: &[T], b: &[T]) -> Result<()> {
    k.check::<T>("reduce_slice")?;
    check_len("reduce_slice", dst.len(), "a", a.len())?;
    check_len("reduce_slice", dst.len(), "b", b.len())?;
    // SAFETY: T is the kernel's dtype (Element is sealed, so T's layout is that dtype's),
    // all three slices hold dst.len() elements, and the borrow rules keep dst from
    // overlapping a or b.
    unsafe {
        k.reduce(
            dst.as_mut_ptr().cast(),
            a.as_ptr().cast(),
            b.as_ptr().cast(),
            dst.len(),
        )
    };
    Ok(())
}

/// [`Kernel::pre`] on typed slices: `dst[i] = pre(src[i])`.
///
/// # Errors
/// [`Error::InvalidArgument`] if the lengths differ or `T` is not the kernel's dtype.
pub fn pre_slice<T: Element>(k: &Kernel, dst: &mut [T], src: &[T]) -> Result<()> {
    k.check::<T>("pre_slice")?;
    check_len("pre_slice", dst.len(), "src", src.len())?;
    // SAFETY: as in reduce_slice; dst and src cannot overlap.
    unsafe { k.pre(dst.as_mut_ptr().cast(), src.as_ptr().cast(), dst.len()) };
    Ok(())
}

/// [`Kernel::post`] on a typed slice, in place.
///
/// # Errors
/// [`Error::InvalidArgument`] if `T` is not the kernel's dtype.
pub fn post_slice<T: Element>(k: &Kernel, buf: &mut [T]) -> Result<()> {
    k.check::<T>("post_slice")?;
    // SAFETY: T is the kernel's dtype and buf holds buf.len() elements.
    unsafe { k.post(buf.as_mut_ptr().cast(), buf.len()) };
    Ok(())
}
