//! How a call writes its FIFO slots towards a peer whose cache measures far, chosen by
//! timing the calls themselves.
//!
//! No model predicts this one. On this project's VM kind, with the two vCPUs far apart
//! (a cache line 0.20–0.26 µs one way), non-temporal slot stores made 2 ranks 2–5× faster
//! than plain ones on the hosts of 2026-11-25 (8 KiB–2 MiB: 4.6–11 GB/s against 1.5–2.2),
//! and plain stores 1.4× faster than non-temporal ones on a host of 2026-11-28 (128 KiB
//! –2 MiB: 11.5–15.3 GB/s against 8.4–10.3); another round on that host found them
//! within 10 % of each other. So each size of call tries both, a few calls each, and
//! keeps the faster; it tries again every [`CYCLE`] calls of that size, since the VM
//! moves its vCPUs within minutes.
//!
//! Calls are grouped by size in powers of two from [`SMALLEST`] (smaller calls write
//! slices too short to stream) to [`LARGEST`] (larger ones keep plain stores: they are
//! bound by memory bandwidth, see [`crate::engine::STREAMING_FROM`]). Within a group,
//! the first [`TRIAL_CALLS`] calls of every cycle alternate the two ways in pairs, and
//! the second call of each pair is timed (the first one changes the caches' state from
//! the other way's); the way with the lower median time is used until the next cycle.
//!
//! Where the trial falls is decided by the count of calls of the group alone, so ranks
//! that make the same calls in the same order try the same way on the same call. Ranks
//! that do not (point-to-point calls of different sizes) or whose timings disagree only
//! lose time: the way slots are written never changes what they carry.

use std::time::Duration;

/// How slots towards a far peer are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FarSlotStores {
    /// Non-temporal stores: the slot goes to memory and the reader fetches it there.
    Streaming,
    /// Plain stores: the reader fetches the lines from the writer's cache.
    Plain,
}

impl FarSlotStores {
    /// The two ways, in the order a trial alternates them.
    const WAYS: [FarSlotStores; 2] = [FarSlotStores::Streaming, FarSlotStores::Plain];

    /// How logs name it.
    pub fn name(self) -> &'static str {
        match self {
            FarSlotStores::Streaming => "non-temporal",
            FarSlotStores::Plain => "plain",
        }
    }
}

/// Smallest call (bytes) whose slot stores are tried: a slice must be 4 KiB to stream
/// ([`crate::engine::FAR_SLOT_STREAMING_FROM`]).
pub const SMALLEST: usize = 4 << 10;

/// Calls of this many bytes or more are not tried.
pub const LARGEST: usize = 8 << 20;

/// Timed calls of each way per trial.
const SAMPLES: usize = 5;

/// Calls a trial takes: pairs of calls, alternating the ways.
pub const TRIAL_CALLS: u32 = (2 * 2 * SAMPLES) as u32;

/// Calls of one size group from the start of one trial to the next.
pub const CYCLE: u32 = 1024;

/// Size groups: powers of two from `SMALLEST` up to `LARGEST`.
const GROUPS: usize = (LARGEST.trailing_zeros() - SMALLEST.trailing_zeros()) as usize;

/// The size group of a call of `bytes` (from `SMALLEST` up to `LARGEST`).
fn group_of(bytes: usize) -> usize {
    (bytes.ilog2() - SMALLEST.ilog2()) as usize
}

/// A timed call of a trial, to report with [`FarStoreTrial::record`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    group: usize,
    way: usize,
    index: usize,
}

/// The outcome of a trial, for the log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    /// The calls it holds for: from `bytes.0` up to, not including, `bytes.1`.
    pub bytes: (usize, usize),
    /// The way those calls use until the next trial.
    pub stores: FarSlotStores,
    /// The median time of a call written each way: non-temporal, then plain.
    pub medians: [Duration; 2],
    /// Whether it differs from the way those calls used before.
    pub changed: bool,
}

#[derive(Clone, Copy, Debug)]
struct Group {
    /// Position of the next call in its cycle.
    position: u32,
    times: [[Duration; SAMPLES]; 2],
    chosen: FarSlotStores,
    /// Trials completed.
    trials: u32,
}

/// The trials of every size group of one communicator.
#[derive(Clone, Debug)]
pub struct FarStoreTrial {
    groups: [Group; GROUPS],
}

impl Default for FarStoreTrial {
    fn default() -> Self {
        let group = Group {
            position: 0,
            times: [[Duration::ZERO; SAMPLES]; 2],
            chosen: FarSlotStores::Streaming,
            trials: 0,
        };
        FarStoreTrial {
            groups: [group; GROUPS],
        }
    }
}

impl FarStoreTrial {
    /// How the next call of `bytes` writes its slots towards far peers, and whether its
    /// time is a sample of a trial (then pass it to [`FarStoreTrial::record`]). Calls
    /// outside the tried sizes stream (smaller calls never reach a streamed slice, larger
    /// ones never stream).
    #[inline]
    pub fn next(&mut self, bytes: usize) -> (FarSlotStores, Option<Sample>) {
        if !(SMALLEST..LARGEST).contains(&bytes) {
            return (FarSlotStores::Streaming, None);
        }
        let group = group_of(bytes);
        let g = &mut self.groups[group];
        let position = g.position;
        g.position = (position + 1) % CYCLE;
        if position >= TRIAL_CALLS {
            return (g.chosen, None);
        }
        let pair = (position / 2) as usize;
        let way = pair % 2;
        let timed = position % 2 == 1;
        let sample = timed.then_some(Sample {
            group,
            way,
            index: pair / 2,
        });
        (FarSlotStores::WAYS[way], sample)
    }

    /// Trials completed so far for calls of `bytes`'s size group (0 for sizes that are
    /// not tried).
    pub fn trials_done(&self, bytes: usize) -> u32 {
        if !(SMALLEST..LARGEST).contains(&bytes) {
            return 0;
        }
        self.groups[group_of(bytes)].trials
    }

    /// Records a timed call's `elapsed` time; after a trial's last sample, chooses the
    /// way with the lower median and returns the verdict.
    pub fn record(&mut self, sample: Sample, elapsed: Duration) -> Option<Verdict> {
        let g = &mut self.groups[sample.group];
        g.times[sample.way][sample.index] = elapsed;
        if sample.way != 1 || sample.index != SAMPLES - 1 {
            return None;
        }
        let medians = g.times.map(|mut t| {
            t.sort_unstable();
            t[SAMPLES / 2]
        });
        let stores = if medians[1] < medians[0] {
            FarSlotStores::Plain
        } else {
            FarSlotStores::Streaming
        };
        let changed = stores != g.chosen;
        g.chosen = stores;
        g.trials += 1;
        let low = SMALLEST << sample.group;
        Some(Verdict {
            bytes: (low, 2 * low),
            stores,
            medians,
            changed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `calls` calls of `bytes`, timing each way as `time` says; returns the ways
    /// used and the verdicts.
    fn run(
        trial: &mut FarStoreTrial,
        bytes: usize,
        calls: u32,
        time: impl Fn(FarSlotStores) -> Duration,
    ) -> (Vec<FarSlotStores>, Vec<Verdict>) {
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
        let mut trial = FarStoreTrial::default();
        let plain_faster = |w| match w {
            FarSlotStores::Plain => us(10),
            FarSlotStores::Streaming => us(14),
        };
        let (ways, verdicts) = run(&mut trial, 100 << 10, CYCLE, plain_faster);
        // The trial alternates the ways in pairs, streaming first.
        let tried = &ways[..TRIAL_CALLS as usize];
        for (i, w) in tried.iter().enumerate() {
            let want = FarSlotStores::WAYS[(i / 2) % 2];
            assert_eq!(*w, want, "call {i}");
        }
        assert!(
            ways[TRIAL_CALLS as usize..]
                .iter()
                .all(|w| *w == FarSlotStores::Plain)
        );
        assert_eq!(
            verdicts,
            [Verdict {
                bytes: (64 << 10, 128 << 10),
                stores: FarSlotStores::Plain,
                medians: [us(14), us(10)],
                changed: true,
            }]
        );
        // The next cycle tries again, and follows the machine when it changes.
        let (ways, verdicts) = run(&mut trial, 100 << 10, CYCLE, |w| match w {
            FarSlotStores::Plain => us(30),
            FarSlotStores::Streaming => us(12),
        });
        assert_eq!(verdicts.len(), 1);
        assert_eq!(verdicts[0].stores, FarSlotStores::Streaming);
        assert!(verdicts[0].changed);
        assert!(
            ways[TRIAL_CALLS as usize..]
                .iter()
                .all(|w| *w == FarSlotStores::Streaming)
        );
    }

    #[test]
    fn the_median_ignores_a_few_outliers() {
        let mut trial = FarStoreTrial::default();
        let mut n = 0u32;
        let mut verdict = None;
        for _ in 0..TRIAL_CALLS {
            let (way, sample) = trial.next(4 << 10);
            if let Some(s) = sample {
                n += 1;
                // Plain is faster, but two of its five samples were preempted.
                let t = match way {
                    FarSlotStores::Plain if n.is_multiple_of(4) => us(500),
                    FarSlotStores::Plain => us(5),
                    FarSlotStores::Streaming => us(8),
                };
                verdict = trial.record(s, t).or(verdict);
            }
        }
        let v = verdict.expect("a verdict after the trial's calls");
        assert_eq!(v.stores, FarSlotStores::Plain);
        assert_eq!(v.bytes, (4 << 10, 8 << 10));
    }

    #[test]
    fn sizes_are_tried_apart_and_outside_sizes_stream_untimed() {
        let mut trial = FarStoreTrial::default();
        for bytes in [0, 1, SMALLEST - 1, LARGEST, LARGEST * 4] {
            assert_eq!(
                trial.next(bytes),
                (FarSlotStores::Streaming, None),
                "{bytes}"
            );
        }
        // Plain wins for 8 KiB calls; 1 MiB calls, interleaved with them, have their own
        // trial, which streaming wins.
        let time = |bytes: usize, w: FarSlotStores| match (bytes, w) {
            (8192, FarSlotStores::Plain) => us(1),
            (8192, FarSlotStores::Streaming) => us(2),
            (_, FarSlotStores::Plain) => us(9),
            (_, FarSlotStores::Streaming) => us(3),
        };
        let mut chosen = Vec::new();
        for _ in 0..TRIAL_CALLS {
            for bytes in [8192, 1 << 20] {
                let (way, sample) = trial.next(bytes);
                if let Some(s) = sample
                    && let Some(v) = trial.record(s, time(bytes, way))
                {
                    chosen.push((v.bytes.0, v.stores));
                }
            }
        }
        assert_eq!(
            chosen,
            [
                (8192, FarSlotStores::Plain),
                (1 << 20, FarSlotStores::Streaming)
            ]
        );
        // The largest group holds calls just below `LARGEST`.
        let (ways, verdicts) = run(&mut trial, LARGEST - 1, TRIAL_CALLS, |_| us(1));
        assert_eq!(ways.len(), TRIAL_CALLS as usize);
        assert_eq!(verdicts[0].bytes, (LARGEST / 2, LARGEST));
        assert!(!verdicts[0].changed, "a tie keeps non-temporal stores");
    }
}
