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
//! per-slot byte counts and locations from 192 (8 bytes a slot, see "Slots that change
//! direction"), slot data from [`DATA_OFFSET`].
//!
//! # Protocols
//!
//! How a slot is published is the FIFO's [`Protocol`], as in NCCL:
//!
//! - **Simple**: the sender writes the data, its byte count, then `head` (release); the
//!   receiver polls `head`. Full bandwidth, but a small message costs three cache lines
//!   on the critical path (head, count, data), and on weakly ordered memory a fence.
//! - **LL** (low latency, flag in the slot): a slot starts with an 8-byte *header*,
//!   the slot's use number (`head + 1`) in its high half and the byte count in its low
//!   half; the message follows it. The sender writes the message, then the header with
//!   one release store; the receiver polls the header of the slot it expects with
//!   acquire loads. A message of up to [`LL_ONE_LINE`] bytes shares the header's cache
//!   line, so it crosses in one line, where Simple needs three; `head` is not used, and
//!   `tail` still tells the sender which slots are free. A header from an earlier use
//!   carries an earlier number (every use rewrites it), and a header never written
//!   carries 0, the number of use 2³² − 1, which no slot reaches unwritten.
//!
//!   NCCL's LL, and the device executor's (`kernels/executor.cu`), put a flag in every
//!   8-byte line instead, next to 4 bytes of data, because a GPU thread would need a
//!   costly fence between data and flag. A CPU's release store costs nothing on x86
//!   and little elsewhere, and the flag in every line halved what a slot carries and
//!   cost a 128-byte message five cache lines instead of three (2 ranks on 2 cores,
//!   one-shot all-reduce of 128 B: 0.55 → 0.45 µs, 8 B: 0.45 → 0.42 µs, measured side
//!   by side on 2026-11-27). LL geometries keep the device's slot size ([`Geometry::ll`]),
//!   so a host LL slot uses the first [`Geometry::payload`] + 8 of its bytes.
//!
//! Slot counts are powers of two, so `counter % slots` stays in step when the 32-bit
//! counters wrap.
//!
//! # Where a short message lies in its slot
//!
//! Writing a line that the other core read recently costs the writer an invalidation
//! of the reader's copy; writing one the reader's cache has since dropped does not. A
//! FIFO between ranks of one host therefore *rotates* short Simple messages through
//! their slot ([`SendEnd::set_rotating`]): the `k`-th use of a slot puts a message of `len`
//! bytes at `(k mod positions) × span`, with `span` = `len` rounded up to a cache line
//! and `positions` = how many spans the slot holds. Consecutive uses of the FIFO then
//! walk all of its memory (2 MiB by default: such FIFOs have `CommConfig::dedicated_slots`,
//! 16, see `TransportConfig::local_geometries`) instead of the first `len` bytes of each slot.
//! Only where every rank has a core of its own: ranks that take turns on a core find the
//! line in that core's cache anyway, and there the rotation measured up to 10 % slower (4 ranks on 2 cores, two-shot, 4–8 KiB and 64–128 KiB). Both ends compute the place from the slot's use number and byte count, so
//! nothing more is published. Measured, 2 ranks on 2 cores, one-shot all-reduce: 32
//! KiB from about 6 to 9–10 GB/s busbw (8 slots of 128 KiB; the same as giving the
//! FIFO 32 slots of 32 KiB, which slices larger messages finer). FIFOs that a proxy
//! drains or fills (TCP, RDMA) do not rotate: their messages are placed at the slot's
//! start.
//!
//! # Slots that change direction
//!
//! Between two ranks of one host there are two Simple FIFOs, one each way. Left alone,
//! each rank writes into the slots of the FIFO towards its peer, whose lines the peer's
//! cache took when it read them last: every line written costs the writer an
//! invalidation of the reader's copy, on top of the reader's fetch of the line. When
//! the two FIFOs *exchange slots* ([`exchange_slots`]) a rank writes what it sends into
//! the memory it has just read of what its peer sent it, lines its own cache holds, and
//! the peer's slot takes the memory that was waiting on this rank's side instead. Each
//! slot's record says where its data lies (`Place`: its FIFO's own memory, or the
//! other FIFO's), and only the end that owns the slot at the time writes it: the
//! receiver when it releases a slot (it swaps the released slot's memory with that of
//! its own next untouched slot the other way, if that one is free), the other end's
//! reader after the counter that hands the slot over. Both ends of both FIFOs thus
//! always agree on where a slot lies, and no memory is ever in two slots.
//!
//! Measured on an Intel Xeon host (2 vCPUs, 2026-11-30), 256 KiB each way through two
//! FIFOs of 8 × 128 KiB (`cargo bench --bench fifo`): 37.4–40.1 µs a round, 27.3–30.6
//! with the slots exchanged; the copy into the slots went from 16–17 µs to 6–7 (a C
//! model of the two loops, where the copy out stayed 18 µs); 2 ranks, 512 KiB
//! all-reduce, 300 calls: 91.7 → 68.4 µs out of place, 80.0 → 58.1 in place. Intel MPI's
//! `MPI_Sendrecv` of the same 256 KiB took 27–31 µs in the same minutes.
//! `FERROCCL_SLOT_EXCHANGE=0` turns it off; FIFOs that a proxy fills or drains (TCP,
//! RDMA) never exchange slots.
//!
//! The two LL FIFOs between two ranks exchange slots the same way, where every rank of
//! the host has a core (the transport decides), with two differences. An LL receiver
//! polls a slot's header instead of `head`, so it reads the slot's record before every
//! look: the sender writes a moved slot's record before its message, and a look at
//! memory the slot has just left finds no header of this FIFO with this use number
//! there (the FIFO from the higher rank sets `LL_DIRECTION` in its headers, so a
//! header the other way never passes for one of this FIFO's). And a receiver gives only
//! slots that carried [`LL_EXCHANGE_FROM`] bytes or more: a moved slot costs its next
//! reader the record's line from the other core, more than a short message saves. An
//! LL FIFO's records are a cache line each, since both ranks rewrite them at every
//! release. Measured on the same kind of host, 2 ranks, one-shot all-reduce of 2 KiB,
//! four rounds interleaved with Intel MPI: 0.89–0.94 µs → 0.76–0.86 (Intel MPI
//! 0.90–0.93); 512 B to 1 KiB, where nothing moves, unchanged.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::segment::Segment;
use crate::error::{Error, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"FCCLFIFO");
const GEOMETRY: usize = 8;
/// The receiver's verdict on the sender's cache (1: far; see `HandoffClock`), for the
/// sender to read. In the first line, beside words written once at formatting, so the
/// sender's look hits its own cache until the verdict changes.
const SENDER_FAR: usize = 16;
const HEAD: usize = 64;
const TAIL: usize = 128;
/// Per slot (by counter value modulo the slot count): its byte count, then where its
/// data lies ([`Place`]), 4 bytes each.
const SIZES: usize = 192;
/// Bytes per slot of the table at [`SIZES`].
const SLOT_RECORD: usize = 8;
/// Bytes per slot of the table at [`SIZES`] in an LL FIFO: a cache line each. Slots
/// that exchange memory have their records rewritten at every release, by both ranks
/// (the sender's slot `c + 1` beside the receiver's `c`), and each rank reads its own
/// next record before it writes a message: in a shared line that read would wait for
/// the line to come back from the other core.
const LL_SLOT_RECORD: usize = 64;
/// Where slot data starts (slots are page-aligned).
pub const DATA_OFFSET: usize = 4096;
/// Most slots a Simple FIFO can have (their byte counts and locations must fit before
/// [`DATA_OFFSET`]).
pub const MAX_SLOTS: usize = (DATA_OFFSET - SIZES) / SLOT_RECORD;
/// Most slots an LL FIFO can have (a line of record each).
pub const MAX_LL_SLOTS: usize = (DATA_OFFSET - SIZES) / LL_SLOT_RECORD;

pub use crate::plan::Protocol;

/// Bytes of one line of the device executor's LL slots: 4 of data, 4 of flag (see the
/// module documentation); they size every LL slot.
const LL_LINE: usize = 8;
/// Data bytes of one line of the device executor's LL slots.
const LL_DATA: usize = 4;
/// Bytes of an LL slot's header (use number and byte count), before the message.
const LL_HEADER: usize = 8;
/// In an LL header's low half, beside the byte count: set in the headers of one of the
/// two FIFOs between a pair of ranks that exchange slots (the FIFO from the higher rank),
/// so that a receiver looking for a message in memory its peer has just taken over never
/// takes a header the other way for its own (see "Slots that change direction").
const LL_DIRECTION: u64 = 1 << 31;
/// An LL receiver gives a drained slot's memory to its own FIFO the other way only when
/// the slot carried this many bytes or more (see "Slots that change direction"): a
/// slot that moves costs its next reader a look at the slot's record, which the other
/// rank wrote, before the header, and for short messages that look costs more than the
/// exchange saves.
pub const LL_EXCHANGE_FROM: usize = 2048;
/// Longest LL message that shares its header's cache line.
pub const LL_ONE_LINE: usize = 64 - LL_HEADER;
/// An LL receiver times the hand-off of one long message in this many
/// ([`RecvEnd::try_peek_judging`]): each timed look costs two reads of the time-stamp
/// counter between fences, and timing every one slowed 1 KiB calls by a fifth (2 ranks,
/// one-shot, near, 4 interleaved rounds: 0.21–0.23 µs → 0.26–0.27).
pub const LL_TIMED_EVERY: u32 = 4;

/// The shape of a FIFO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Number of slots.
    pub slots: usize,
    /// Bytes per slot in the shared segment (a multiple of 64).
    pub slot_bytes: usize,
    /// How slots are published.
    pub protocol: Protocol,
}

impl Geometry {
    /// An LL FIFO of `slots` slots carrying up to `payload` bytes each (`payload` should
    /// be a multiple of 64: [`Geometry::payload`] rounds down to one), sized for the
    /// device executor's slots, a flag in every 8-byte line; the host's need only the
    /// payload and an 8-byte header (see the module documentation).
    pub fn ll(slots: usize, payload: usize) -> Self {
        let lines = 1 + payload.div_ceil(LL_DATA);
        Geometry {
            slots,
            slot_bytes: (lines * LL_LINE).next_multiple_of(64),
            protocol: Protocol::LL,
        }
    }

    /// Most bytes one slot carries: the whole slot for Simple, the data half of every
    /// line but the first for LL (rounded down to 64 bytes: what the device executor's
    /// slots carry; the host's carry the same).
    pub fn payload(&self) -> usize {
        match self.protocol {
            Protocol::Simple | Protocol::SingleCopy => self.slot_bytes,
            Protocol::LL => (self.slot_bytes / LL_LINE - 1) * LL_DATA / 64 * 64,
        }
    }

    /// Bytes of each slot's record (byte count and place) before the slots.
    fn record_bytes(&self) -> usize {
        match self.protocol {
            Protocol::LL => LL_SLOT_RECORD,
            _ => SLOT_RECORD,
        }
    }

    /// Most slots a FIFO of this protocol can have: their records must fit before
    /// [`DATA_OFFSET`] ([`MAX_SLOTS`] for Simple, [`MAX_LL_SLOTS`] for LL).
    pub fn max_slots(&self) -> usize {
        match self.protocol {
            Protocol::LL => MAX_LL_SLOTS,
            _ => MAX_SLOTS,
        }
    }

    /// Checks the shape.
    pub fn validate(&self) -> Result<()> {
        // The largest power of two whose records fit.
        let max = 1 << self.max_slots().ilog2();
        if !(2..=max).contains(&self.slots) || !self.slots.is_power_of_two() {
            return Err(Error::invalid(format!(
                "FIFO slots {} is not a power of two in 2..={max} for {:?} (slots are \
                 found by their 32-bit counter modulo the slot count, which must divide \
                 2^32, and each has a record before the data)",
                self.slots, self.protocol
            )));
        }
        if self.slot_bytes < 64 || !self.slot_bytes.is_multiple_of(64) || self.slot_bytes > 1 << 30
        {
            return Err(Error::invalid(format!(
                "FIFO slot size {} is not a multiple of 64 bytes between 64 B and 1 GiB",
                self.slot_bytes
            )));
        }
        if self.payload() == 0 {
            return Err(Error::invalid(format!(
                "LL FIFO slot size {} leaves no room for data",
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
        let ll = u64::from(self.protocol == Protocol::LL);
        ll << 63 | (self.slots as u64) << 32 | self.slot_bytes as u64
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

    fn sender_far(&self) -> &AtomicU32 {
        self.u32_at(SENDER_FAR)
    }

    fn tail(&self) -> &AtomicU32 {
        self.u32_at(TAIL)
    }

    fn size_of(&self, slot: usize) -> &AtomicU32 {
        self.u32_at(SIZES + self.geometry.record_bytes() * slot)
    }

    /// The word saying where the data of slot `counter` lies ([`Place`]).
    fn place_word(&self, counter: u32) -> &AtomicU32 {
        self.u32_at(SIZES + self.geometry.record_bytes() * self.slot_of(counter) + 4)
    }

    /// Where the data of slot `counter` lies. Written only by the end that owns the
    /// slot (see "Slots that change direction"), and read by the other after the
    /// counter that hands the slot over (acquire), so a relaxed load suffices.
    fn place(&self, counter: u32) -> Place {
        Place::decode(
            self.place_word(counter).load(Ordering::Relaxed),
            self.slot_of(counter),
        )
    }

    fn set_place(&self, counter: u32, place: Place) {
        self.place_word(counter)
            .store(place.encode(), Ordering::Relaxed);
    }

    /// Slot `slot` of this FIFO's own memory.
    fn own_slot(&self, slot: usize) -> *mut u8 {
        assert!(slot < self.geometry.slots, "slot {slot} of a FIFO");
        // SAFETY: slot < slots, so the slot lies inside the segment.
        unsafe {
            self.seg
                .as_ptr()
                .add(DATA_OFFSET + slot * self.geometry.slot_bytes)
        }
    }

    /// LL: the header of the slot whose memory starts at `slot` (see the module
    /// documentation).
    ///
    /// # Safety
    /// `slot` is the start of a slot of this FIFO's memory or of its partner's (see
    /// "Slots that change direction"), both mapped as long as `self` lives.
    unsafe fn ll_header_at(&self, slot: *mut u8) -> &AtomicU64 {
        // SAFETY: the slot lies inside a mapped segment that lives as long as `self`
        // (caller's contract); it is page-aligned plus a multiple of 64, so 8-aligned;
        // both sides access the header only atomically.
        unsafe { &*(slot as *const AtomicU64) }
    }

    /// Where the message of the slot whose memory starts at `slot` starts: after the
    /// header for LL.
    fn message_at(&self, slot: *mut u8) -> *mut u8 {
        if self.geometry.protocol != Protocol::LL {
            return slot;
        }
        // SAFETY: the header plus the payload lie inside an LL slot.
        unsafe { slot.add(LL_HEADER) }
    }

    /// The slot of counter value `counter`: `counter % slots`, with a mask (the slot
    /// count is a power of two, [`Geometry::validate`]), because a division by a count
    /// read at run time costs a small call's poll loop tens of cycles per look.
    fn slot_of(&self, counter: u32) -> usize {
        counter as usize & (self.geometry.slots - 1)
    }

    /// Where the memory of slot `counter` lies: in this FIFO's own memory, or, when it
    /// exchanges slots with `partner`, wherever the slot's record says.
    fn slot_in_pair(&self, partner: Option<&Partner>, counter: u32) -> *mut u8 {
        match partner {
            None => self.slot_ptr(counter),
            Some(partner) => partner.resolve(self, counter),
        }
    }

    /// The slot of counter value `counter` where it was formatted, in this FIFO's own
    /// memory.
    fn slot_ptr(&self, counter: u32) -> *mut u8 {
        self.own_slot(self.slot_of(counter))
    }
}

/// Where the data of a Simple slot lies: in the FIFO's own memory, or in the memory of
/// the FIFO the other way between the same two ranks (see "Slots that change
/// direction"); either way by slot index in that memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Slot `i` of this FIFO's memory.
    Own(u32),
    /// Slot `i` of the other FIFO's memory.
    Partner(u32),
}

impl Place {
    /// Set in a location word for a slot of the other FIFO's memory.
    const PARTNER: u32 = 1 << 31;

    /// The place a location word names for the slot at index `slot`: 0 (as formatted)
    /// is the slot's own memory; otherwise [`Place::PARTNER`] plus an index, or an
    /// index plus one.
    fn decode(word: u32, slot: usize) -> Place {
        match word {
            0 => Place::Own(slot as u32),
            w if w & Self::PARTNER != 0 => Place::Partner(w & !Self::PARTNER),
            w => Place::Own(w - 1),
        }
    }

    fn encode(self) -> u32 {
        match self {
            Place::Own(i) => i + 1,
            Place::Partner(i) => Self::PARTNER | i,
        }
    }

    /// The same memory as the other FIFO of the pair names it.
    fn seen_from_partner(self) -> Place {
        match self {
            Place::Own(i) => Place::Partner(i),
            Place::Partner(i) => Place::Own(i),
        }
    }
}

/// The FIFO the other way between the same two ranks, when the two exchange slots
/// ([`exchange_slots`]).
struct Partner {
    /// Its memory (mapped by this rank's other end too).
    shared: Arc<Shared>,
    /// Shared by this rank's two ends of the pair.
    cursor: Arc<ExchangeCursor>,
}

/// What this rank's receiving end of a pair must know of its sending end to give it
/// the slots it drains.
#[derive(Debug)]
struct ExchangeCursor {
    /// The first counter value of the sending end not handed out yet (reserved): the
    /// sending end writes no slot from there on, so a drained slot may take its place.
    untouched: AtomicU32,
    /// The first counter value of the sending end not given a drained slot yet.
    given: AtomicU32,
    /// The last `tail` of the sending end's FIFO this rank loaded (acquire; the two
    /// ends of a pair are used by one thread): every slot before it is free, and what
    /// the peer placed there visible. Never ahead of `tail`, and less than two FIFOs
    /// behind the counters it is compared with (the sending end loads `tail` whenever
    /// its FIFO looks full).
    consumed: AtomicU32,
}

impl ExchangeCursor {
    /// Moves `at` forward to `counter`, never back (counters wrap).
    fn advance(at: &AtomicU32, counter: u32) {
        let now = at.load(Ordering::Relaxed);
        if counter.wrapping_sub(now) as i32 > 0 {
            at.store(counter, Ordering::Relaxed);
        }
    }
}

impl Partner {
    /// Where slot `counter` of `own` (this end's FIFO) lies.
    fn resolve(&self, own: &Shared, counter: u32) -> *mut u8 {
        match own.place(counter) {
            Place::Own(i) => own.own_slot(i as usize),
            Place::Partner(i) => self.shared.own_slot(i as usize),
        }
    }

    /// The receiving end's part of the exchange: slot `drained` of `own` (this end's
    /// FIFO) has been read; its memory goes to this rank's next untouched slot the other
    /// way if that one is free, and the memory that slot had comes back in its place.
    fn give_drained(&self, own: &Shared, drained: u32) {
        let cursor = &self.cursor;
        let untouched = cursor.untouched.load(Ordering::Relaxed);
        let given = cursor.given.load(Ordering::Relaxed);
        let next = if given.wrapping_sub(untouched) as i32 > 0 {
            given
        } else {
            untouched
        };
        // The slot `next` must be free: the peer consumed its previous use (and with it
        // may have placed memory there, which the acquire makes visible). A `tail` this
        // thread loaded before may already say so, without fetching the line the peer
        // writes at every release.
        let slots = self.shared.geometry.slots as u32;
        let mut consumed = cursor.consumed.load(Ordering::Relaxed);
        if next.wrapping_sub(consumed) >= slots {
            consumed = self.shared.tail().load(Ordering::Acquire);
            ExchangeCursor::advance(&cursor.consumed, consumed);
        }
        if next.wrapping_sub(consumed) < slots {
            let memory = own.place(drained);
            let spare = self.shared.place(next);
            self.shared.set_place(next, memory.seen_from_partner());
            own.set_place(drained, spare.seen_from_partner());
            cursor.given.store(next.wrapping_add(1), Ordering::Relaxed);
        }
    }
}

/// The use number in the header of the LL slot published as number `counter`: never 0
/// for the first use of a slot (whose header starts zeroed), never the number of the
/// slot's previous use.
fn ll_flag(counter: u32) -> u32 {
    counter.wrapping_add(1)
}

/// The byte count in an LL header (its low half, below [`LL_DIRECTION`]).
fn ll_len(header: u64) -> usize {
    (header & (LL_DIRECTION - 1)) as usize
}

/// Where in its slot a rotating FIFO places the message of `len` bytes published as
/// number `counter` (see the module documentation): 0 for messages longer than half a
/// slot, and for LL FIFOs, whose header leads the slot.
fn rotation(geometry: Geometry, counter: u32, len: usize) -> usize {
    use crate::reduce::LINE;
    let payload = geometry.payload();
    if geometry.protocol == Protocol::LL || len == 0 || len > payload / 2 {
        return 0;
    }
    let span = len.next_multiple_of(LINE);
    let positions = payload / span;
    // Slot counts are powers of two, so the use number keeps counting when `counter`
    // wraps (both ends see the same counters).
    let use_of_slot = (counter as usize) / geometry.slots;
    (use_of_slot % positions) * span
}

/// How long a receiver's look at `head` (or at an LL slot's header) took when it found
/// a new slot: the time the line took to come from the sender's cache. A peer whose lines come from a far cache
/// (another CCD or socket; on this project's VM, whenever the hypervisor places the two
/// vCPUs apart) takes about 0.2 µs where a near one takes 0.05, and then data written
/// into its slots with plain stores also crawls over (2 ranks, 32 KiB: 1.6 GB/s against
/// 9). The engine writes slots towards a far peer with non-temporal stores, which reach
/// the reader through memory instead (6 GB/s in the far placement, but 23–35 % slower
/// than plain stores in the near one, hence the measurement).
#[derive(Debug)]
struct HandoffClock {
    /// Hand-offs timed in the current window.
    timed: u32,
    /// How many of them were slow.
    slow: u32,
    /// The last full window's verdict: most of its hand-offs were slow.
    far: bool,
    /// [`HandoffClock::FAR`] in time-stamp counter cycles.
    far_cycles: u64,
}

impl HandoffClock {
    /// Hand-offs per verdict. The majority decides: an interrupt makes one look slow,
    /// and a look that finds the line already fetched (this VM's time-stamp counter
    /// also reads 0 for many) makes one fast, in either placement.
    const WINDOW: u32 = 16;
    /// A hand-off slower than this is far. Measured on this project's VMs: 0.04–0.05 µs
    /// near, 0.14–0.26 µs far (`ferroccl-limits`' floor). It was 300 counter cycles until
    /// 2026-11-30, 0.1 µs at 3 GHz; but the counter runs at the host's own rate (2.6 GHz
    /// on the Zen hosts, 2.1 on the Intel ones), and at 2.1 GHz 300 cycles are 0.14 µs,
    /// inside the far range: 2 ranks far, 2 MiB, 500 calls, the verdict changed 177–190
    /// times (twice with this threshold, both to far).
    const FAR: Duration = Duration::from_nanos(100);

    /// A clock with no hand-off timed yet and its sender near.
    fn new() -> Self {
        HandoffClock {
            timed: 0,
            slow: 0,
            far: false,
            far_cycles: counter_cycles_per_ms() * Self::FAR.as_nanos() as u64 / 1_000_000,
        }
    }

    /// Counts one hand-off; returns the new verdict when a full window changes it.
    fn record(&mut self, cycles: u64) -> Option<bool> {
        self.timed += 1;
        self.slow += u32::from(cycles > self.far_cycles);
        if self.timed == Self::WINDOW {
            let far = self.slow > Self::WINDOW / 2;
            if far != self.far {
                tracing::debug!(
                    "FIFO: the sender's cache is now {} ({} of {} hand-offs slower than {} \
                     cycles)",
                    if far { "far" } else { "near" },
                    self.slow,
                    Self::WINDOW,
                    self.far_cycles
                );
            }
            let changed = far != self.far;
            self.far = far;
            self.timed = 0;
            self.slow = 0;
            return changed.then_some(far);
        }
        None
    }
}

/// How long the time-stamp counter is measured against the monotonic clock.
const COUNTER_CALIBRATION: Duration = Duration::from_millis(1);

/// The time-stamp counter's cycles per millisecond (0 where there is no such counter),
/// measured once per process against the monotonic clock: both run at a constant rate
/// whatever the core does, so a spin that the scheduler interrupts still measures it.
fn counter_cycles_per_ms() -> u64 {
    static PER_MS: OnceLock<u64> = OnceLock::new();
    *PER_MS.get_or_init(|| {
        if !cfg!(target_arch = "x86_64") {
            return 0;
        }
        let start = Instant::now();
        let (elapsed, cycles) = timed(|| {
            while start.elapsed() < COUNTER_CALIBRATION {
                std::hint::spin_loop();
            }
            start.elapsed()
        });
        (u128::from(cycles) * 1_000_000 / elapsed.as_nanos().max(1)) as u64
    })
}

/// Runs `load` and counts the time-stamp counter cycles it took (0 where there is no
/// such counter).
fn timed<T>(load: impl FnOnce() -> T) -> (T, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_lfence, _rdtsc};
        // SAFETY: `lfence` and `rdtsc` exist on every x86-64 CPU and touch no memory;
        // the fences keep the load between the two readings of the counter.
        let start = unsafe {
            _mm_lfence();
            let start = _rdtsc();
            _mm_lfence();
            start
        };
        let v = load();
        // SAFETY: as above.
        let end = unsafe {
            _mm_lfence();
            _rdtsc()
        };
        (v, end.saturating_sub(start))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        (load(), 0)
    }
}

/// The sending end of a FIFO.
pub struct SendEnd {
    shared: Arc<Shared>,
    /// Next slot to publish.
    head: u32,
    /// Last value of `tail` seen (only grows).
    tail_seen: u32,
    /// Short messages rotate through their slot (see the module documentation).
    rotating: bool,
    /// The byte count [`SendEnd::try_reserve`] placed the reserved message for.
    reserved: usize,
    /// The FIFO the other way, when the two exchange slots ([`exchange_slots`]).
    partner: Option<Partner>,
    /// 0, or [`LL_DIRECTION`] in every LL header of this FIFO ([`exchange_slots`]).
    ll_direction: u64,
}

/// The receiving end of a FIFO.
pub struct RecvEnd {
    shared: Arc<Shared>,
    /// Next slot to consume.
    tail: u32,
    /// Last value of `head` seen.
    head_seen: u32,
    /// Short messages rotate through their slot (see the module documentation).
    rotating: bool,
    /// How far the sender's cache is ([`SendEnd::receiver_finds_far`]).
    handoffs: HandoffClock,
    /// The FIFO the other way, when the two exchange slots ([`exchange_slots`]).
    partner: Option<Partner>,
    /// 0, or [`LL_DIRECTION`] in every LL header of this FIFO ([`exchange_slots`]).
    ll_direction: u64,
}

/// Formats a new FIFO in `seg` (created by the receiver) and returns its receiving end.
pub fn recv_end(seg: Segment, geometry: Geometry) -> Result<RecvEnd> {
    Ok(RecvEnd {
        shared: Arc::new(Shared::format(seg, geometry)?),
        tail: 0,
        head_seen: 0,
        rotating: false,
        handoffs: HandoffClock::new(),
        partner: None,
        ll_direction: 0,
    })
}

/// Attaches the sending end to a FIFO the receiver formatted in `seg`.
pub fn send_end(seg: Segment, geometry: Geometry, name: &str) -> Result<SendEnd> {
    Ok(SendEnd {
        shared: Arc::new(Shared::attach(seg, geometry, name)?),
        head: 0,
        tail_seen: 0,
        rotating: false,
        reserved: 0,
        partner: None,
        ll_direction: 0,
    })
}

/// Lets `send` (this rank's sending end towards a peer) and `recv` (its receiving end
/// from the same peer) exchange slots: `recv` gives every slot it drains to `send`'s
/// next untouched counter value, in return for the slot that was there (see "Slots that
/// change direction" in the module documentation; an LL FIFO gives only slots that
/// carried [`LL_EXCHANGE_FROM`] bytes or more). `lower` says whether this rank's number
/// is the lower of the two (the peer passes the opposite), which tells the two FIFOs'
/// LL headers apart. The peer must pair its two ends of the same two FIFOs before it
/// uses either again, and both before this rank uses either again. Only for FIFOs of one
/// shape (Simple or LL) that the engine alone writes and reads (no proxy), with no slot
/// reserved or peeked, and for LL every message published read; pairing twice is an
/// error.
pub fn exchange_slots(send: &mut SendEnd, recv: &mut RecvEnd, lower: bool) -> Result<()> {
    let (g, h) = (send.shared.geometry, recv.shared.geometry);
    if g != h || g.protocol == Protocol::SingleCopy {
        return Err(Error::invalid(format!(
            "FIFOs of shapes {g:?} and {h:?} cannot exchange slots (Simple or LL FIFOs of \
             one shape only)"
        )));
    }
    if send.partner.is_some() || recv.partner.is_some() {
        return Err(Error::invalid("a FIFO end already exchanges slots"));
    }
    // An LL message published before the pairing carries no direction, and its reader
    // would wait for one; ranks pair between calls, when every message has been read.
    let unread = send
        .head
        .wrapping_sub(send.shared.tail().load(Ordering::Acquire));
    if g.protocol == Protocol::LL && unread != 0 {
        return Err(Error::invalid(format!(
            "an LL FIFO cannot start exchanging slots with {unread} message(s) its peer \
             has not read"
        )));
    }
    let cursor = Arc::new(ExchangeCursor {
        untouched: AtomicU32::new(send.head),
        given: AtomicU32::new(send.head),
        consumed: AtomicU32::new(send.tail_seen),
    });
    // The FIFO from the higher rank marks its headers.
    (send.ll_direction, recv.ll_direction) = match lower {
        true => (0, LL_DIRECTION),
        false => (LL_DIRECTION, 0),
    };
    send.partner = Some(Partner {
        shared: recv.shared.clone(),
        cursor: cursor.clone(),
    });
    recv.partner = Some(Partner {
        shared: send.shared.clone(),
        cursor,
    });
    Ok(())
}

impl SendEnd {
    /// Most bytes one slot carries.
    pub fn payload(&self) -> usize {
        self.shared.geometry.payload()
    }

    /// The FIFO's whole segment (header and slots), for registering it with a NIC.
    pub fn memory(&self) -> (*mut u8, usize) {
        (self.shared.seg.as_ptr(), self.shared.seg.len())
    }

    /// Whether this end exchanges slots with the FIFO the other way
    /// ([`exchange_slots`]).
    pub fn exchanges_slots(&self) -> bool {
        self.partner.is_some()
    }

    /// Slots this end has published so far (its `head`).
    pub fn published(&self) -> u32 {
        self.head
    }

    /// Whether the receiver finds this end's slots coming from a far cache (see
    /// `HandoffClock`): most of the last 16 hand-offs it timed took more than 0.1 µs to
    /// reach it (every hand-off of a Simple FIFO, through `head`; an LL FIFO's receiver
    /// times the headers of long messages only, [`RecvEnd::try_peek_judging`]). The
    /// receiver publishes its verdict in the FIFO.
    pub fn receiver_finds_far(&self) -> bool {
        self.shared.sender_far().load(Ordering::Relaxed) != 0
    }

    /// Slots the receiver has consumed so far (its `tail`).
    pub fn consumed(&self) -> u32 {
        self.shared.tail().load(Ordering::Acquire)
    }

    /// Whether short messages rotate through their slot (see the module
    /// documentation); the receiving end must be set the same way, before the first
    /// message. For FIFOs that only the engine writes and reads.
    pub fn set_rotating(&mut self, on: bool) {
        self.rotating = on;
    }

    /// Where the message of slot `counter` starts: in its own memory, or where a paired
    /// FIFO moved the slot. Called once the slot is this end's (after `tail`).
    fn message_start(&self, counter: u32) -> *mut u8 {
        if let Some(partner) = &self.partner {
            ExchangeCursor::advance(&partner.cursor.untouched, counter.wrapping_add(1));
        }
        self.shared.message_at(self.slot(counter))
    }

    /// Where the memory of slot `counter` lies ([`Shared::slot_in_pair`]).
    fn slot(&self, counter: u32) -> *mut u8 {
        self.shared.slot_in_pair(self.partner.as_ref(), counter)
    }

    /// Loads the receiver's `tail` (acquire), and tells the receiving end of a pair.
    fn load_tail(&mut self) {
        self.tail_seen = self.shared.tail().load(Ordering::Acquire);
        if let Some(partner) = &self.partner {
            ExchangeCursor::advance(&partner.cursor.consumed, self.tail_seen);
        }
    }

    /// Whether the next slot is free (the FIFO is not full).
    pub fn has_room(&mut self) -> bool {
        let slots = self.shared.geometry.slots as u32;
        if self.head.wrapping_sub(self.tail_seen) >= slots {
            self.load_tail();
            if self.head.wrapping_sub(self.tail_seen) >= slots {
                return false;
            }
        }
        true
    }

    /// Where to write a message of `len` bytes in the next free slot, or `None` if the
    /// FIFO is full. The slot stays this end's until [`SendEnd::commit`], which must be
    /// given the same `len`.
    pub fn try_reserve(&mut self, len: usize) -> Option<*mut u8> {
        if !self.has_room() {
            return None;
        }
        let slot = self.message_start(self.head);
        if !self.rotating {
            return Some(slot);
        }
        self.reserved = len;
        // SAFETY: the rotation plus `len` stays inside the slot's payload.
        Some(unsafe { slot.add(rotation(self.shared.geometry, self.head, len)) })
    }

    /// Like [`SendEnd::try_reserve`] for the slot `ahead` places after the next one to
    /// publish, so several writers can fill slots at once; they are still published in
    /// order by [`SendEnd::commit`].
    pub fn try_reserve_ahead(&mut self, ahead: u32) -> Option<*mut u8> {
        assert!(
            !self.rotating,
            "a rotating FIFO reserves one slot at a time"
        );
        let slots = self.shared.geometry.slots as u32;
        let wanted = self.head.wrapping_add(ahead);
        if wanted.wrapping_sub(self.tail_seen) >= slots {
            self.load_tail();
            if wanted.wrapping_sub(self.tail_seen) >= slots {
                return None;
            }
        }
        Some(self.message_start(wanted))
    }

    /// Publishes the reserved slot holding `len` bytes.
    pub fn commit(&mut self, len: usize) {
        assert!(
            len <= self.payload(),
            "{len} bytes committed to a slot of {}",
            self.payload()
        );
        if self.shared.geometry.protocol == Protocol::LL {
            // The message is in place: the header publishes it.
            let header = u64::from(ll_flag(self.head)) << 32 | self.ll_direction | len as u64;
            // SAFETY: the slot's memory, as `slot` finds it.
            unsafe { self.shared.ll_header_at(self.slot(self.head)) }
                .store(header, Ordering::Release);
            self.head = self.head.wrapping_add(1);
            return;
        }
        assert!(
            !self.rotating || len == self.reserved,
            "{len} bytes committed to a slot reserved for {}",
            self.reserved
        );
        let slot = self.shared.slot_of(self.head);
        self.shared
            .size_of(slot)
            .store(len as u32, Ordering::Relaxed);
        self.head = self.head.wrapping_add(1);
        self.shared.head().store(self.head, Ordering::Release);
    }
}

impl RecvEnd {
    /// Whether to read short messages where a rotating sender puts them
    /// ([`SendEnd::set_rotating`]); set before the first message.
    pub fn set_rotating(&mut self, on: bool) {
        self.rotating = on;
    }

    /// Slot `counter`, published with `len` bytes: where its message starts.
    fn message_ptr(&self, counter: u32, len: usize) -> *const u8 {
        let slot = self.slot(counter);
        if !self.rotating {
            return slot;
        }
        // SAFETY: the rotation plus `len` stays inside the slot's payload.
        unsafe { slot.add(rotation(self.shared.geometry, counter, len)) }
    }

    /// Where the memory of slot `counter` lies ([`Shared::slot_in_pair`]).
    fn slot(&self, counter: u32) -> *mut u8 {
        self.shared.slot_in_pair(self.partner.as_ref(), counter)
    }

    /// Most bytes one slot carries.
    pub fn payload(&self) -> usize {
        self.shared.geometry.payload()
    }

    /// The FIFO's whole segment (header and slots), for registering it with a NIC.
    pub fn memory(&self) -> (*mut u8, usize) {
        (self.shared.seg.as_ptr(), self.shared.seg.len())
    }

    /// The oldest published slot and its byte count, or `None` if the FIFO is empty. The
    /// slot stays readable until [`RecvEnd::release`].
    pub fn try_peek(&mut self) -> Option<(*const u8, usize)> {
        if self.shared.geometry.protocol == Protocol::LL {
            return self.ll_peek(self.tail);
        }
        if self.tail == self.head_seen {
            let (head, cycles) = timed(|| self.shared.head().load(Ordering::Acquire));
            if head == self.head_seen {
                return None;
            }
            // The line changed hands since the last look: the load fetched it from the
            // sender's cache.
            self.judge_handoff(cycles);
            self.head_seen = head;
        }
        let slot = self.shared.slot_of(self.tail);
        let len = self.shared.size_of(slot).load(Ordering::Relaxed) as usize;
        Some((self.message_ptr(self.tail, len), len))
    }

    /// Like [`RecvEnd::try_peek`]; on an LL FIFO, the look that finds the message of
    /// every [`LL_TIMED_EVERY`]-th slot is also timed for the verdict on the sender's
    /// cache ([`SendEnd::receiver_finds_far`]), which a Simple FIFO keeps at every look.
    /// For messages long enough that the sender might stream them.
    pub fn try_peek_judging(&mut self) -> Option<(*const u8, usize)> {
        if self.shared.geometry.protocol != Protocol::LL
            || !self.tail.is_multiple_of(LL_TIMED_EVERY)
        {
            return self.try_peek();
        }
        let (found, cycles) = timed(|| self.ll_peek(self.tail));
        if found.is_some() {
            self.judge_handoff(cycles);
        }
        found
    }

    /// Like [`RecvEnd::try_peek`] for the slot `ahead` places after the oldest, so
    /// several readers can work on slots at once; they are still released in order.
    pub fn try_peek_ahead(&mut self, ahead: u32) -> Option<(*const u8, usize)> {
        let wanted = self.tail.wrapping_add(ahead);
        if self.shared.geometry.protocol == Protocol::LL {
            return self.ll_peek(wanted);
        }
        if self.head_seen.wrapping_sub(self.tail) <= ahead {
            self.head_seen = self.shared.head().load(Ordering::Acquire);
            if self.head_seen.wrapping_sub(self.tail) <= ahead {
                return None;
            }
        }
        let slot = self.shared.slot_of(wanted);
        let len = self.shared.size_of(slot).load(Ordering::Relaxed) as usize;
        Some((self.message_ptr(wanted, len), len))
    }

    /// LL: the message of the slot published as number `counter` and its byte count, if
    /// its header carries that number.
    fn ll_peek(&self, counter: u32) -> Option<(*const u8, usize)> {
        // With slots exchanged, the record says where to look; the sender writes it
        // before the message, and a look at memory the slot has since left finds no
        // header of this FIFO with this number there (see "Slots that change direction").
        let slot = self.slot(counter);
        // SAFETY: the slot's memory, as `slot` finds it.
        let header = unsafe { self.shared.ll_header_at(slot) }.load(Ordering::Acquire);
        if header >> 31 != u64::from(ll_flag(counter)) << 1 | self.ll_direction >> 31 {
            return None;
        }
        let len = ll_len(header).min(self.shared.geometry.payload());
        Some((self.shared.message_at(slot) as *const u8, len))
    }

    /// Whether the drained slot `counter` goes to the FIFO the other way: always for
    /// Simple, for LL if it carried [`LL_EXCHANGE_FROM`] bytes or more.
    fn worth_exchanging(&self, counter: u32) -> bool {
        if self.shared.geometry.protocol != Protocol::LL {
            return true;
        }
        // SAFETY: the slot's memory, as `slot` finds it (still this end's).
        let header = unsafe { self.shared.ll_header_at(self.slot(counter)) };
        ll_len(header.load(Ordering::Relaxed)) >= LL_EXCHANGE_FROM
    }

    /// Counts a hand-off that took `cycles` and publishes a changed verdict for the
    /// sender, which is the one to act on it.
    fn judge_handoff(&mut self, cycles: u64) {
        if let Some(far) = self.handoffs.record(cycles) {
            self.shared
                .sender_far()
                .store(u32::from(far), Ordering::Relaxed);
        }
    }

    /// Hands the slot from [`RecvEnd::try_peek`] back to the sender: when the two FIFOs
    /// exchange slots, its memory goes to this rank's next untouched slot the other way,
    /// and the memory that slot had comes back in its place (see "Slots that change
    /// direction").
    pub fn release(&mut self) {
        if let Some(partner) = &self.partner
            && self.worth_exchanging(self.tail)
        {
            partner.give_drained(&self.shared, self.tail);
        }
        self.tail = self.tail.wrapping_add(1);
        self.shared.tail().store(self.tail, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::super::segment::SegmentKind;
    use super::*;

    /// Both ends of a new in-process FIFO of shape `g`.
    fn pair(g: Geometry, tag: &str) -> (SendEnd, RecvEnd) {
        let name = format!("ferroccl-test-fifo-{tag}-{}", std::process::id());
        let seg = Segment::create(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        let rx = recv_end(seg, g).unwrap();
        let seg = Segment::open(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        let tx = send_end(seg, g, &name).unwrap();
        Segment::unlink(SegmentKind::InProcess, &name);
        (tx, rx)
    }

    /// Message `i`: its length (1 to 64 bytes, so LL's partial last lines are covered)
    /// and its bytes.
    fn message(i: u32) -> Vec<u8> {
        let len = 1 + (i as usize * 7) % 64;
        (0..len).map(|k| (i as usize * 31 + k) as u8).collect()
    }

    #[test]
    fn slots_flow_in_order_and_the_fifo_fills_up() {
        let simple = Geometry {
            slots: 4,
            slot_bytes: 64,
            protocol: Protocol::Simple,
        };
        for g in [simple, Geometry::ll(4, 64), Geometry::ll(2, 128)] {
            assert!(g.validate().is_ok() && g.payload() >= 64, "{g:?}");
            let (mut tx, mut rx) = pair(g, "order");
            let producer = std::thread::spawn(move || {
                for i in 0..3000u32 {
                    let m = message(i);
                    let slot = loop {
                        if let Some(p) = tx.try_reserve(m.len()) {
                            break p;
                        }
                        std::hint::spin_loop();
                    };
                    // SAFETY: the reserved slot holds at least 64 bytes and is ours
                    // until commit.
                    unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), slot, m.len()) };
                    tx.commit(m.len());
                }
            });
            for i in 0..3000u32 {
                let (p, len) = loop {
                    if let Some(s) = rx.try_peek() {
                        break s;
                    }
                    std::hint::spin_loop();
                };
                // SAFETY: the peeked slot holds `len` published bytes until release.
                let got = unsafe { std::slice::from_raw_parts(p, len) }.to_vec();
                assert_eq!(got, message(i), "{:?} message {i}", g.protocol);
                rx.release();
            }
            producer.join().unwrap();
            assert!(rx.try_peek().is_none());
        }
    }

    #[test]
    fn an_ll_slot_is_seen_only_when_its_header_carries_its_use_number() {
        let g = Geometry::ll(2, 64);
        let (mut tx, mut rx) = pair(g, "ll-header");
        for round in 0..4u32 {
            let slot = tx.try_reserve(10).unwrap();
            // SAFETY: the reserved slot holds at least 64 bytes and is ours until commit.
            unsafe { std::ptr::write_bytes(slot, round as u8 + 1, 10) };
            tx.commit(10);
            // The header as it was before this commit (never written, then the previous
            // use's): the slot is not ready.
            // SAFETY: a slot of this FIFO's own memory.
            let header = unsafe { tx.shared.ll_header_at(tx.shared.slot_ptr(round)) };
            let written = header.load(Ordering::Relaxed);
            let stale = if round < 2 {
                0
            } else {
                u64::from(ll_flag(round - 2)) << 32 | 10
            };
            header.store(stale, Ordering::Relaxed);
            assert!(
                rx.try_peek().is_none(),
                "round {round}: a stale header was taken"
            );
            header.store(written, Ordering::Relaxed);
            let (p, len) = rx.try_peek().expect("the header is written");
            // A second look (the engine's outgoing FIFO was full) finds the same message.
            assert_eq!(rx.try_peek(), Some((p, len)));
            // SAFETY: the slot holds `len` bytes until release.
            let got = unsafe { std::slice::from_raw_parts(p, len) };
            assert_eq!(got, &[round as u8 + 1; 10]);
            // A short message shares its header's cache line.
            let line = header as *const AtomicU64 as usize / 64;
            assert_eq!((p as usize / 64, (p as usize + len - 1) / 64), (line, line));
            rx.release();
        }
    }

    #[test]
    fn ll_slots_are_filled_and_read_ahead_in_place() {
        // Several writers fill slots ahead of the next one to publish, and several
        // readers look ahead of the oldest: for LL too, every look finds the slot's
        // message after its header, and only once its header is published.
        let (mut tx, mut rx) = pair(Geometry::ll(4, 64), "ll-ahead");
        for ahead in 0..3u32 {
            let p = tx.try_reserve_ahead(ahead).expect("room");
            // SAFETY: the slot holds 64 bytes and is this end's until committed.
            unsafe { std::ptr::write_bytes(p, ahead as u8 + 1, 20) };
        }
        assert!(tx.try_reserve_ahead(4).is_none(), "4 slots only");
        assert!(rx.try_peek_ahead(0).is_none(), "nothing published yet");
        for _ in 0..3 {
            tx.commit(20);
        }
        for ahead in [2u32, 0, 1] {
            let (p, len) = rx.try_peek_ahead(ahead).expect("published");
            assert_eq!(len, 20);
            // SAFETY: 20 published bytes, readable until release.
            let got = unsafe { std::slice::from_raw_parts(p, len) };
            assert_eq!(got, &[ahead as u8 + 1; 20]);
        }
        assert!(rx.try_peek_ahead(3).is_none(), "slot 3 not published");
    }

    #[test]
    fn ll_messages_fill_the_payload_of_every_geometry() {
        for (slots, payload) in [(2, 64), (4, 128), (8, 4096), (2, 1 << 20)] {
            let g = Geometry::ll(slots, payload);
            assert_eq!(g.payload(), payload);
            assert!(LL_HEADER + g.payload() <= g.slot_bytes, "{g:?}");
            let (mut tx, mut rx) = pair(g, "ll-full");
            for round in 0..2 * slots as u32 {
                let len = if round % 2 == 0 { payload } else { LL_ONE_LINE };
                let slot = tx.try_reserve(len).unwrap();
                let fill = |k: usize| (k as u32 * 7 + round) as u8;
                for k in 0..len {
                    // SAFETY: the reserved slot holds `payload` bytes until commit.
                    unsafe { slot.add(k).write(fill(k)) };
                }
                tx.commit(len);
                let (p, got) = rx.try_peek().expect("published");
                assert_eq!(got, len);
                // SAFETY: `len` published bytes, readable until release.
                let bytes = unsafe { std::slice::from_raw_parts(p, len) };
                assert!(bytes.iter().enumerate().all(|(k, &b)| b == fill(k)));
                rx.release();
            }
        }
    }

    /// Both ends as if `counter` slots had already gone through.
    fn start_at(tx: &mut SendEnd, rx: &mut RecvEnd, counter: u32) {
        tx.head = counter;
        tx.tail_seen = counter;
        rx.tail = counter;
        rx.head_seen = counter;
        tx.shared.head().store(counter, Ordering::Relaxed);
        rx.shared.tail().store(counter, Ordering::Relaxed);
    }

    /// Rank A's and rank B's ends of the two FIFOs between them, shape `g`, each rank's
    /// two ends exchanging slots: `(a_send, a_recv, b_send, b_recv)`.
    fn exchanging(g: Geometry, tag: &str) -> (SendEnd, RecvEnd, SendEnd, RecvEnd) {
        let (mut a_send, mut b_recv) = pair(g, &format!("{tag}-ab"));
        let (mut b_send, mut a_recv) = pair(g, &format!("{tag}-ba"));
        exchange_slots(&mut a_send, &mut a_recv, true).unwrap();
        exchange_slots(&mut b_send, &mut b_recv, false).unwrap();
        (a_send, a_recv, b_send, b_recv)
    }

    #[test]
    fn a_rank_sends_in_the_memory_it_has_just_drained() {
        let simple = Geometry {
            slots: 4,
            slot_bytes: 128,
            protocol: Protocol::Simple,
        };
        let ll = Geometry::ll(4, 2 * LL_EXCHANGE_FROM);
        // (shape, A's length, B's length): LL slots move only for long messages.
        for (g, a_len, b_len) in [
            (simple, 100, 50),
            (ll, LL_EXCHANGE_FROM, 2 * LL_EXCHANGE_FROM),
        ] {
            let tag = format!("drained-{:?}", g.protocol);
            let (mut a_send, mut a_recv, mut b_send, mut b_recv) = exchanging(g, &tag);
            let mut last_drained = None;
            for round in 0..40u32 {
                // A sends, B drains and answers: B's answer goes out in A's memory.
                let slot = a_send.try_reserve(a_len).unwrap();
                if let Some(drained) = last_drained {
                    assert_eq!(slot, drained, "{tag}, round {round}: A wrote elsewhere");
                }
                // SAFETY: the reserved slot holds `a_len` bytes and is A's until commit.
                unsafe { std::ptr::write_bytes(slot, round as u8, a_len) };
                a_send.commit(a_len);
                let (p, len) = b_recv.try_peek().unwrap();
                assert_eq!((p, len), (slot as *const u8, a_len));
                // SAFETY: `len` published bytes, B's until release.
                assert!(
                    unsafe { std::slice::from_raw_parts(p, len) }
                        .iter()
                        .all(|&b| b == round as u8)
                );
                b_recv.release();
                let answer = b_send.try_reserve(b_len).unwrap();
                assert_eq!(
                    answer, slot,
                    "{tag}, round {round}: B answers in the slot it drained"
                );
                // SAFETY: as above, B's until commit.
                unsafe { std::ptr::write_bytes(answer, !(round as u8), b_len) };
                b_send.commit(b_len);
                let (q, len) = a_recv.try_peek().unwrap();
                // SAFETY: as above.
                let got = unsafe { std::slice::from_raw_parts(q, len) };
                assert!(
                    len == b_len && got.iter().all(|&b| b == !(round as u8)),
                    "{tag}, round {round}"
                );
                a_recv.release();
                last_drained = Some(q as *mut u8);
            }
        }
        let g = simple;
        let (_, mut a_recv, _, _) = exchanging(g, "drained-paired");
        // An LL FIFO with a message not yet read cannot pair (its header carries no
        // direction); once it is read, it can.
        let ll = Geometry::ll(4, 64);
        let (mut tx, mut rx) = pair(ll, "drained-unread");
        let (mut tx_back, mut rx_back) = pair(ll, "drained-unread-back");
        tx.try_reserve(8).unwrap();
        tx.commit(8);
        let err = exchange_slots(&mut tx, &mut rx_back, true).unwrap_err();
        assert!(err.to_string().contains("1 message(s)"), "{err}");
        rx.try_peek().unwrap();
        rx.release();
        exchange_slots(&mut tx, &mut rx_back, true).unwrap();
        exchange_slots(&mut tx_back, &mut rx, false).unwrap();
        // FIFOs of two shapes cannot pair, nor can a paired end pair again.
        let (mut tx, _rx) = pair(Geometry::ll(4, 64), "drained-ll");
        let (_tx, mut rx) = pair(g, "drained-simple");
        assert!(exchange_slots(&mut tx, &mut rx, true).is_err());
        let (mut tx2, _) = pair(g, "drained-again");
        assert!(exchange_slots(&mut tx2, &mut a_recv, true).is_err());
    }

    /// Message `i` for a slot of `payload` bytes: [`message`], or for LL slots that
    /// move (`long`), 1 byte to `payload`, half of them long enough to move the slot.
    fn message_for(i: u32, payload: usize, long: bool) -> Vec<u8> {
        if !long {
            return message(i);
        }
        let len = 1 + (i as usize).wrapping_mul(2_654_435_761) % payload;
        (0..len).map(|k| (i as usize * 31 + k) as u8).collect()
    }

    #[test]
    fn exchanging_ranks_deliver_every_message_whatever_the_traffic() {
        // Two ranks on two threads send each other messages in bursts of 0 to 7 (one way
        // only, the other, or both), reserving and reading up to 3 slots ahead, from
        // counters about to wrap; every message arrives whole and in order. LL messages
        // run from 1 byte to the payload, so some move their slot and some do not.
        let simple = |slots| Geometry {
            slots,
            slot_bytes: 256,
            protocol: Protocol::Simple,
        };
        let ll = |slots| Geometry::ll(slots, 2 * LL_EXCHANGE_FROM);
        for (g, rotating) in [
            (simple(2), false),
            (simple(4), true),
            (simple(8), false),
            (ll(2), false),
            (ll(8), false),
        ] {
            let (slots, long) = (g.slots, g.protocol == Protocol::LL);
            let payload = g.payload();
            let tag = format!("traffic-{slots}-{:?}", g.protocol);
            let (mut a_send, mut a_recv, mut b_send, mut b_recv) = exchanging(g, &tag);
            let start = u32::MAX - 40;
            start_at(&mut a_send, &mut b_recv, start);
            start_at(&mut b_send, &mut a_recv, start);
            for end in [&mut a_send, &mut b_send] {
                end.set_rotating(rotating);
                let cursor = &end.partner.as_ref().unwrap().cursor;
                cursor.untouched.store(start, Ordering::Relaxed);
                cursor.given.store(start, Ordering::Relaxed);
                cursor.consumed.store(start, Ordering::Relaxed);
            }
            a_recv.set_rotating(rotating);
            b_recv.set_rotating(rotating);
            // Burst sizes, the same list on both threads: rank A sends bursts[i] in round
            // i, rank B bursts[i + 1].
            let bursts: Vec<u32> = (0..400u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 7) % 8)
                .collect();
            let deadline = Instant::now() + Duration::from_secs(30);
            let run = |tx: &mut SendEnd, rx: &mut RecvEnd, me: u32, peer: u32| {
                let (mut sent, mut got) = (0u32, 0u32);
                for round in 0..bursts.len() - 1 {
                    let (mine, theirs) = if me == 0 {
                        (bursts[round], bursts[round + 1])
                    } else {
                        (bursts[round + 1], bursts[round])
                    };
                    // Send in groups of up to 3 reserved ahead, receive likewise; take
                    // what has come whenever the FIFO is full, so neither side waits
                    // for the other forever.
                    let (mut to_send, mut to_get) = (mine, theirs);
                    while to_send > 0 || to_get > 0 {
                        let ahead = to_send.min(3).min(slots as u32);
                        if ahead > 0 {
                            let mut reserved = Vec::new();
                            for k in 0..ahead {
                                let m = message_for(me * 100_000 + sent + k, payload, long);
                                let Some(p) = (if rotating {
                                    (k == 0).then(|| tx.try_reserve(m.len())).flatten()
                                } else {
                                    tx.try_reserve_ahead(k)
                                }) else {
                                    break;
                                };
                                // SAFETY: the slot holds `payload` bytes and is this
                                // end's until commit.
                                unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), p, m.len()) };
                                reserved.push(m.len());
                            }
                            for len in &reserved {
                                tx.commit(*len);
                            }
                            sent += reserved.len() as u32;
                            to_send -= reserved.len() as u32;
                        }
                        let mut seen = 0;
                        while to_get > 0 {
                            let look = if rotating {
                                rx.try_peek()
                            } else {
                                rx.try_peek_ahead(seen)
                            };
                            let Some((p, len)) = look else { break };
                            // SAFETY: `len` published bytes, this end's until release.
                            let bytes = unsafe { std::slice::from_raw_parts(p, len) };
                            assert_eq!(
                                bytes,
                                message_for(peer * 100_000 + got + seen, payload, long),
                                "rank {me}, {tag}, message {}",
                                got + seen
                            );
                            seen += 1;
                            to_get -= 1;
                            if rotating || seen == 3 {
                                for _ in 0..seen {
                                    rx.release();
                                }
                                got += seen;
                                seen = 0;
                            }
                        }
                        for _ in 0..seen {
                            rx.release();
                        }
                        got += seen;
                        assert!(
                            Instant::now() < deadline,
                            "rank {me}, {tag}: stuck at {sent} sent, {got} received (a \
                             message lost, or the peer failed)"
                        );
                        std::hint::spin_loop();
                    }
                }
                (sent, got)
            };
            let (a, b) = std::thread::scope(|s| {
                let b = s.spawn(|| run(&mut b_send, &mut b_recv, 1, 0));
                let a = run(&mut a_send, &mut a_recv, 0, 1);
                (a, b.join().unwrap())
            });
            assert_eq!((a.0, b.1), (b.1, a.0));
            assert_eq!(a.1, b.0);
            assert!(a.0 > 1000 && b.0 > 1000, "{a:?} {b:?}");
        }
    }

    #[test]
    fn counters_wrap_for_both_protocols() {
        let simple = Geometry {
            slots: 4,
            slot_bytes: 64,
            protocol: Protocol::Simple,
        };
        for g in [simple, Geometry::ll(4, 64)] {
            let (mut tx, mut rx) = pair(g, "wrap");
            let start = u32::MAX - 9;
            start_at(&mut tx, &mut rx, start);
            // Two slots in flight at a time, across the wrap.
            for i in 0..24u32 {
                for k in [i, i + 1000] {
                    let m = message(k);
                    let slot = tx.try_reserve(m.len()).expect("a free slot");
                    // SAFETY: the reserved slot holds at least 64 bytes until commit.
                    unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), slot, m.len()) };
                    tx.commit(m.len());
                }
                for k in [i, i + 1000] {
                    let (p, len) = rx.try_peek().expect("a published slot");
                    // SAFETY: `len` published bytes, readable until release.
                    let got = unsafe { std::slice::from_raw_parts(p, len) };
                    assert_eq!(got, message(k), "{:?} at counter {}", g.protocol, rx.tail);
                    rx.release();
                }
            }
            assert!(rx.try_peek().is_none());
        }
    }

    #[test]
    fn rotating_ends_walk_short_messages_through_the_slot_and_agree_across_the_wrap() {
        let g = Geometry {
            slots: 4,
            slot_bytes: 1024,
            protocol: Protocol::Simple,
        };
        let (mut tx, mut rx) = pair(g, "rotate");
        tx.set_rotating(true);
        rx.set_rotating(true);
        // Start so that slot uses cross the 32-bit wrap; lengths from 1 byte to a whole
        // slot (messages longer than half a slot stay at its start).
        start_at(&mut tx, &mut rx, u32::MAX - 4 * 9);
        let lengths = [1, 63, 64, 65, 200, 511, 512, 513, 1024];
        let mut offsets_of_short = std::collections::BTreeSet::new();
        for round in 0..24u32 {
            for (k, &len) in lengths.iter().enumerate() {
                let counter = tx.head;
                let m: Vec<u8> = (0..len)
                    .map(|b| (b as u32 * 7 + round + k as u32) as u8)
                    .collect();
                let slot = tx.try_reserve(len).expect("a free slot");
                let base = tx.shared.slot_ptr(counter);
                let offset = slot as usize - base as usize;
                assert!(offset + len <= g.payload(), "{len} B at {offset}");
                assert_eq!(offset % 64, 0, "{len} B at {offset}");
                if len > g.payload() / 2 {
                    assert_eq!(offset, 0, "{len} B");
                }
                if len == 1 {
                    offsets_of_short.insert(offset);
                }
                // SAFETY: `len` bytes from `slot` lie inside the reserved slot.
                unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), slot, len) };
                tx.commit(len);
                let (p, got_len) = rx.try_peek().expect("a published slot");
                assert_eq!(p as usize, slot as usize, "counter {counter:#x}");
                // SAFETY: `got_len` published bytes, readable until release.
                let got = unsafe { std::slice::from_raw_parts(p, got_len) };
                assert_eq!(got, &m[..], "counter {counter:#x}");
                rx.release();
            }
        }
        // A 1-byte message took a different cache line of its slot on successive uses.
        assert!(offsets_of_short.len() > 1, "{offsets_of_short:?}");
    }

    #[test]
    fn a_sender_is_far_when_most_hand_offs_of_a_window_are_slow() {
        let slow = HandoffClock::new().far_cycles + 1;
        let g = Geometry {
            slots: 4,
            slot_bytes: 64,
            protocol: Protocol::Simple,
        };
        let (tx, mut rx) = pair(g, "verdict");
        // Half slow is not a majority.
        for i in 0..HandoffClock::WINDOW {
            rx.judge_handoff(if i % 2 == 0 { slow } else { 0 });
        }
        assert!(!rx.handoffs.far && !tx.receiver_finds_far());
        // One more slow than fast is; the verdict holds until the window is full, and
        // then reaches the sender through the FIFO.
        for i in 0..HandoffClock::WINDOW {
            rx.judge_handoff(if i <= HandoffClock::WINDOW / 2 {
                slow
            } else {
                0
            });
            let full = i == HandoffClock::WINDOW - 1;
            assert_eq!(tx.receiver_finds_far(), full, "{i}");
        }
        // An interrupt (one huge look) does not keep a near sender far.
        rx.judge_handoff(u64::MAX);
        for _ in 1..HandoffClock::WINDOW {
            rx.judge_handoff(rx.handoffs.far_cycles);
        }
        assert!(!rx.handoffs.far && !tx.receiver_finds_far());
    }

    /// The far threshold is 0.1 µs of the time-stamp counter at this host's rate, not a
    /// fixed count of cycles: checked against the counter's cycles over a 20 ms sleep.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_far_threshold_is_a_tenth_of_a_microsecond_at_the_counters_rate() {
        let start = Instant::now();
        let (elapsed, cycles) = timed(|| {
            std::thread::sleep(Duration::from_millis(20));
            start.elapsed()
        });
        let expected = cycles as f64 * 100.0 / elapsed.as_nanos() as f64;
        let far = HandoffClock::new().far_cycles as f64;
        assert!(
            (far / expected - 1.0).abs() < 0.2,
            "{far} cycles against {expected:.0} for 0.1 µs"
        );
    }

    /// An LL receiver times the look that finds a message only when asked to (long
    /// messages), and then once in `LL_TIMED_EVERY` messages, not per look; a Simple
    /// receiver times every hand-off.
    #[test]
    fn ll_hand_offs_are_timed_only_for_long_messages() {
        let (mut tx, mut rx) = pair(Geometry::ll(4, 1024), "ll-judging");
        let send = |tx: &mut SendEnd, len: usize| {
            tx.try_reserve(len).unwrap();
            tx.commit(len);
        };
        send(&mut tx, 8);
        assert!(rx.try_peek().is_some());
        rx.release();
        assert_eq!(rx.handoffs.timed, 0, "a short message's look is not timed");
        // Looks that find nothing are not hand-offs.
        assert!(rx.try_peek_judging().is_none());
        assert_eq!(rx.handoffs.timed, 0);
        // Slot 1: not one of the timed ones; then up to and including slot 4, which is.
        for slot in 1..=LL_TIMED_EVERY {
            send(&mut tx, 1024);
            assert_eq!(rx.try_peek_judging().map(|(_, len)| len), Some(1024));
            rx.release();
            assert_eq!(rx.handoffs.timed, u32::from(slot == LL_TIMED_EVERY));
        }

        let simple = Geometry {
            slots: 4,
            slot_bytes: 64,
            protocol: Protocol::Simple,
        };
        let (mut tx, mut rx) = pair(simple, "simple-judging");
        send(&mut tx, 8);
        assert!(rx.try_peek().is_some());
        rx.release();
        assert_eq!(rx.handoffs.timed, 1);
    }

    #[test]
    #[should_panic(expected = "committed to a slot reserved for")]
    fn a_rotating_commit_must_match_its_reservation() {
        let g = Geometry {
            slots: 2,
            slot_bytes: 1024,
            protocol: Protocol::Simple,
        };
        let (mut tx, _rx) = pair(g, "rotate-mismatch");
        tx.set_rotating(true);
        tx.try_reserve(10).unwrap();
        tx.commit(20);
    }

    #[test]
    fn geometry_is_checked_on_both_ends() {
        for slots in [1, 3, 6, MAX_SLOTS] {
            let bad = Geometry {
                slots,
                slot_bytes: 64,
                protocol: Protocol::Simple,
            };
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains("power of two"), "{slots}: {err}");
        }
        // Every slot's record fits before the data: 8 bytes a slot for Simple, a line
        // for LL.
        for (slots, protocol, fits) in [
            (256, Protocol::Simple, true),
            (512, Protocol::Simple, false),
            (32, Protocol::LL, true),
            (64, Protocol::LL, false),
        ] {
            let g = match protocol {
                Protocol::LL => Geometry::ll(slots, 64),
                _ => Geometry {
                    slots,
                    slot_bytes: 128,
                    protocol,
                },
            };
            assert_eq!(g.validate().is_ok(), fits, "{g:?}");
            assert!(SIZES + slots * g.record_bytes() <= DATA_OFFSET || !fits);
        }
        assert_eq!((MAX_SLOTS, MAX_LL_SLOTS), (488, 61));
        let g = Geometry {
            slots: 2,
            slot_bytes: 128,
            protocol: Protocol::Simple,
        };
        let name = format!("ferroccl-test-fifo-geom-{}", std::process::id());
        let seg = Segment::create(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
        let _rx = recv_end(seg, g).unwrap();
        let other = Geometry {
            slots: 4,
            slot_bytes: 64,
            protocol: Protocol::Simple,
        };
        let ll = Geometry {
            protocol: Protocol::LL,
            ..g
        };
        for wrong in [other, ll] {
            let seg = Segment::open(SegmentKind::InProcess, &name, g.segment_bytes()).unwrap();
            assert!(send_end(seg, wrong, &name).is_err(), "{wrong:?}");
        }
        Segment::unlink(SegmentKind::InProcess, &name);
    }
}
