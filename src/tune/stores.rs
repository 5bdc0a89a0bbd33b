//! Whether a call's non-temporal stores pay, chosen by timing the calls themselves.
//!
//! The engine writes two things past the caches with non-temporal stores: the FIFO slots
//! towards a peer whose cache measures far, and the results of calls of [`LARGE`] or
//! more ([`crate::engine::STREAMING_FROM`]). No model predicts
//! whether either pays. On this project's VM kind, with the two vCPUs far apart (a cache
//! line 0.20–0.26 µs one way), 2 ranks:
//!
//! - **slots:** non-temporal stores were 2–5× faster than plain ones on the hosts of
//!   2026-11-25 (8 KiB–2 MiB: 4.6–11 GB/s against 1.5–2.2), and plain ones 1.4× faster in
//!   a far round on a host of 2026-11-28 (128 KiB–2 MiB: 11.5–15.3 GB/s against
//!   8.4–10.3), within 10 % in the rounds after;
//! - **results:** on that host of 2026-11-28, plain stores were faster far (8 MiB 15.3–
//!   18.2 GB/s against 9.0–9.1, 128 MiB 9.3–9.9 against 7.9–8.4) and non-temporal ones
//!   near (16–128 MiB 14.0–17.7 against 10.3–13.9);
//! - **large calls' slots:** on another host that afternoon, far, lines written with
//!   plain stores crossed at 2.3 GB/s and streamed ones at 17–18, and 8–128 MiB ran at
//!   1.8–2.1 GB/s with plain slot stores against 5.8–9.9 with non-temporal ones (and
//!   streamed results);
//! - **large calls' slots and results apart:** on an Intel Xeon host of 2026-11-29, far,
//!   plain slot stores with streamed results beat both ways that treat the two alike
//!   (2 ranks, 8–128 MiB, three interleaved rounds: 3.50–5.00 GB/s against 3.26–4.57
//!   for everything streamed, which that host's two-way trial chose over everything
//!   plain).
//!
//! So each size of call tries the ways and keeps the fastest; it tries again every
//! [`CYCLE`] calls of that size, since the VM moves its vCPUs within minutes. Calls
//! below [`LARGE`] write no result past the caches, so they try two ways (slots
//! streamed or not); larger ones try three ([`Stores`]).
//!
//! Calls are grouped by size in powers of two from [`SMALLEST`] (smaller calls write
//! slices too short to stream and results too small). Below [`LARGE`],
//! [`PAIRED_TRIAL_CALLS`] calls of every cycle, from the call by which the receivers have
//! had the hand-offs to measure far ([`paired_trial_from`]: call 2–32 for calls of many
//! slices, [`PAIRED_TRIAL_FROM`] for calls of one or two), alternate the two ways in
//! pairs, and the second call of each pair is timed (the first one finds the caches as
//! the other way left them); from [`LARGE`], where the buffers outgrow the caches and
//! calls are few and long, the first [`SINGLE_TRIAL_CALLS`] take the ways in turn call by
//! call and each is timed, and the trial ends after [`EARLY_ROUNDS`] rounds when one way
//! is clearly fastest ([`CLEAR_LEAD`]). The way with the lowest median time is used
//! until the next cycle.
//!
//! Where the trial falls is decided by the count of calls of the group alone (and the
//! communicator's shape, the same on every rank), so ranks that make the same calls in
//! the same order try the same way on the same call. Ranks
//! that do not (point-to-point calls of different sizes) or whose timings disagree only
//! lose time: the way bytes are stored never changes what they are.

use std::time::Duration;

/// How a call writes what it would write past the caches: its slots towards far peers
/// and, from [`LARGE`], its results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Non-temporal stores for both: the bytes go to memory, past this core's caches.
    NonTemporal,
    /// Plain stores for both: the bytes stay in this core's caches until evicted.
    Plain,
    /// Plain stores for the slots, non-temporal ones for the results (tried from
    /// [`LARGE`] only: below it the two are the same as [`Stores::Plain`]).
    PlainSlots,
}

impl Stores {
    /// The ways, in the order a trial takes them (the first two below [`LARGE`]).
    pub const WAYS: [Stores; 3] = [Stores::NonTemporal, Stores::Plain, Stores::PlainSlots];

    /// Whether slots towards far peers go past the caches.
    pub fn streams_slots(self) -> bool {
        self == Stores::NonTemporal
    }

    /// Whether results of [`LARGE`] or more go past the caches.
    pub fn streams_results(self) -> bool {
        self != Stores::Plain
    }

    /// How logs name it.
    pub fn name(self) -> &'static str {
        match self {
            Stores::NonTemporal => "non-temporal stores",
            Stores::Plain => "plain stores",
            Stores::PlainSlots => "plain stores for slots and non-temporal ones for results",
        }
    }
}

/// Smallest call (bytes) that is tried: a slice must be 2 KiB to stream
/// ([`crate::engine::FAR_SLOT_STREAMING_FROM`]).
pub const SMALLEST: usize = 2 << 10;

/// Calls of this many bytes or more may stream their results too (the trial tries three
/// ways, [`Stores`]), and are tried call by call ([`crate::engine::STREAMING_FROM`]).
pub const LARGE: usize = 8 << 20;

/// Calls of this many bytes or more share the last size group.
const LARGEST_GROUP: usize = 1 << 31;

/// How a size group's calls store before its first trial ends: plainly. Measured on the
/// Intel Xeon host of 2026-11-30 (vCPUs far in every sweep), runs of 25 calls (the
/// README's sweep, whose trials end inside it or not at all), three interleaved rounds,
/// µs out of place, with non-temporal stores first (as until then) against plain ones
/// throughout: 2 ranks 128 KiB 27.1 against 16.0, 512 KiB 106.6 against 56.7, 2 MiB
/// 433 against 367, 8 MiB 2226 against 1614; 4 ranks 128 KiB 78.8 against 51.7, 2 MiB
/// 1089 against 1008, 8 MiB 4732 against 4469. The hosts of 2026-11-25 measured the
/// other way (non-temporal 2–5× faster far); those of 2026-11-28 on had plain stores
/// faster or the trials choosing them, as the two-rank FIFOs' exchanged slots
/// (`transport::fifo`) favour plain stores into lines the writer's cache holds.
const BEFORE_FIRST_TRIAL: Stores = Stores::Plain;

/// Timed calls of each way per trial below [`LARGE`].
const PAIRED_SAMPLES: usize = 5;

/// Timed calls of each way per trial from [`LARGE`].
const SINGLE_SAMPLES: usize = 3;

/// Rounds of a trial from [`LARGE`] after which it ends if one way is clearly fastest
/// ([`CLEAR_LEAD`]): each of those calls is long, and a losing way's costs a sweep
/// dearly. Measured (2026-12-01, Intel Xeon, far, `all_reduce_perf`'s 5 warm-up calls
/// then ~20 timed): the trial's 9 calls reached 4 into the timed ones, and out of place
/// (tried) ran at 4.28–4.44 GB/s on 4 ranks at 32 MiB against 4.71–4.80 with the winning
/// way set from the start; 2 ranks at 128 MiB 6.04–6.22 against 6.42–6.71. The losing
/// ways took 1.2–1.7× the winner's time.
pub const EARLY_ROUNDS: usize = 2;

/// How much faster than every other way a way's faster call of [`EARLY_ROUNDS`] must be
/// for a trial from [`LARGE`] to end early: its time at most this share of theirs. (The
/// faster of two calls, so that a first call that finds its buffers cold does not
/// decide.)
pub const CLEAR_LEAD: f64 = 0.9;

/// Calls a trial takes below [`LARGE`]: pairs of calls, alternating the ways.
pub const PAIRED_TRIAL_CALLS: u32 = (2 * 2 * PAIRED_SAMPLES) as u32;

/// Calls a trial takes from [`LARGE`]: single calls, taking the three ways in turn.
pub const SINGLE_TRIAL_CALLS: u32 = (3 * SINGLE_SAMPLES) as u32;

/// Where in its cycle a trial below [`LARGE`] begins at the latest (calls that make few
/// hand-offs; see [`paired_trial_from`] for the others). Non-temporal stores differ from
/// plain ones only towards a peer that measures far, and a receiver says so after 16
/// timed hand-offs (`transport::fifo`: every one of a Simple FIFO, one in
/// [`LL_TIMED_EVERY`](crate::transport::fifo::LL_TIMED_EVERY) of an LL one, so 64 LL messages); a call of a few slices makes one
/// or two, so a trial at a group's first calls compared two ways that were still the
/// same. Measured, 4 ranks on 2 vCPUs far apart, 4 KiB: every rank's first trial chose
/// plain stores (medians 6.3–25.1 µs plain, 7.3–26.6 non-temporal) while only some of
/// the receivers had yet called their senders far, and held it for the rest of the
/// cycle; the next trial chose non-temporal ones on every rank. Larger calls make 16
/// hand-offs in their first call.
pub const PAIRED_TRIAL_FROM: u32 = 96;

/// Hand-offs each FIFO a call uses makes before a trial of its size begins: two of the
/// receivers' windows of 16, so a verdict on the sender is there and has had one more
/// window to settle.
pub const HANDOFFS_BEFORE_TRIAL: usize = 32;

/// Where in its cycle a trial of calls of at least `bytes` (below [`LARGE`]) begins on a
/// communicator of `ranks` ranks, `channels` channels and FIFO slots of `slot_bytes`:
/// once every FIFO the calls use has made [`HANDOFFS_BEFORE_TRIAL`] hand-offs, and at
/// [`PAIRED_TRIAL_FROM`] at the latest. A collective of `bytes` moves at least
/// `bytes / ranks` through each FIFO it uses, split among the channels (all-to-all; the
/// two-shot twice that, the ring `2(ranks − 1) / ranks` times it, one-shot, the tree,
/// doubling and broadcast all of it), in slices of at most one slot. So short runs (the
/// README's sweep makes 25 calls of each size) reach the trial where their calls are long
/// enough to measure far at once: 2 ranks, 128 KiB slots, 2 MiB calls at call 4, where
/// every size waited for call 96 before (found 2026-11-29, when plain slot stores beat the
/// default by 10–30 % at 32 KiB–8 MiB on an Intel host and the sweep never tried them).
pub fn paired_trial_from(bytes: usize, ranks: usize, channels: usize, slot_bytes: usize) -> u32 {
    let per_fifo = bytes / (ranks.max(1) * channels.max(1));
    match per_fifo / slot_bytes.max(1) {
        0 => PAIRED_TRIAL_FROM,
        handoffs => (HANDOFFS_BEFORE_TRIAL.div_ceil(handoffs) as u32).min(PAIRED_TRIAL_FROM),
    }
}

/// Calls of one size group from the start of one trial to the next.
pub const CYCLE: u32 = 1024;

/// Size groups: powers of two from `SMALLEST` to `LARGEST_GROUP`.
const GROUPS: usize = (LARGEST_GROUP.ilog2() - SMALLEST.ilog2() + 1) as usize;

/// The size group of a call of `bytes` (at least `SMALLEST`).
fn group_of(bytes: usize) -> usize {
    (bytes.min(LARGEST_GROUP).ilog2() - SMALLEST.ilog2()) as usize
}

/// The smallest call of group `group`.
fn group_start(group: usize) -> usize {
    SMALLEST << group
}

/// Whether calls of group `group` are tried in pairs (below [`LARGE`]) or call by call.
fn paired(group: usize) -> bool {
    group_start(group) < LARGE
}

/// Timed calls of each way per trial of group `group`.
fn samples_of(group: usize) -> usize {
    match paired(group) {
        true => PAIRED_SAMPLES,
        false => SINGLE_SAMPLES,
    }
}

/// The ways a trial of group `group` takes: results stream only from [`LARGE`].
fn ways_of(group: usize) -> &'static [Stores] {
    match paired(group) {
        true => &Stores::WAYS[..2],
        false => &Stores::WAYS,
    }
}

/// A timed call of a trial, to report with [`StoreTrial::record`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    group: usize,
    way: usize,
    index: usize,
}

/// The outcome of a trial, for the log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    /// The calls it holds for: from `bytes.0` up to, not including, `bytes.1` (`None`:
    /// every larger call).
    pub bytes: (usize, Option<usize>),
    /// The way those calls use until the next trial.
    pub stores: Stores,
    /// The median time of a call written each way (of a trial that ended early, the
    /// faster of its two), in the order of [`Stores`]' variants (`None`: a way the group
    /// does not try).
    pub medians: [Option<Duration>; 3],
    /// Whether it differs from the way those calls used before.
    pub changed: bool,
}

impl std::fmt::Display for Verdict {
    /// The log's line: e.g. `calls of 256 KiB–512 KiB now write slots towards far peers
    /// with plain stores (medians: 18.4 µs non-temporal stores, 16.0 µs plain stores)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.bytes.0 < LARGE {
            true => "slots towards far peers",
            false => "results and slots towards far peers",
        };
        write!(f, "calls of {} KiB", self.bytes.0 >> 10)?;
        if let Some(end) = self.bytes.1 {
            write!(f, "–{} KiB", end >> 10)?;
        }
        write!(
            f,
            " now write {what} with {} (medians: ",
            self.stores.name()
        )?;
        let tried = self.medians.iter().zip(Stores::WAYS);
        for (i, (m, way)) in tried
            .filter_map(|(m, w)| Some((m.as_ref()?, w)))
            .enumerate()
        {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{:.1} µs {}", m.as_secs_f64() * 1e6, way.name())?;
        }
        write!(f, ")")
    }
}

#[derive(Clone, Copy, Debug)]
struct Group {
    /// Position of the next call in its cycle.
    position: u32,
    /// Where in the cycle its trial begins.
    from: u32,
    times: [[Duration; PAIRED_SAMPLES]; 3],
    chosen: Stores,
    /// Whether this cycle's trial has ended early ([`EARLY_ROUNDS`]).
    settled: bool,
    /// Trials completed.
    trials: u32,
}

/// The trials of every size group of one communicator.
#[derive(Clone, Debug)]
pub struct StoreTrial {
    groups: [Group; GROUPS],
}

impl StoreTrial {
    /// The trials of a communicator of `ranks` ranks, `channels` channels and FIFO slots
    /// of `slot_bytes` ([`paired_trial_from`]).
    pub fn new(ranks: usize, channels: usize, slot_bytes: usize) -> Self {
        StoreTrial {
            groups: std::array::from_fn(|group| Group {
                position: 0,
                from: match paired(group) {
                    true => paired_trial_from(group_start(group), ranks, channels, slot_bytes),
                    false => 0,
                },
                times: [[Duration::ZERO; PAIRED_SAMPLES]; 3],
                chosen: BEFORE_FIRST_TRIAL,
                settled: false,
                trials: 0,
            }),
        }
    }

    /// How the next call of `bytes` writes what it would write past the caches, and
    /// whether its time is a sample of a trial (then pass it to [`StoreTrial::record`]).
    /// Calls below [`SMALLEST`] are not tried and may stream (they never reach a
    /// streamed slice or result).
    #[inline]
    pub fn next(&mut self, bytes: usize) -> (Stores, Option<Sample>) {
        if bytes < SMALLEST {
            return (Stores::NonTemporal, None);
        }
        let group = group_of(bytes);
        let g = &mut self.groups[group];
        let position = g.position;
        g.position = (position + 1) % CYCLE;
        if position == 0 {
            g.settled = false;
        }
        let paired = paired(group);
        let ways = ways_of(group).len();
        let (per_way, from) = (if paired { 2 } else { 1 }, g.from);
        let window = from..from + (ways * samples_of(group)) as u32 * per_way;
        if g.settled || !window.contains(&position) {
            return (g.chosen, None);
        }
        let position = position - from;
        let turn = (position / per_way) as usize;
        let way = turn % ways;
        let timed = !paired || position % 2 == 1;
        let sample = timed.then_some(Sample {
            group,
            way,
            index: turn / ways,
        });
        (Stores::WAYS[way], sample)
    }

    /// Trials completed so far for calls of `bytes`'s size group (0 below
    /// [`SMALLEST`]).
    pub fn trials_done(&self, bytes: usize) -> u32 {
        match bytes < SMALLEST {
            true => 0,
            false => self.groups[group_of(bytes)].trials,
        }
    }

    /// Records a timed call's `elapsed` time; after a trial's last sample, chooses the
    /// way with the lowest median (the earlier way of [`Stores`]' order on a tie) and
    /// returns the verdict. A trial from [`LARGE`] ends after [`EARLY_ROUNDS`] when one
    /// way's faster call took at most [`CLEAR_LEAD`] of every other's.
    pub fn record(&mut self, sample: Sample, elapsed: Duration) -> Option<Verdict> {
        let start = group_start(sample.group);
        let samples = samples_of(sample.group);
        let ways = ways_of(sample.group).len();
        let g = &mut self.groups[sample.group];
        g.times[sample.way][sample.index] = elapsed;
        if sample.way != ways - 1 {
            return None;
        }
        let mut medians = [None; 3];
        let early = !paired(sample.group) && sample.index == EARLY_ROUNDS - 1;
        if early {
            for (way, median) in medians.iter_mut().enumerate().take(ways) {
                *median = g.times[way][..EARLY_ROUNDS].iter().min().copied();
            }
            let fastest = fastest_of(&medians[..ways]);
            let lead = medians[fastest].expect("every way timed").as_secs_f64();
            let clear = (0..ways).filter(|&way| way != fastest).all(|way| {
                lead <= CLEAR_LEAD * medians[way].expect("every way timed").as_secs_f64()
            });
            if !clear {
                return None;
            }
            g.settled = true;
        } else {
            if sample.index != samples - 1 {
                return None;
            }
            for (way, median) in medians.iter_mut().enumerate().take(ways) {
                let t = &mut g.times[way][..samples];
                t.sort_unstable();
                *median = Some(t[samples / 2]);
            }
        }
        let stores = Stores::WAYS[fastest_of(&medians[..ways])];
        let changed = stores != g.chosen;
        g.chosen = stores;
        g.trials += 1;
        let last = sample.group == GROUPS - 1;
        Some(Verdict {
            bytes: (start, (!last).then_some(2 * start)),
            stores,
            medians,
            changed,
        })
    }
}

/// The way with the lowest time (the earlier on a tie).
fn fastest_of(times: &[Option<Duration>]) -> usize {
    (0..times.len())
        .min_by_key(|&way| times[way])
        .expect("a trial has ways")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The FIFO slots of the default configuration.
    const SLOT: usize = 128 << 10;

    /// Runs `calls` calls of `bytes`, timing each way as `time` says; returns the ways
    /// used and the verdicts.
    fn run(
        trial: &mut StoreTrial,
        bytes: usize,
        calls: u32,
        time: impl Fn(Stores) -> Duration,
    ) -> (Vec<Stores>, Vec<Verdict>) {
        let mut ways = Vec::new();
        let mut verdicts = Vec::new();
        for _ in 0..calls {
            let (way, sample) = trial.next(bytes);
            ways.push(way);
            if let Some(s) = sample {
                verdicts.extend(trial.record(s, time(way)));
            }
        }
        (ways, verdicts)
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn the_faster_way_wins_and_is_kept_until_the_next_trial() {
        let mut trial = StoreTrial::new(2, 1, SLOT);
        let plain_faster = |w| match w {
            Stores::Plain => us(10),
            Stores::NonTemporal => us(14),
            Stores::PlainSlots => unreachable!("tried from LARGE only"),
        };
        let (ways, verdicts) = run(&mut trial, 100 << 10, CYCLE, plain_faster);
        // Plain stores until the trial, which alternates the ways in pairs,
        // non-temporal first.
        let (from, tried) = (PAIRED_TRIAL_FROM as usize, PAIRED_TRIAL_CALLS as usize);
        assert!(ways[..from].iter().all(|w| *w == BEFORE_FIRST_TRIAL));
        for (i, w) in ways[from..from + tried].iter().enumerate() {
            assert_eq!(*w, Stores::WAYS[(i / 2) % 2], "call {i}");
        }
        assert!(ways[from + tried..].iter().all(|w| *w == Stores::Plain));
        assert_eq!(
            verdicts,
            [Verdict {
                bytes: (64 << 10, Some(128 << 10)),
                stores: Stores::Plain,
                medians: [Some(us(14)), Some(us(10)), None],
                changed: false,
            }]
        );
        // The next cycle tries again, and follows the machine when it changes.
        let (ways, verdicts) = run(&mut trial, 100 << 10, CYCLE, |w| match w {
            Stores::Plain => us(30),
            Stores::NonTemporal => us(12),
            Stores::PlainSlots => unreachable!("tried from LARGE only"),
        });
        assert_eq!(verdicts.len(), 1);
        assert_eq!(verdicts[0].stores, Stores::NonTemporal);
        assert!(verdicts[0].changed);
        assert!(ways[..from].iter().all(|w| *w == Stores::Plain));
        assert!(
            ways[from + tried..]
                .iter()
                .all(|w| *w == Stores::NonTemporal)
        );
        assert_eq!(trial.trials_done(100 << 10), 2);
    }

    /// A trial waits for the hand-offs that let the receivers measure far: calls of
    /// many slices reach it within a few calls (a short sweep's 25 calls), calls of one
    /// or two at `PAIRED_TRIAL_FROM`, and more ranks, channels or larger slots (fewer
    /// hand-offs a call on each FIFO) push it later.
    #[test]
    fn a_trial_begins_once_the_calls_have_made_the_hand_offs_to_measure_far() {
        // 2 ranks, one channel, 128 KiB slots: 2 MiB calls move 1 MiB per FIFO, 8 slots.
        assert_eq!(paired_trial_from(2 << 20, 2, 1, SLOT), 4);
        assert_eq!(paired_trial_from(4 << 20, 2, 1, SLOT), 2);
        assert_eq!(paired_trial_from(512 << 10, 2, 1, SLOT), 16);
        assert_eq!(paired_trial_from(256 << 10, 2, 1, SLOT), 32);
        // Less than a slot per FIFO: the latest start.
        assert_eq!(paired_trial_from(128 << 10, 2, 1, SLOT), PAIRED_TRIAL_FROM);
        assert_eq!(paired_trial_from(SMALLEST, 2, 1, SLOT), PAIRED_TRIAL_FROM);
        // 8 ranks, 2 channels, or 512 KiB slots: fewer hand-offs a call, a later start.
        assert_eq!(paired_trial_from(2 << 20, 8, 1, SLOT), 16);
        assert_eq!(paired_trial_from(2 << 20, 2, 2, SLOT), 8);
        assert_eq!(paired_trial_from(2 << 20, 2, 1, 4 * SLOT), 16);
        assert_eq!(paired_trial_from(1 << 30, 2, 1, SLOT), 1);
        // A short sweep (5 warm-up calls and 20 timed) of 2 MiB calls on 2 ranks ends its
        // trial inside the sweep and uses the faster way after it.
        let mut trial = StoreTrial::new(2, 1, SLOT);
        let (ways, verdicts) = run(&mut trial, 2 << 20, 25, |w| match w {
            Stores::Plain => us(400),
            _ => us(500),
        });
        assert_eq!(ways[..4], [BEFORE_FIRST_TRIAL; 4]);
        assert_eq!(verdicts.len(), 1);
        assert_eq!(verdicts[0].stores, Stores::Plain);
        assert_eq!(ways[4 + PAIRED_TRIAL_CALLS as usize..], [Stores::Plain]);
    }

    #[test]
    fn large_calls_take_three_ways_call_by_call_and_time_each() {
        let mut trial = StoreTrial::new(2, 1, SLOT);
        // No way leads by a clear margin: all three rounds.
        let (ways, verdicts) = run(&mut trial, LARGE, SINGLE_TRIAL_CALLS + 2, |w| match w {
            Stores::Plain => us(900),
            Stores::NonTemporal => us(1500),
            Stores::PlainSlots => us(850),
        });
        let tried = SINGLE_TRIAL_CALLS as usize;
        for (i, w) in ways[..tried].iter().enumerate() {
            assert_eq!(*w, Stores::WAYS[i % 3], "call {i}");
        }
        assert_eq!(ways[tried..], [Stores::PlainSlots; 2]);
        assert!(Stores::PlainSlots.streams_results() && !Stores::PlainSlots.streams_slots());
        assert_eq!(verdicts.len(), 1);
        assert_eq!(verdicts[0].bytes, (LARGE, Some(2 * LARGE)));
        assert_eq!(
            verdicts[0].medians,
            [Some(us(1500)), Some(us(900)), Some(us(850))]
        );
        // The next trial follows the machine to everything plain.
        let mut trial = StoreTrial::new(2, 1, SLOT);
        let (_, verdicts) = run(&mut trial, LARGE, SINGLE_TRIAL_CALLS, |w| match w {
            Stores::Plain => us(600),
            _ => us(800),
        });
        assert_eq!(verdicts[0].stores, Stores::Plain);
        // The largest calls share one group.
        let (_, verdicts) = run(&mut trial, usize::MAX, SINGLE_TRIAL_CALLS, |_| us(1));
        assert_eq!(verdicts[0].bytes, (LARGEST_GROUP, None));
        assert_eq!(trial.trials_done(LARGEST_GROUP * 3), 1);
    }

    /// A large call's trial ends after two rounds when one way's faster call leads
    /// every other way's by a clear margin (a first call made slow by cold buffers does
    /// not decide it); the rest of the cycle uses that way untimed, and the next cycle
    /// tries again from its start.
    #[test]
    fn a_large_trial_with_a_clear_winner_ends_after_two_rounds() {
        let mut trial = StoreTrial::new(2, 1, SLOT);
        let mut call = 0;
        let mut time = |w: Stores| {
            call += 1;
            match w {
                // The group's first call finds its buffers cold.
                Stores::NonTemporal if call == 1 => us(5000),
                Stores::NonTemporal => us(600),
                Stores::Plain => us(900),
                Stores::PlainSlots => us(720),
            }
        };
        let mut ways = Vec::new();
        let mut verdicts = Vec::new();
        for _ in 0..CYCLE + SINGLE_TRIAL_CALLS {
            let (way, sample) = trial.next(LARGE);
            ways.push(way);
            if let Some(s) = sample {
                verdicts.extend(trial.record(s, time(way)));
            }
        }
        let rounds = 3 * EARLY_ROUNDS;
        for (i, w) in ways[..rounds].iter().enumerate() {
            assert_eq!(*w, Stores::WAYS[i % 3], "call {i}");
        }
        let cycle = CYCLE as usize;
        assert!(
            ways[rounds..cycle]
                .iter()
                .all(|w| *w == Stores::NonTemporal)
        );
        assert_eq!(
            verdicts[0].medians,
            [Some(us(600)), Some(us(900)), Some(us(720))]
        );
        assert_eq!(verdicts[0].stores, Stores::NonTemporal);
        // The next cycle's trial takes the ways in turn again, and ends early as well.
        for (i, w) in ways[cycle..cycle + rounds].iter().enumerate() {
            assert_eq!(*w, Stores::WAYS[i % 3], "call {i} of the second cycle");
        }
        assert!(
            ways[cycle + rounds..]
                .iter()
                .all(|w| *w == Stores::NonTemporal)
        );
        assert_eq!(verdicts.len(), 2);
        assert_eq!(trial.trials_done(LARGE), 2);
        // A lead short of the margin takes the third round.
        let mut trial = StoreTrial::new(2, 1, SLOT);
        let (ways, verdicts) = run(&mut trial, LARGE, SINGLE_TRIAL_CALLS, |w| match w {
            Stores::PlainSlots => us(740),
            _ => us(780),
        });
        assert_eq!(ways[rounds..], Stores::WAYS[..]);
        assert_eq!(verdicts.len(), 1);
        assert_eq!(verdicts[0].stores, Stores::PlainSlots);
    }

    #[test]
    fn a_verdict_reads_as_the_log_prints_it() {
        let small = Verdict {
            bytes: (256 << 10, Some(512 << 10)),
            stores: Stores::Plain,
            medians: [Some(us(18)), Some(us(16)), None],
            changed: true,
        };
        assert_eq!(
            small.to_string(),
            "calls of 256 KiB–512 KiB now write slots towards far peers with plain stores \
             (medians: 18.0 µs non-temporal stores, 16.0 µs plain stores)"
        );
        let largest = Verdict {
            bytes: (LARGEST_GROUP, None),
            stores: Stores::PlainSlots,
            medians: [Some(us(30)), Some(us(40)), Some(us(20))],
            changed: true,
        };
        assert_eq!(
            largest.to_string(),
            "calls of 2097152 KiB now write results and slots towards far peers with plain \
             stores for slots and non-temporal ones for results (medians: 30.0 µs \
             non-temporal stores, 40.0 µs plain stores, 20.0 µs plain stores for slots and \
             non-temporal ones for results)"
        );
    }

    #[test]
    fn the_median_ignores_a_few_outliers() {
        let mut trial = StoreTrial::new(2, 1, SLOT);
        let mut n = 0u32;
        let mut verdict = None;
        for _ in 0..PAIRED_TRIAL_FROM + PAIRED_TRIAL_CALLS {
            let (way, sample) = trial.next(4 << 10);
            if let Some(s) = sample {
                n += 1;
                // Plain is faster, but two of its five samples were preempted.
                let t = match way {
                    Stores::Plain if n.is_multiple_of(4) => us(500),
                    Stores::Plain => us(5),
                    Stores::NonTemporal => us(8),
                    Stores::PlainSlots => unreachable!("tried from LARGE only"),
                };
                verdict = trial.record(s, t).or(verdict);
            }
        }
        let v = verdict.expect("a verdict after the trial's calls");
        assert_eq!(v.stores, Stores::Plain);
        assert_eq!(v.bytes, (4 << 10, Some(8 << 10)));
    }

    #[test]
    fn sizes_are_tried_apart_and_small_calls_are_not_timed() {
        let mut trial = StoreTrial::new(2, 1, SLOT);
        for bytes in [0, 1, SMALLEST - 1] {
            assert_eq!(trial.next(bytes), (Stores::NonTemporal, None), "{bytes}");
            assert_eq!(trial.trials_done(bytes), 0);
        }
        // Plain wins for 8 KiB calls; 1 MiB calls, interleaved with them, have their own
        // trial, which non-temporal stores win.
        let time = |bytes: usize, w: Stores| match (bytes, w) {
            (8192, Stores::Plain) => us(1),
            (8192, Stores::NonTemporal) => us(2),
            (_, Stores::Plain) => us(9),
            (_, Stores::NonTemporal) => us(3),
            (_, Stores::PlainSlots) => unreachable!("tried from LARGE only"),
        };
        let mut chosen = Vec::new();
        for _ in 0..PAIRED_TRIAL_FROM + PAIRED_TRIAL_CALLS {
            for bytes in [8192, 1 << 20] {
                let (way, sample) = trial.next(bytes);
                if let Some(s) = sample
                    && let Some(v) = trial.record(s, time(bytes, way))
                {
                    chosen.push((v.bytes.0, v.stores));
                }
            }
        }
        // The 1 MiB calls measure far sooner (8 hand-offs each on 2 ranks), so their
        // trial ends first.
        assert_eq!(
            chosen,
            [(1 << 20, Stores::NonTemporal), (8192, Stores::Plain)]
        );
        // Just below `LARGE`, calls are still tried in pairs; a tie goes to non-temporal
        // stores, the first way.
        let from = paired_trial_from(LARGE / 2, 2, 1, SLOT);
        let (ways, verdicts) = run(&mut trial, LARGE - 1, from + PAIRED_TRIAL_CALLS, |_| us(1));
        let from = from as usize;
        assert_eq!(
            ways[from..from + 4],
            [
                Stores::NonTemporal,
                Stores::NonTemporal,
                Stores::Plain,
                Stores::Plain
            ]
        );
        assert_eq!(verdicts[0].bytes, (LARGE / 2, Some(LARGE)));
        assert_eq!(verdicts[0].stores, Stores::NonTemporal);
        assert!(
            verdicts[0].changed,
            "from the plain stores before the first trial"
        );
    }
}
