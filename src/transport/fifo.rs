//! The slot FIFO every transport presents to the engine.
//!
//! One FIFO carries data one way between two ranks: `slots` buffers of `slot_bytes`
//! each, a `head` counter written only by the sender (slots published) and a `tail`
//! counter written only by the receiver (slots consumed), on separate cache lines. The
//! sender owns slot `head % slots` while `head - tail < slots`; the receiver owns slot
//! `tail % slots` while `tail < head`. Counters are 32-bit and wrap.
//!
//! The engine reads and writes slots in place: a receiver reduces straight out of the
//! slot the peer wrote into its destination, or into the slot of its own outgoing FIFO,
//! with no staging copy. Shared-memory and in-process FIFOs are shared by both ranks;
//! a network transport keeps a FIFO on each side and a proxy moves slots across.
//!
//! Layout (offsets in bytes): magic at 0, geometry at 8, `head` at 64, `tail` at 128,
//! per-slot byte counts from 192, slot data from [`DATA_OFFSET`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::segment::Segment;
use crate::error::{Error, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"FCCLFIFO");
const GEOMETRY: usize = 8;
const HEAD: usize = 64;
const TAIL: usize = 128;
const SIZES: usize = 192;
/// Where slot data starts (slots are page-aligned).
pub const DATA_OFFSET: usize = 4096;
/// Most slots a FIFO can have (their byte counts must fit before [`DATA_OFFSET`]).
pub const MAX_SLOTS: usize = (DATA_OFFSET - SIZES) / 4;

/// The shape of a FIFO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Number of slots.
    pub slots: usize,
    /// Bytes per slot (a multiple of 64).
    pub slot_bytes: usize,
}

impl Geometry {
    /// Checks the shape.
    pub fn validate(&self) -> Result<()> {
        if !(2..=MAX_SLOTS).contains(&self.slots) {
            return Err(Error::invalid(format!(
                "FIFO slots {} is not in 2..={MAX_SLOTS}",
                self.slots
            )));
        }
        if self.slot_bytes < 64 || !self.slot_bytes.is_multiple_of(64) || self.slot_bytes > 1 << 30
        {
            return Err(Error::invalid(format!(
                "FIFO slot size {} is not a multiple of 64 bytes between 64 B and 1 GiB",
                self.slot_bytes
            )));
        }
        Ok(())
    }

    /// Bytes of the segment holding a FIFO of this shape.
    pub fn segment_bytes(&self) -> usize {
        DATA_OFFSET + self.slots * self.slot_bytes
    }

    fn encode(&self) -> u64 {
        (self.slots as u64) << 32 | self.slot_bytes as u64
    }
}

/// A FIFO's shared memory.
struct Shared {
    seg: Segment,
    geometry: Geometry,
}

impl Shared {
    /// Formats a freshly created (zeroed) segment.
    fn format(seg: Segment, geometry: Geometry) -> Result<Self> {
        geometry.validate()?;
        let s = Shared { seg, geometry };
        s.u64_at(GEOMETRY)
            .store(geometry.encode(), Ordering::Relaxed);
        s.u64_at(0).store(MAGIC, Ordering::Release);
        Ok(s)
    }

    /// Attaches to a segment formatted by the other side.
    fn attach(seg: Segment, geometry: Geometry, name: &str) -> Result<Self> {
        let s = Shared { seg, geometry };
        let magic = s.u64_at(0).load(Ordering::Acquire);
        let found = s.u64_at(GEOMETRY).load(Ordering::Relaxed);
        if magic != MAGIC || found != geometry.encode() {
            return Err(Error::invalid(format!(
                "FIFO {name}: not formatted as {geometry:?} (magic {magic:#x}, geometry {found:#x})"
            )));
        }
        Ok(s)
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offsets are below DATA_OFFSET ≤ segment length, 8-aligned in a
        // page-aligned segment that lives as long as `self`; accessed only atomically.
        unsafe { &*(self.seg.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: as for `u64_at`, 4-aligned.
        unsafe { &*(self.seg.as_ptr().add(offset) as *const AtomicU32) }
    }

    fn head(&self) -> &AtomicU32 {
        self.u32_at(HEAD)
    }

    fn tail(&self) -> &AtomicU32 {
        self.u32_at(TAIL)
    }

    fn size_of(&self, slot: usize) -> &AtomicU32 {
        self.u32_at(SIZES + 4 * slot)
    }

    fn slot_ptr(&self, counter: u32) -> *mut u8 {
        let slot = counter as usize % self.geometry.slots;
        // SAFETY: slot < slots, so the slot lies inside the segment.
        unsafe {
            self.seg
                .as_ptr()
                .add(DATA_OFFSET + slot * self.geometry.slot_bytes)
        }
    }
}

/// The sending end of a FIFO.
pub struct SendEnd {
    shared: Shared,
    /// Next slot to publish.
    head: u32,
    /// Last value of `tail` seen (only grows).
    tail_seen: u32,
}

/// The receiving end of a FIFO.
pub struct RecvEnd {
    shared: Shared,
    /// Next slot to consume.
    tail: u32,
    /// Last value of `head` seen.
    head_seen: u32,
}

/// Formats a new FIFO in `seg` (created by the receiver) and returns its receiving end.
pub fn recv_end(seg: Segment, geometry: Geometry) -> Result<RecvEnd> {
    Ok(RecvEnd {
        shared: Shared::format(seg, geometry)?,
        tail: 0,
        head_seen: 0,
    })
}

/// Attaches the sending end to a FIFO the receiver formatted in `seg`.
pub fn send_end(seg: Segment, geometry: Geometry, name: &str) -> Result<SendEnd> {
    Ok(SendEnd {
        shared: Shared::attach(seg, geometry, name)?,
        head: 0,
        tail_seen: 0,
    })
}

impl SendEnd {
    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.shared.geometry.slot_bytes
    }

    /// A free slot to write into, or `None` if the FIFO is full. The slot stays this
    /// end's until [`SendEnd::commit`].
    pub fn try_reserve(&mut self) -> Option<*mut u8> {
        let slots = self.shared.geometry.slots as u32;
        if self.head.wrapping_sub(self.tail_seen) >= slots {
            self.tail_seen = self.shared.tail().load(Ordering::Acquire);
            if self.head.wrapping_sub(self.tail_seen) >= slots {
                return None;
            }
        }
        Some(self.shared.slot_ptr(self.head))
    }

    /// Like [`SendEnd::try_reserve`] for the slot `ahead` places after the next one to
    /// publish, so several writers can fill slots at once; they are still published in
    /// order by [`SendEnd::commit`].
    pub fn try_reserve_ahead(&mut self, ahead: u32) -> Option<*mut u8> {
        let slots = self.shared.geometry.slots as u32;
        let wanted = self.head.wrapping_add(ahead);
        if wanted.wrapping_sub(self.tail_seen) >= slots {
            self.tail_seen = self.shared.tail().load(Ordering::Acquire);
            if wanted.wrapping_sub(self.tail_seen) >= slots {
                return None;
            }
        }
        Some(self.shared.slot_ptr(wanted))
    }

    /// Publishes the reserved slot holding `len` bytes.
    pub fn commit(&mut self, len: usize) {
        debug_assert!(len <= self.slot_bytes());
        let slot = self.head as usize % self.shared.geometry.slots;
        self.shared
            .size_of(slot)
            .store(len as u32, Ordering::Relaxed);
        self.head = self.head.wrapping_add(1);
        self.shared.head().store(self.head, Ordering::Release);
    }
}

impl RecvEnd {
    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.shared.geometry.slot_bytes
    }

    /// The oldest published slot and its byte count, or `None` if the FIFO is empty. The
    /// slot stays readable until [`RecvEnd::release`].
    pub fn try_peek(&mut self) -> Option<(*const u8, usize)> {
        if self.tail == self.head_seen {
            self.head_seen = self.shared.head().load(Ordering::Acquire);
            if self.tail == self.head_seen {
                return None;
            }
        }
        let slot = self.tail as usize % self.shared.geometry.slots;
        let len = self.shared.size_of(slot).load(Ordering::Relaxed) as usize;
        Some((self.shared.slot_ptr(self.tail), len))
    }

    /// Like [`RecvEnd::try_peek`] for the slot `ahead` places after the oldest, so
    /// several readers can work on slots at once; they are still released in order.
    pub fn try_peek_ahead(&mut self, ahead: u32) -> Option<(*const u8, usize)> {
        let wanted = self.tail.wrapping_add(ahead);
        if self.head_seen.wrapping_sub(self.tail) <= ahead {
            self.head_seen = self.shared.head().load(Ordering::Acquire);
            if self.head_seen.wrapping_sub(self.tail) <= ahead {
                return None;
            }
        }
        let slot = wanted as usize % self.shared.geometry.slots;
        let len = self.shared.size_of(slot).load(Ordering::Relaxed) as usize;
        Some((self.shared.slot_ptr(wanted), len))
    }

    /// Hands the slot from [`RecvEnd::try_peek`] back to the sender.
    pub fn release(&mut self) {
        self.tail = self.tail.wrapping_add(1);
        self.shared.tail().store(self.tail, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::super::segment::SegmentKind;
    use super::*;

    #[test]
    fn slots_flow_in_order_and_the_fifo_fills_up() {
        let g = Geometry {
            slots: 4,
            slot_bytes: 64,
        };
        let name = format!("ferroccl-test-fifo-{}", std::process::id());
        let seg = Segment::create(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        let mut rx = recv_end(seg, g).unwrap();
        let seg = Segment::open(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        let mut tx = send_end(seg, g, &name).unwrap();
        Segment::unlink(SegmentKind::InProcess, &name);
        let producer = std::thread::spawn(move || {
            for i in 0..1000u32 {
                let slot = loop {
                    if let Some(p) = tx.try_reserve() {
                        break p;
                    }
                    std::hint::spin_loop();
                };
                // SAFETY: the reserved slot has 64 bytes and is ours until commit.
                unsafe { std::ptr::write_unaligned(slot as *mut u32, i) };
                tx.commit(4 + (i as usize % 60));
            }
        });
        for i in 0..1000u32 {
            let (p, len) = loop {
                if let Some(s) = rx.try_peek() {
                    break s;
                }
                std::hint::spin_loop();
            };
            // SAFETY: the peeked slot was published with at least 4 bytes.
            let v = unsafe { std::ptr::read_unaligned(p as *const u32) };
            assert_eq!((v, len), (i, 4 + (i as usize % 60)));
            rx.release();
        }
        producer.join().unwrap();
        assert!(rx.try_peek().is_none());
    }

    #[test]
    fn geometry_is_checked_on_both_ends() {
        let bad = Geometry {
            slots: 1,
            slot_bytes: 64,
        };
        assert!(bad.validate().is_err());
        let g = Geometry {
            slots: 2,
            slot_bytes: 128,
        };
        let name = format!("ferroccl-test-fifo-geom-{}", std::process::id());
        let seg = Segment::create(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        let _rx = recv_end(seg, g).unwrap();
        let other = Geometry {
            slots: 4,
            slot_bytes: 64,
        };
        let seg = Segment::open(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        assert!(send_end(seg, other, &name).is_err());
        Segment::unlink(SegmentKind::InProcess, &name);
    }
}
