//! Stores past the caches, for results far larger than them.
//!
//! A plain store to memory that is not in the cache first reads the line it writes
//! (write-allocate), so writing a large result costs a read and a write of every byte.
//! Non-temporal stores skip that read and the cache: measured on the project's 2-core
//! VM, copying 128 MiB out of a cached 128 KiB piece at a time ran at 14.7 GB/s with
//! `memcpy`'s stores and 22.0 GB/s with streaming ones, and `dst = a + b` (f32, `a`
//! from memory, `b` cached) at 9.5 against 13.5 GB/s. glibc's `memcpy` streams by
//! itself only above about three quarters of the last-level cache, per call; the
//! engine's slices are far smaller, so it asks for streaming per operation
//! ([`crate::engine::OpBuffers::streaming`]).
//!
//! A reduction to one destination whose lines start on elements streams each line
//! straight from the registers it is reduced in (with the post-operation, so the result
//! is never read back). Otherwise (two streamed destinations at different offsets in a
//! line, elements across lines) it streams through a small tile: it reduces a tile's
//! worth into a buffer that stays in the L1 cache, then streams the tile out, whole
//! cache lines with the widest stores the CPU has. Streaming stores are weakly ordered:
//! every function here ends with one store fence, so a flag published afterwards (a
//! FIFO's `head`, a descriptor's release) is seen after the data.
//!
//! How the lines are written decides the speed. Measured (2026-11-29, the project's VM,
//! AMD EPYC Zen 4; two pinned threads running the 2-rank ring of 32 MiB through 16
//! slots of 128 KiB, results and slots streamed, the vCPUs far apart; a C model of
//! the engine's copies, ms per call): the reduction streamed to both destinations
//! straight from the registers 2.59–2.64; through a tile with 64-byte stores, a tile of
//! 256 B–1 KiB 2.69–2.75, 4 KiB 3.04, 8 KiB 3.89; 16-byte stores from a 512 B tile
//! 3.52–3.67, from an 8 KiB one 5.28; a fence after every tile, 7.3. The engine had 8
//! KiB tiles, 16-byte stores and a fence per tile and destination: 2 ranks reached
//! 7.3–8.7 GB/s at 32 MiB where the model of the same copies reached 12.6–13.
//!
//! Each destination is streamed in whole lines of its own. When the tiles ended on the
//! output's lines, a page-aligned slot beside an output that starts 16 bytes into a
//! line (any `malloc`ed buffer) got a partial line in plain stores at each end of every
//! tile, lines that crawl to a far peer: 2 ranks far, 8 / 32 / 128 MiB, 6.9–7.4 /
//! 6.3–7.1 / 6.1–6.2 GB/s then, 12.0–12.4 / 8.5–8.6 / 7.7–7.9 with whole lines.

use super::{Kernel, LINE};

/// Bytes of the tile a streaming reduction computes in: small enough that the tile,
/// the lines it is computed from and the write-combining buffers share the L1 without
/// evicting each other (above), large enough that a tile's dispatch to the reduction
/// kernel is a small part of its time.
const TILE_BYTES: usize = 1024;

/// A tile after the line carried from the tile before it, aligned for the widest
/// vector stores.
#[repr(C, align(64))]
struct Tile([u8; LINE + TILE_BYTES]);

/// Most destinations a reduction streams to: an output and a slot, or an output and
/// the outputs of up to seven peers (the two-shot all-reduce writing its piece back,
/// [`crate::transport::single_copy`]).
pub const MAX_STREAMED: usize = 8;

/// Copies `bytes` bytes from `src` to `dst` with streaming stores, whole cache lines
/// only (the partial lines at either end with plain ones: a write-combining buffer
/// flushed half full costs a partial write, and an LL slot's header shares its first
/// line with the message), then fences.
///
/// # Safety
/// `src` readable and `dst` writable for `bytes` bytes, not overlapping.
pub unsafe fn stream_copy(dst: *mut u8, src: *const u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        stream_unfenced(dst, None, src, bytes);
        fence();
    }
}

/// [`stream_copy`] that also stores the bytes at `cached` with plain stores, in the same
/// pass over `src`: a received slice bound both for a large output (streamed) and for
/// the next peer's slot (kept in the cache), as a ring's all-gather forwards it. Two
/// passes (stream to the output, then copy to the slot) cost a model of the 4-rank ring
/// on 2 cores 4 % at 128 MiB (2026-11-30).
///
/// # Safety
/// `src` readable and `dst`, `cached` writable for `bytes` bytes, no two overlapping.
pub unsafe fn stream_copy_keeping(dst: *mut u8, cached: *mut u8, src: *const u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        stream_unfenced(dst, Some(cached), src, bytes);
        fence();
    }
}

/// [`stream_copy`] without the fence: the caller fences before it publishes the bytes.
/// When `cached` is given the bytes go there too, with plain stores.
///
/// # Safety
/// As [`stream_copy`]; `cached`, if given, writable for `bytes` bytes and apart from both.
#[inline]
unsafe fn stream_unfenced(dst: *mut u8, cached: Option<*mut u8>, src: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // Plain stores up to the first line boundary of `dst` and after the last.
        let head = dst.align_offset(LINE).min(bytes);
        let lines = (bytes - head) / LINE * LINE;
        let done = head + lines;
        // SAFETY (block): all within the caller's `bytes`; the streamed range starts on
        // a line of `dst` and is whole lines long.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let kept = cached.map(|c| c.add(head));
            x86::stream_lines(dst.add(head), kept, src.add(head), lines);
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), bytes - done);
            if let Some(cached) = cached {
                std::ptr::copy_nonoverlapping(src, cached, head);
                std::ptr::copy_nonoverlapping(src.add(done), cached.add(done), bytes - done);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, bytes);
        if let Some(cached) = cached {
            std::ptr::copy_nonoverlapping(src, cached, bytes);
        }
    };
}

/// Orders the streaming stores before every later store.
#[inline]
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

impl Kernel {
    /// [`reduce`](Kernel::reduce), then [`post`](Kernel::post) when `post`, with the
    /// result streamed past the caches to every one of `dsts` (see the module
    /// documentation) and, when `cached` is given, stored there with plain stores too:
    /// a result bound for both an output and a peer's slot is computed once. Measured
    /// in the C model of the module documentation, the vCPUs near and the slots cached,
    /// 128 MiB: 12.2–12.4 ms computed once, 13.2–13.3 ms reduced into the slot and
    /// streamed from it to the output in a second pass.
    ///
    /// # Safety
    /// As [`Kernel::reduce`], for each of `dsts` and `cached`; no two of them overlap.
    pub unsafe fn reduce_streaming(
        &self,
        dsts: &[*mut u8],
        cached: Option<*mut u8>,
        a: *const u8,
        b: *const u8,
        count: usize,
        post: bool,
    ) {
        assert!(
            dsts.len() <= MAX_STREAMED,
            "at most {MAX_STREAMED} streamed destinations"
        );
        #[cfg(target_arch = "x86_64")]
        if self.streams_from_registers(dsts) {
            // SAFETY: the caller's contract.
            unsafe { self.reduce_streaming_lines(dsts, cached, a, b, count, post) };
            fence();
            return;
        }
        let elem = self.dtype().size();
        let per_tile = TILE_BYTES / elem;
        // Each destination is streamed in whole lines of its own (destinations need not
        // share a line offset with each other or with the tile): what a tile leaves of
        // a destination's line waits for the next tile, which finds the tile's last line
        // carried in front of it.
        let mut buf = Tile([0; LINE + TILE_BYTES]);
        let carry = buf.0.as_mut_ptr();
        // SAFETY: the buffer holds LINE + TILE_BYTES bytes.
        let t = unsafe { carry.add(LINE) };
        let mut written = [0usize; MAX_STREAMED];
        let mut done = 0;
        while done < count {
            let n = per_tile.min(count - done);
            let (at, end) = (done * elem, (done + n) * elem);
            let last = done + n == count;
            // SAFETY (block): the tile holds `n` elements; `a`, `b`, each of `dsts` and
            // `cached` hold `count` (the caller's contract), and the buffer overlaps none
            // of them. A destination is written only up to what has been read of `a`
            // and `b`, so it may equal either. What is left of a destination's line
            // (`at - written[k]` < LINE bytes) is the carried line's end; a tile before
            // the last is full, at least a line.
            unsafe {
                self.reduce(t, a.add(at), b.add(at), n);
                if post {
                    self.post(t, n);
                }
                for (k, &dst) in dsts.iter().enumerate() {
                    let upto = match last {
                        true => end,
                        false => (dst.add(end) as usize & !(LINE - 1)) - dst as usize,
                    };
                    let from = t.sub(at - written[k]);
                    stream_unfenced(dst.add(written[k]), None, from, upto - written[k]);
                    written[k] = upto;
                }
                if let Some(dst) = cached {
                    std::ptr::copy_nonoverlapping(t, dst.add(at), n * elem);
                }
                if !last {
                    std::ptr::copy_nonoverlapping(t.add(end - at - LINE), carry, LINE);
                }
            }
            done += n;
        }
        fence();
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel {
    /// Whether a reduction streamed to `dsts` can stream each result line straight
    /// from the registers it was computed in ([`reduce_streaming_lines`]): when all of
    /// them start at one offset in their lines, element boundaries fall on their lines,
    /// and not for `f16` where the CPU converts it in hardware (its own kernel,
    /// [`super::x86::reduce_f16`]).
    ///
    /// [`reduce_streaming_lines`]: Kernel::reduce_streaming_lines
    fn streams_from_registers(&self, dsts: &[*mut u8]) -> bool {
        let f16c = self.dtype() == crate::DataType::Float16 && super::x86::has_f16c();
        let Some(&first) = dsts.first() else {
            return false;
        };
        let phase = first as usize % LINE;
        phase.is_multiple_of(self.dtype().size())
            && !f16c
            && dsts.iter().all(|&d| d as usize % LINE == phase)
    }

    /// [`reduce_streaming`](Kernel::reduce_streaming) to destinations at one offset in
    /// their lines, where lines start on elements: the elements before their first line
    /// and after their last whole one reduced with plain stores (at the first, copied to
    /// the others), each whole line in between reduced into registers and streamed from
    /// them to every destination (and stored at `cached` too), with no tile between. Not
    /// fenced. Measured in a C model of the 4-rank ring on 2 cores (2026-11-30, Intel
    /// Xeon, 128 MiB): reducing the step that streams its result into a 1 KiB tile first
    /// cost 3–6 % of the call, a 4 KiB one 6–7 %.
    ///
    /// # Safety
    /// As [`reduce_streaming`](Kernel::reduce_streaming); `dsts` not empty, all at one
    /// offset in a line, a multiple of the element size.
    unsafe fn reduce_streaming_lines(
        &self,
        dsts: &[*mut u8],
        cached: Option<*mut u8>,
        a: *const u8,
        b: *const u8,
        count: usize,
        post: bool,
    ) {
        let elem = self.dtype().size();
        let (dst, also) = dsts.split_first().expect("a destination");
        let dst = *dst;
        let head = (dst.align_offset(LINE) / elem).min(count);
        let lines = (count - head) * elem / LINE;
        let rest = head + lines * LINE / elem;
        let divisor = match post && self.has_post() {
            true => self.nranks(),
            false => 0,
        };
        // SAFETY (block): `head` elements, `lines` whole lines and the rest partition the
        // caller's `count` elements of every region; each part reads its elements of `a`
        // and `b` before it writes them at `dst`, so `dst` may equal either.
        unsafe {
            let plain = |from: usize, n: usize| {
                let at = from * elem;
                self.reduce(dst.add(at), a.add(at), b.add(at), n);
                if post {
                    self.post(dst.add(at), n);
                }
                for kept in also.iter().copied().chain(cached) {
                    std::ptr::copy_nonoverlapping(dst.add(at), kept.add(at), n * elem);
                }
            };
            plain(0, head);
            let at = head * elem;
            let kept = cached.map(|c| c.add(at));
            let mut others = [std::ptr::null_mut(); MAX_STREAMED - 1];
            for (o, &d) in others.iter_mut().zip(also) {
                *o = d.add(at);
            }
            crate::with_element_type!(self.dtype(), T => x86::reduce_lines::<T>(
                self,
                x86::Lines {
                    dst: dst.add(at),
                    also: &others[..also.len()],
                    cached: kept,
                    a: a.add(at).cast(),
                    b: b.add(at).cast(),
                    lines,
                    divisor,
                },
            ));
            plain(rest, count - rest);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, __m512i, _mm_loadu_si128, _mm_storeu_si128, _mm_stream_si128,
        _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256, _mm512_loadu_si512,
        _mm512_storeu_si512, _mm512_stream_si512,
    };

    use crate::reduce::loops::{Binary, zip3};
    use crate::reduce::num::{self, Arith};
    use crate::reduce::{Kernel, LINE, Op, VectorIsa, vector_isa};

    /// Streams `bytes` (whole lines) from `src` to `dst` (line-aligned), each line with
    /// the widest stores the kernels may use: a line written in one store, or in
    /// back-to-back ones, fills its write-combining buffer at once. When `cached` is
    /// given, each vector also goes there with a plain store, in the same pass.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `bytes` bytes, not overlapping; `dst`
    /// aligned to a line; `bytes` a multiple of a line; `cached`, if given, writable for
    /// `bytes` bytes and apart from both.
    #[inline]
    pub(super) unsafe fn stream_lines(
        dst: *mut u8,
        cached: Option<*mut u8>,
        src: *const u8,
        bytes: usize,
    ) {
        // SAFETY (block): the CPU has the instruction set (checked by `vector_isa`);
        // the rest is the caller's contract.
        unsafe {
            match vector_isa() {
                VectorIsa::Avx512 => avx512::copy(dst, cached, src, bytes),
                VectorIsa::Avx2 => avx2::copy(dst, cached, src, bytes),
                VectorIsa::Portable => sse2::copy(dst, cached, src, bytes),
            }
        }
    }

    /// Whole lines to reduce and stream ([`reduce_lines`]): `dst = a ⊕ b` over `lines`
    /// lines of `dst` (line-aligned), then divided by `divisor` unless it is 0 (avg's
    /// post-operation), streamed to each of `also` too (line-aligned), and stored at
    /// `cached` when it is given.
    #[derive(Clone, Copy)]
    pub(super) struct Lines<'a, T> {
        pub(super) dst: *mut u8,
        pub(super) also: &'a [*mut u8],
        pub(super) cached: Option<*mut u8>,
        pub(super) a: *const T,
        pub(super) b: *const T,
        pub(super) lines: usize,
        pub(super) divisor: usize,
    }

    /// Computes `job` with `kernel`'s reduction, each line streamed out of the
    /// registers it is computed in with the widest stores the kernels may use (and
    /// stored at `cached` with plain ones). Not fenced.
    ///
    /// # Safety
    /// `a`, `b` readable and `dst` and each of `also` writable for `lines` lines, each
    /// aligned to a line and equal to `a`, to `b` or apart from both and from each other;
    /// `cached`, if given, writable for as many bytes and apart from all of them; `T` the
    /// kernel's element type.
    pub(super) unsafe fn reduce_lines<T: Arith>(kernel: &Kernel, job: Lines<'_, T>) {
        // SAFETY (block): the CPU has the instruction set (checked by `vector_isa`);
        // the rest is the caller's contract.
        unsafe {
            match vector_isa() {
                VectorIsa::Avx512 => avx512::reduce(kernel, job),
                VectorIsa::Avx2 => avx2::reduce(kernel, job),
                VectorIsa::Portable => sse2::reduce(kernel, job),
            }
        }
    }

    /// A cache line's worth of elements, reduced in registers on its way out.
    #[repr(C, align(64))]
    struct Line(std::mem::MaybeUninit<[u8; LINE]>);

    /// The line loops of one instruction set, compiled with `$features` enabled:
    /// `copy` ([`stream_lines`]) and `reduce` ([`reduce_lines`]; the op chosen once, each
    /// line computed with the generic element loop, which LLVM vectorises to a register
    /// or two at this width), both storing a line with `put_line`: `$vector`s loaded with
    /// `$load` (unaligned), streamed with `$stream`, and stored at the cached copy with
    /// `$store` (unaligned).
    macro_rules! isa_lines {
        ($isa:ident, $features:literal, $vector:ty, $load:ident, $stream:ident, $store:ident) => {
            #[doc = concat!("The line loops with ", $features, ".")]
            mod $isa {
                use super::*;

                /// Streams the line at `src` to `dst` and, when given, stores it at
                /// `cached` too.
                ///
                /// # Safety
                /// The CPU supports the instruction set; a line readable at `src` and
                /// writable at `dst` (line-aligned) and `cached`, none overlapping.
                #[target_feature(enable = $features)]
                #[inline]
                unsafe fn put_line(dst: *mut u8, cached: Option<*mut u8>, src: *const u8) {
                    const PER_LINE: usize = LINE / size_of::<$vector>();
                    let (s, d) = (src.cast::<$vector>(), dst.cast::<$vector>());
                    for part in 0..PER_LINE {
                        // SAFETY: a line at each (the caller's contract); `dst` is
                        // line-aligned, so aligned for the vector.
                        unsafe {
                            let v = $load(s.add(part));
                            $stream(d.add(part), v);
                            if let Some(c) = cached {
                                $store(c.cast::<$vector>().add(part), v);
                            }
                        }
                    }
                }

                #[doc = concat!("[`stream_lines`] with ", $features, ".")]
                ///
                /// # Safety
                #[doc = concat!("The CPU supports ", $features, "; otherwise as [`stream_lines`].")]
                #[target_feature(enable = $features)]
                pub(super) unsafe fn copy(
                    dst: *mut u8,
                    cached: Option<*mut u8>,
                    src: *const u8,
                    bytes: usize,
                ) {
                    for i in (0..bytes).step_by(LINE) {
                        // SAFETY: `i + LINE <= bytes` (whole lines), inside every region.
                        unsafe { put_line(dst.add(i), cached.map(|c| c.add(i)), src.add(i)) };
                    }
                }

                #[doc = concat!("[`reduce_lines`] with ", $features, ".")]
                ///
                /// # Safety
                #[doc = concat!("The CPU supports ", $features, "; otherwise as [`reduce_lines`].")]
                #[target_feature(enable = $features)]
                pub(super) unsafe fn reduce<T: Arith>(kernel: &Kernel, job: Lines<'_, T>) {
                    /// The loop over lines for one per-element function.
                    ///
                    /// # Safety
                    /// As the function around it.
                    #[target_feature(enable = $features)]
                    unsafe fn each<T: Arith>(f: impl Binary<T>, job: Lines<'_, T>) {
                        let Lines {
                            dst,
                            also,
                            cached,
                            a,
                            b,
                            lines,
                            divisor,
                        } = job;
                        let per = LINE / size_of::<T>();
                        let mut line = Line(std::mem::MaybeUninit::uninit());
                        let t = line.0.as_mut_ptr().cast::<T>();
                        for i in 0..lines {
                            // SAFETY: line `i` lies inside every region (the caller's
                            // contract); the line buffer holds `per` elements and is
                            // aligned for the vector; every byte of it is written by
                            // the reduction before it is loaded.
                            unsafe {
                                zip3(t, a.add(i * per), b.add(i * per), per, f);
                                if divisor > 0 {
                                    T::div_all(t, per, divisor);
                                }
                                let at = i * LINE;
                                put_line(dst.add(at), cached.map(|c| c.add(at)), t.cast());
                                for &other in also {
                                    put_line(other.add(at), None, t.cast());
                                }
                            }
                        }
                    }
                    // SAFETY: forwarded from the caller.
                    unsafe {
                        match kernel.op {
                            Op::Sum | Op::Avg => each(num::Add, job),
                            Op::Prod => each(num::Mul, job),
                            Op::Max => each(num::Max, job),
                            Op::Min => each(num::Min, job),
                            Op::PreMulSum => each(num::PreMulSum(T::from_raw(kernel.scalar)), job),
                        }
                    }
                }
            }
        };
    }

    isa_lines!(
        avx512,
        "avx512f,avx512bw,avx512vl",
        __m512i,
        _mm512_loadu_si512,
        _mm512_stream_si512,
        _mm512_storeu_si512
    );
    isa_lines!(
        avx2,
        "avx2",
        __m256i,
        _mm256_loadu_si256,
        _mm256_stream_si256,
        _mm256_storeu_si256
    );
    isa_lines!(
        sse2,
        "sse2",
        __m128i,
        _mm_loadu_si128,
        _mm_stream_si128,
        _mm_storeu_si128
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::tests::{EVERY_OP, on_every_path};
    use crate::{DataType, Element, ReduceOp};

    /// Every offset of the destination within a line, lengths around a line and a
    /// tile, on every build of the line loops: the bytes arrive exactly, and nothing
    /// outside the destination is written.
    #[test]
    fn streamed_copies_equal_plain_ones_at_every_alignment() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + 3) as u8).collect();
        on_every_path(|| {
            for offset in [0usize, 1, 3, 8, 15, 56, 63] {
                for bytes in [0usize, 1, 15, 16, 17, 63, 64, 65, 127, 1024, 4096, 20_000] {
                    let mut dst = vec![0u8; bytes + 64];
                    // SAFETY: both hold `bytes` from their offsets.
                    unsafe { stream_copy(dst.as_mut_ptr().add(offset), src.as_ptr(), bytes) };
                    assert_eq!(
                        &dst[offset..offset + bytes],
                        &src[..bytes],
                        "{offset} {bytes}"
                    );
                    assert!(dst[..offset].iter().all(|&x| x == 0));
                    assert!(dst[offset + bytes..].iter().all(|&x| x == 0));
                }
            }
        });
    }

    /// The same copied to a streamed destination and a cached one at once, each
    /// starting anywhere in a line and elsewhere than the other: both get the bytes
    /// exactly, and nothing around either changes.
    #[test]
    fn streamed_copies_kept_in_the_cache_too_equal_plain_ones() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i * 11 + 5) as u8).collect();
        on_every_path(|| {
            for (offset, kept_at) in [(0usize, 0usize), (1, 0), (16, 48), (63, 1), (8, 8)] {
                for bytes in [0usize, 1, 15, 16, 17, 63, 64, 65, 127, 1024, 4096, 20_000] {
                    let mut dst = vec![0u8; bytes + 64];
                    let mut kept = vec![0u8; bytes + 64];
                    // SAFETY: both destinations hold `bytes` from their offsets; three
                    // buffers apart.
                    unsafe {
                        stream_copy_keeping(
                            dst.as_mut_ptr().add(offset),
                            kept.as_mut_ptr().add(kept_at),
                            src.as_ptr(),
                            bytes,
                        )
                    };
                    for (buf, at, what) in [(&dst, offset, "streamed"), (&kept, kept_at, "kept")] {
                        assert_eq!(
                            &buf[at..at + bytes],
                            &src[..bytes],
                            "{what} {offset} {bytes}"
                        );
                        assert!(buf[..at].iter().all(|&x| x == 0), "{what} before");
                        assert!(buf[at + bytes..].iter().all(|&x| x == 0), "{what} after");
                    }
                }
            }
        });
    }

    /// One streamed destination, for every element type and op: whole lines reduced
    /// in registers and streamed where element boundaries fall on the destination's
    /// lines ([`Kernel::reduce_streaming_lines`]; through the tile where they do not,
    /// and for `f16` with F16C), the ends with plain stores, with a cached copy or
    /// without, out of place and in place on either operand: the same bytes as
    /// `reduce` then `post`, on every build, and nothing around a destination written.
    #[test]
    fn single_streamed_destinations_equal_plain_reductions() {
        fn check<T: Element>() {
            let e = size_of::<T>();
            let most = 4099;
            let values = |seed: usize| -> Vec<u8> {
                (0..most)
                    .flat_map(|i| {
                        let v = T::from_f64(((i * seed) % 11) as f64);
                        // SAFETY: an element's bytes, read as bytes.
                        let bytes: &[u8] =
                            unsafe { std::slice::from_raw_parts((&v as *const T).cast(), e) };
                        bytes.to_vec()
                    })
                    .collect()
            };
            let (a, b) = (values(7), values(5));
            // A buffer whose byte `LINE` starts a line, zeroed.
            let lined = |bytes: usize| -> (Vec<u8>, usize) {
                let v = vec![0u8; bytes + 3 * LINE];
                let base = v.as_ptr().align_offset(LINE) + LINE;
                (v, base)
            };
            for op in EVERY_OP {
                let k = Kernel::new(T::DTYPE, op, 3).unwrap();
                for count in [0usize, 1, 3, 17, 64, 100, 257, 1000, most] {
                    let bytes = count * e;
                    let mut want = vec![0u8; bytes];
                    // SAFETY: every buffer holds `count` elements, apart.
                    unsafe {
                        k.reduce(want.as_mut_ptr(), a.as_ptr(), b.as_ptr(), count);
                        k.post(want.as_mut_ptr(), count);
                    }
                    for offset in [0, e, 16 / e * e, LINE - e, 1] {
                        for keep in [false, true] {
                            let (mut out, at) = lined(bytes);
                            let (mut kept, kept_at) = lined(bytes);
                            let d = out.as_mut_ptr().wrapping_add(at + offset);
                            let c = kept.as_mut_ptr().wrapping_add(kept_at + 3);
                            let cached = keep.then_some(c);
                            // SAFETY: both destinations hold `bytes` inside their
                            // buffers, apart from each other and the operands.
                            unsafe {
                                k.reduce_streaming(
                                    &[d],
                                    cached,
                                    a.as_ptr(),
                                    b.as_ptr(),
                                    count,
                                    true,
                                )
                            };
                            let what = format!("{} {op} count {count} offset {offset}", T::DTYPE);
                            let start = at + offset;
                            assert!(out[start..start + bytes] == want[..], "{what}");
                            assert!(out[..start].iter().all(|&x| x == 0), "{what}: before");
                            assert!(
                                out[start + bytes..].iter().all(|&x| x == 0),
                                "{what}: after"
                            );
                            // The cached copy holds the result, or nothing was kept.
                            let (start, len) = (kept_at + 3, if keep { bytes } else { 0 });
                            assert!(kept[start..start + len] == want[..len], "{what}: kept");
                            let (before, after) = (&kept[..start], &kept[start + len..]);
                            assert!(
                                before.iter().chain(after).all(|&x| x == 0),
                                "{what}: around kept"
                            );
                        }
                    }
                    for operand in [0, 1] {
                        let (mut buf, at) = lined(bytes);
                        let p = buf.as_mut_ptr().wrapping_add(at + e);
                        let other = [&a, &b][1 - operand].as_ptr();
                        let own = [&a, &b][operand].as_ptr();
                        // SAFETY: `buf` holds `bytes` at `p`; the destination equals one
                        // operand exactly.
                        unsafe {
                            std::ptr::copy_nonoverlapping(own, p, bytes);
                            match operand {
                                0 => k.reduce_streaming(&[p], None, p, other, count, true),
                                _ => k.reduce_streaming(&[p], None, other, p, count, true),
                            }
                        }
                        let got = &buf[at + e..at + e + bytes];
                        assert!(
                            got == want,
                            "{} {op} count {count}: in place on operand {operand}",
                            T::DTYPE
                        );
                    }
                }
            }
        }
        on_every_path(|| {
            for dtype in DataType::ALL {
                crate::with_element_type!(dtype, T => check::<T>());
            }
        });
    }

    /// Avg of `f32` over 3 ranks (so the post-operation runs), to one, two and the most
    /// streamed destinations and a cached one, each starting anywhere in a line and
    /// elsewhere than the others (also where no element meets a line), or all at one
    /// offset in their lines; counts around a tile: every destination gets `reduce`
    /// then `post`'s values exactly, and nothing around it changes; in place too.
    #[test]
    fn streamed_reductions_equal_plain_ones_at_every_alignment() {
        let k = Kernel::new(DataType::Float32, ReduceOp::Avg, 3).unwrap();
        let elems = 5000;
        let a: Vec<f32> = (0..elems).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..elems).map(|i| 2.0 * i as f32).collect();
        let want = |i: usize| (3 * i) as f32 / 3.0;
        on_every_path(|| {
            for (streamed, spread) in [(1, 20), (2, 20), (MAX_STREAMED, 20), (MAX_STREAMED, 0)] {
                for offset in [0usize, 1, 4, 60] {
                    for count in [0usize, 1, 15, 16, 17, 255, 256, 257, 5000 - 16] {
                        check_destinations(&k, (&a, &b), want, streamed, spread, offset, count);
                    }
                }
            }
            let mut inplace = a.clone();
            let p = inplace.as_mut_ptr().cast::<u8>();
            // SAFETY: `dst` equal to `a` is allowed.
            unsafe { k.reduce_streaming(&[p], None, p, b.as_ptr().cast(), elems, false) };
            assert!(
                inplace
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == (3 * i) as f32)
            );
        });
    }

    /// Streams `a ⊕ b` (with post) to `streamed` destinations and one cached one, in one
    /// buffer, apart, destination `d` starting `offset + spread·d` bytes past a line,
    /// and checks each against `want` and the bytes around them.
    fn check_destinations(
        k: &Kernel,
        (a, b): (&[f32], &[f32]),
        want: impl Fn(usize) -> f32,
        streamed: usize,
        spread: usize,
        offset: usize,
        count: usize,
    ) {
        let bytes = count * 4;
        let dests = streamed + 1;
        let stride = bytes.next_multiple_of(64) + 128;
        let mut mem = vec![0u8; dests * stride + 64];
        let base = mem.as_mut_ptr().wrapping_add(mem.as_ptr().align_offset(64));
        let past = |d: usize| (offset + spread * d) % 64;
        let at = |d: usize| base.wrapping_add(d * stride + past(d));
        let dsts: Vec<*mut u8> = (0..streamed).map(at).collect();
        // SAFETY: each destination holds `count` f32 inside `mem`, apart.
        unsafe {
            k.reduce_streaming(
                &dsts,
                Some(at(streamed)),
                a.as_ptr().cast(),
                b.as_ptr().cast(),
                count,
                true,
            )
        };
        let lead = base as usize - mem.as_ptr() as usize;
        let case = format!("{streamed} streamed, spread {spread}, offset {offset}, count {count}");
        for d in 0..dests {
            let start = lead + d * stride + past(d);
            let got = &mem[start..start + bytes];
            let ok = got
                .chunks_exact(4)
                .enumerate()
                .all(|(i, v)| f32::from_ne_bytes(v.try_into().unwrap()) == want(i));
            assert!(ok, "destination {d}: {case}");
            let next = lead + (d + 1) * stride + past(d + 1);
            let after = &mem[start + bytes..next.min(mem.len())];
            assert!(after.iter().all(|&x| x == 0), "past {d}: {case}");
        }
        assert!(
            mem[..lead + offset].iter().all(|&x| x == 0),
            "before the first: {case}"
        );
    }
}
