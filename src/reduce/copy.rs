//! Copies that keep their speed whatever the two buffers' relative placement.
//!
//! glibc's `memcpy` (2.36, Debian 12) moves anything from about 2 KiB up with
//! `rep movsb`, and `rep movsb` crawls when the destination starts 1–63 bytes past the
//! source modulo a 4 KiB page: the CPU cannot tell that from a true overlap by the low
//! address bits, and copies slowly. Measured on the project's 2-core VM (AMD Zen 5),
//! 16 KiB copies in the cache: 1.6–2.5 GB/s at distances 1–31 and 18 GB/s at 32–63,
//! against 37–88 GB/s at other distances, and 28–41 GB/s for a vector loop at every
//! distance. Up to about 1 MiB the slow case holds; beyond it glibc leaves `rep movsb`.
//!
//! The slow distance is the common one, not a corner: a FIFO slot starts on a page and
//! `malloc`'s large blocks start 16 bytes into one, so every slice received from a slot
//! into such a buffer fell into it (8 ranks on 2 cores, 128 KiB all-reduce out of place:
//! 420 µs a call, 62 % of it in `rep movsb`; see `docs/src/benchmarks-mpi.md`).
//! [`copy`] takes a vector loop for exactly those distances and leaves every other
//! copy to `memcpy`.

use std::ptr;

/// Copies shorter than this go to `memcpy` whatever the distance: below it glibc copies
/// with vector registers, not `rep movsb` (measured: 2,100 B at distance 16 runs at
/// 62 GB/s, 3,000 B at 2 GB/s).
const VECTOR_FROM: usize = 2048;

/// Distances (destination minus source, modulo [`PAGE`]) below which `rep movsb` is slow.
const ALIASED_BELOW: usize = 64;

/// The page size whose low address bits the CPU compares.
const PAGE: usize = 4096;

/// Whether `memcpy` of `bytes` from `src` to `dst` would take the slow `rep movsb` case.
#[inline]
fn aliased(dst: *const u8, src: *const u8, bytes: usize) -> bool {
    let distance = (dst as usize).wrapping_sub(src as usize) % PAGE;
    bytes >= VECTOR_FROM && (1..ALIASED_BELOW).contains(&distance)
}

/// Copies `bytes` bytes from `src` to `dst` (`memcpy`, or a vector loop where `memcpy`
/// would be slow: see the module documentation).
///
/// # Safety
/// `src` readable and `dst` writable for `bytes` bytes, not overlapping.
#[inline]
pub unsafe fn copy(dst: *mut u8, src: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    if aliased(dst, src, bytes) {
        // SAFETY: the caller's contract.
        unsafe { x86::vector_copy(dst, src, bytes) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { ptr::copy_nonoverlapping(src, dst, bytes) }
}

/// [`copy`] for regions that may overlap (`memmove` when they do).
///
/// # Safety
/// `src` readable and `dst` writable for `bytes` bytes.
#[inline]
pub unsafe fn copy_maybe_overlapping(dst: *mut u8, src: *const u8, bytes: usize) {
    let (d, s) = (dst as usize, src as usize);
    if d < s + bytes && s < d + bytes {
        // SAFETY: the caller's contract; `ptr::copy` allows overlap.
        unsafe { ptr::copy(src, dst, bytes) };
    } else {
        // SAFETY: the caller's contract, and the regions do not overlap (checked).
        unsafe { copy(dst, src, bytes) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm_loadu_si128, _mm_storeu_si128, _mm256_loadu_si256,
        _mm256_storeu_si256,
    };

    use crate::reduce::{VectorIsa, vector_isa};

    /// Copies with vector loads and stores, four vectors at a time (all four loaded
    /// before any is stored), the stores starting on a line of `dst`; the bytes before
    /// that line and the tail with `memcpy` (shorter than the slow case).
    ///
    /// # Safety
    /// As [`super::copy`].
    pub(super) unsafe fn vector_copy(dst: *mut u8, src: *const u8, bytes: usize) {
        // The loop stores whole lines of the destination (see `line_head`); the bytes
        // before the first line go first.
        let head = crate::reduce::line_head(dst, 1, bytes);
        // SAFETY: `head` < a line ≤ `bytes`, inside both regions.
        let (dst, src, bytes) = unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            (dst.add(head), src.add(head), bytes - head)
        };
        let done = if vector_isa() >= VectorIsa::Avx2 {
            // SAFETY: the CPU has AVX2 (checked); the rest is the caller's contract.
            unsafe { copy_avx2(dst, src, bytes) }
        } else {
            // SAFETY: SSE2 is part of x86-64; the rest is the caller's contract.
            unsafe { copy_sse2(dst, src, bytes) }
        };
        // SAFETY: the remaining bytes lie inside both regions.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), bytes - done) };
    }

    /// A loop that copies the whole blocks of four vectors of `$vector` (loaded with
    /// `$load`, stored with `$store`) and returns the bytes it did, compiled with
    /// `$features` enabled.
    macro_rules! block_copy {
        ($name:ident, $features:literal, $what:literal, $vector:ty, $load:ident, $store:ident) => {
            #[doc = concat!("The whole blocks of four ", $what, " vectors of the copy; returns the bytes done.")]
            ///
            /// # Safety
            #[doc = concat!("The CPU supports ", $features, "; otherwise as [`super::copy`].")]
            #[target_feature(enable = $features)]
            unsafe fn $name(dst: *mut u8, src: *const u8, bytes: usize) -> usize {
                const BLOCK: usize = 4 * size_of::<$vector>();
                let mut i = 0;
                while i + BLOCK <= bytes {
                    // SAFETY: `i + BLOCK <= bytes`, inside both regions; unaligned
                    // accesses.
                    unsafe {
                        let s = src.add(i).cast::<$vector>();
                        let d = dst.add(i).cast::<$vector>();
                        let (a, b, c, e) = ($load(s), $load(s.add(1)), $load(s.add(2)), $load(s.add(3)));
                        $store(d, a);
                        $store(d.add(1), b);
                        $store(d.add(2), c);
                        $store(d.add(3), e);
                    }
                    i += BLOCK;
                }
                i
            }
        };
    }

    block_copy!(
        copy_avx2,
        "avx2",
        "256-bit",
        __m256i,
        _mm256_loadu_si256,
        _mm256_storeu_si256
    );
    block_copy!(
        copy_sse2,
        "sse2",
        "128-bit",
        __m128i,
        _mm_loadu_si128,
        _mm_storeu_si128
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::VectorIsa;

    /// Every distance around the slow window, lengths around the vector blocks and the
    /// threshold, both vector builds: the bytes arrive exactly, and nothing past the
    /// destination is written.
    #[test]
    fn copies_exactly_at_every_distance_and_length() {
        let src_buf: Vec<u8> = (0..3 * PAGE).map(|i| (i * 7 + 3) as u8).collect();
        for isa in [VectorIsa::Portable, VectorIsa::Avx2] {
            crate::reduce::tests::with_isa(isa, || {
                for distance in [0, 1, 15, 16, 31, 32, 63, 64, 65, 4095] {
                    // Lengths from 4 KiB start the loop on a line of the destination; the
                    // source's place in a line moves the destination's.
                    for (len, from) in [0, 1, 2047, 2048, 2049, 2111, 2175, 4096, 4096 + 127]
                        .into_iter()
                        .flat_map(|len| [(len, 5), (len, 64), (len, 64 + 48)])
                    {
                        let src = &src_buf[from..from + len];
                        let mut dst_buf = vec![0xAAu8; 3 * PAGE + 256];
                        // Place dst at `distance` past src modulo a page.
                        let base = dst_buf.as_ptr() as usize;
                        let want = (src.as_ptr() as usize + distance) % PAGE;
                        let at = (want + PAGE - base % PAGE) % PAGE;
                        let dst = &mut dst_buf[at..at + len + 64];
                        assert_eq!(
                            aliased(dst.as_ptr(), src.as_ptr(), len),
                            len >= VECTOR_FROM && (1..ALIASED_BELOW).contains(&distance)
                        );
                        // SAFETY: both hold `len` bytes; distinct allocations.
                        unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), len) };
                        assert_eq!(&dst[..len], src, "distance {distance}, {len} B from {from}");
                        assert!(dst[len..].iter().all(|&b| b == 0xAA), "wrote past the end");
                    }
                }
            });
        }
    }

    /// Overlapping regions go through `memmove` (a forward vector copy would smear).
    #[test]
    fn overlapping_regions_move_like_memmove() {
        for shift in [1usize, 16, 31, 100] {
            let mut buf: Vec<u8> = (0..8192).map(|i| i as u8).collect();
            let want: Vec<u8> = buf[..6000].to_vec();
            // SAFETY: both regions inside `buf`.
            unsafe {
                copy_maybe_overlapping(buf.as_mut_ptr().add(shift), buf.as_ptr(), 6000);
            }
            assert_eq!(&buf[shift..shift + 6000], &want[..], "shift {shift}");
        }
    }
}
