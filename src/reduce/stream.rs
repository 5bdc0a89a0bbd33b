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
//! A reduction streams through a small tile: it reduces a tile's worth into a buffer
//! that stays in the L1 cache (with the post-operation, so the result is never read
//! back), then streams the tile out. Streaming stores are weakly ordered: every
//! function here ends with a store fence, so a flag published afterwards (a FIFO's
//! `head`, a descriptor's release) is seen after the data.

use super::Kernel;

/// Bytes of the tile a streaming reduction computes in (a quarter of a 32 KiB L1).
const TILE_BYTES: usize = 8 * 1024;

/// A tile, aligned for the widest vector stores.
#[repr(C, align(64))]
struct Tile([u8; TILE_BYTES]);

/// Bytes of a cache line, the unit that streaming stores fill whole.
const LINE: usize = 64;

/// Copies `bytes` bytes from `src` to `dst` with streaming stores, whole cache lines
/// only (the partial lines at either end with plain ones: a write-combining buffer
/// flushed half full costs a partial write, and an LL slot's header shares its first
/// line with the message), then fences.
///
/// # Safety
/// `src` readable and `dst` writable for `bytes` bytes, not overlapping.
pub unsafe fn stream_copy(dst: *mut u8, src: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Plain stores up to the first line boundary of `dst`.
        let head = dst.align_offset(LINE).min(bytes);
        // SAFETY (block): all within the caller's `bytes`; SSE2 is part of x86-64; the
        // streamed addresses are line-aligned (after `head`), the loads unaligned.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let mut i = head;
            while i + LINE <= bytes {
                for part in (0..LINE).step_by(16) {
                    let v = _mm_loadu_si128(src.add(i + part).cast::<__m128i>());
                    _mm_stream_si128(dst.add(i + part).cast::<__m128i>(), v);
                }
                i += LINE;
            }
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), bytes - i);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, bytes)
    };
}

impl Kernel {
    /// [`reduce`](Kernel::reduce), then [`post`](Kernel::post) when `post`, with the
    /// result streamed past the caches to every one of `dsts` (see the module
    /// documentation): a result bound for both an output and a far peer's slot is
    /// computed once.
    ///
    /// # Safety
    /// As [`Kernel::reduce`], for each of `dsts`; no two of `dsts` overlap.
    pub unsafe fn reduce_streaming(
        &self,
        dsts: &[*mut u8],
        a: *const u8,
        b: *const u8,
        count: usize,
        post: bool,
    ) {
        let elem = self.dtype().size();
        let per_tile = TILE_BYTES / elem;
        let mut tile = Tile([0; TILE_BYTES]);
        let t = tile.0.as_mut_ptr();
        let mut done = 0;
        while done < count {
            let n = per_tile.min(count - done);
            let at = done * elem;
            // SAFETY (block): the tile holds `n` elements; `a`, `b` and each of `dsts`
            // hold `count` (the caller's contract), and the tile overlaps none of
            // them, so a destination may equal `a` or `b`: each piece of them is read
            // before it is written.
            unsafe {
                self.reduce(t, a.add(at), b.add(at), n);
                if post {
                    self.post(t, n);
                }
                for &dst in dsts {
                    stream_copy(dst.add(at), t, n * elem);
                }
            }
            done += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DataType, ReduceOp};

    #[test]
    fn streamed_copies_and_reductions_equal_plain_ones_at_every_alignment() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for offset in [0usize, 1, 3, 8, 15, 56, 63] {
            for bytes in [0usize, 1, 15, 16, 17, 63, 64, 65, 127, 4096, 20_000] {
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
        // Avg over 3 ranks, 5000 f32 (several tiles), in place and not.
        let k = Kernel::new(DataType::Float32, ReduceOp::Avg, 3).unwrap();
        let a: Vec<f32> = (0..5000).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..5000).map(|i| 2.0 * i as f32).collect();
        let (mut out, mut copy) = (vec![0f32; 5000], vec![0f32; 5000]);
        // SAFETY: all hold 5000 f32; `out` and `copy` are apart.
        unsafe {
            k.reduce_streaming(
                &[out.as_mut_ptr().cast(), copy.as_mut_ptr().cast()],
                a.as_ptr().cast(),
                b.as_ptr().cast(),
                5000,
                true,
            )
        };
        for result in [&out, &copy] {
            assert!(
                result
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == (3 * i) as f32 / 3.0)
            );
        }
        let mut inplace = a.clone();
        let p = inplace.as_mut_ptr().cast::<u8>();
        // SAFETY: `dst` equal to `a` is allowed.
        unsafe { k.reduce_streaming(&[p], p, b.as_ptr().cast(), 5000, false) };
        assert!(
            inplace
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (3 * i) as f32)
        );
    }
}
