//! The element loops, generic over the element type and the per-element function and
//! monomorphised for each (type, op) pair.
//!
//! All accesses are `read_unaligned` / `write_unaligned`, so no alignment is required
//! (on x86 the unaligned vector loads cost the same as aligned ones). The loops are
//! split by aliasing pattern: when the destination is exactly one of the sources, the
//! loop reads and writes through the same pointer, so the vectoriser's run-time overlap
//! check only has to compare the destination with the one remaining source, and passes.
//! A single three-pointer loop would fail that check for in-place calls and fall back to
//! scalar code.
//!
//! The per-element functions are small `Copy` structs implementing [`Binary`] / [`Unary`]
//! with `#[inline(always)]` methods rather than closures: LLVM declines to inline a large
//! closure body (the 8-bit float conversions) called from several loops, which leaves a
//! call per element and no vectorisation.

use std::ptr;

/// A per-element binary function.
pub(super) trait Binary<T>: Copy {
    /// The result for one pair of elements.
    fn apply(self, a: T, b: T) -> T;
}

/// A per-element unary function.
pub(super) trait Unary<T>: Copy {
    /// The result for one element.
    fn apply(self, x: T) -> T;
}

/// `f(b, a)`: a binary function with its operands swapped.
#[derive(Clone, Copy)]
struct Flip<F>(F);

impl<T, F: Binary<T>> Binary<T> for Flip<F> {
    #[inline(always)]
    fn apply(self, a: T, b: T) -> T {
        self.0.apply(b, a)
    }
}

/// `f(x, x)`: a binary function applied to one element twice.
#[derive(Clone, Copy)]
struct Square<F>(F);

impl<T: Copy, F: Binary<T>> Unary<T> for Square<F> {
    #[inline(always)]
    fn apply(self, x: T) -> T {
        self.0.apply(x, x)
    }
}

/// `dst[i] = f(a[i], b[i])` for `i` in `0..n`.
///
/// # Safety
/// `a` and `b` are valid for reads of `n` elements and `dst` for writes of `n`
/// elements; `dst` is either exactly `a`, exactly `b`, or overlaps neither.
#[inline(always)]
pub(super) unsafe fn zip<T: Copy>(
    dst: *mut T,
    a: *const T,
    b: *const T,
    n: usize,
    f: impl Binary<T>,
) {
    if ptr::eq(dst, a) {
        if ptr::eq(a, b) {
            // SAFETY: dst == a == b, valid for reads and writes of n elements.
            unsafe { map_in_place(dst, n, Square(f)) }
        } else {
            // SAFETY: dst == a is valid for reads and writes; b is valid for reads and
            // does not overlap dst (caller's contract).
            unsafe { zip_in_place(dst, b, n, f) }
        }
    } else if ptr::eq(dst, b) {
        // SAFETY: as above with the roles of a and b swapped.
        unsafe { zip_in_place(dst, a, n, Flip(f)) }
    } else {
        // SAFETY: forwarded from the caller; dst overlaps neither source.
        unsafe { zip3(dst, a, b, n, f) }
    }
}

/// `dst[i] = f(dst[i], src[i])`.
///
/// # Safety
/// `dst` valid for reads and writes and `src` for reads of `n` elements.
#[inline(always)]
unsafe fn zip_in_place<T: Copy>(dst: *mut T, src: *const T, n: usize, f: impl Binary<T>) {
    for i in 0..n {
        // SAFETY: i < n and both pointers are valid for n elements (caller's contract).
        unsafe {
            let p = dst.add(i);
            p.write_unaligned(f.apply(p.read_unaligned(), src.add(i).read_unaligned()));
        }
    }
}

/// `dst[i] = f(a[i], b[i])` with `dst` overlapping neither source.
///
/// # Safety
/// `a`, `b` valid for reads and `dst` for writes of `n` elements.
#[inline(always)]
pub(super) unsafe fn zip3<T: Copy>(
    dst: *mut T,
    a: *const T,
    b: *const T,
    n: usize,
    f: impl Binary<T>,
) {
    for i in 0..n {
        // SAFETY: i < n and all three pointers are valid for n elements.
        unsafe {
            let v = f.apply(a.add(i).read_unaligned(), b.add(i).read_unaligned());
            dst.add(i).write_unaligned(v);
        }
    }
}

/// `dst[i] = f(src[i])`; `dst` may be exactly `src`.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `n` elements; `dst` is exactly `src`
/// or does not overlap it.
#[inline(always)]
pub(super) unsafe fn map<T: Copy>(dst: *mut T, src: *const T, n: usize, f: impl Unary<T>) {
    if ptr::eq(dst, src) {
        // SAFETY: dst == src, valid for reads and writes of n elements.
        unsafe { map_in_place(dst, n, f) }
    } else {
        for i in 0..n {
            // SAFETY: i < n, both valid for n elements.
            unsafe {
                dst.add(i)
                    .write_unaligned(f.apply(src.add(i).read_unaligned()))
            }
        }
    }
}

/// `buf[i] = f(buf[i])`.
///
/// # Safety
/// `buf` valid for reads and writes of `n` elements.
#[inline(always)]
pub(super) unsafe fn map_in_place<T: Copy>(buf: *mut T, n: usize, f: impl Unary<T>) {
    for i in 0..n {
        // SAFETY: i < n, buf valid for n elements.
        unsafe {
            let p = buf.add(i);
            p.write_unaligned(f.apply(p.read_unaligned()));
        }
    }
}
