//! The flight recorder: the last N collectives of a process group, with their state
//! and times, kept in a ring buffer so that a hang can be diagnosed after the fact
//! (PyTorch's NCCL flight recorder does the same).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::trace::epoch_us;

use crate::error::Error;

/// Where a recorded collective is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Issued, waiting for earlier calls.
    Scheduled,
    /// Running.
    Started,
    /// Finished successfully.
    Completed,
    /// Finished with an error.
    Failed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Scheduled => "scheduled",
            State::Started => "started",
            State::Completed => "completed",
            State::Failed => "failed",
        }
    }
}

/// One collective as recorded.
#[derive(Debug)]
pub struct Entry {
    /// Sequence number in its group.
    pub seq: u64,
    /// Operation (`all_reduce`, …).
    pub op: &'static str,
    /// Element type.
    pub dtype: String,
    /// Elements per rank.
    pub count: usize,
    /// Root or peer, if any.
    pub peer: Option<usize>,
    inner: Mutex<Times>,
}

#[derive(Debug)]
struct Times {
    state: State,
    scheduled: SystemTime,
    started: Option<(SystemTime, Instant)>,
    finished: Option<SystemTime>,
    /// Set by the watchdog when it gives up on the call: the ranks that had not reached
    /// it, and how long it ran.
    watchdog: Option<(Vec<usize>, Duration)>,
}

impl Entry {
    /// Marks the call as running.
    pub fn start(&self) {
        let mut t = self.lock();
        t.state = State::Started;
        t.started = Some((SystemTime::now(), Instant::now()));
    }

    /// Marks the call as finished.
    pub fn finish(&self, ok: bool) {
        let mut t = self.lock();
        t.state = if ok { State::Completed } else { State::Failed };
        t.finished = Some(SystemTime::now());
    }

    /// The state now.
    pub fn state(&self) -> State {
        self.lock().state
    }

    /// How long it has been running, if it is.
    pub fn running_for(&self) -> Option<Duration> {
        let t = self.lock();
        match (t.state, t.started) {
            (State::Started, Some((_, at))) => Some(at.elapsed()),
            _ => None,
        }
    }

    /// Records the watchdog's verdict: the ranks that had not reached this call when it
    /// ran for `waited`.
    pub fn set_timed_out(&self, behind: Vec<usize>, waited: Duration) {
        self.lock().watchdog = Some((behind, waited));
    }

    /// The error the watchdog gave this call on `rank`, if it did.
    pub fn watchdog_error(&self, rank: usize) -> Option<Error> {
        self.lock()
            .watchdog
            .clone()
            .map(|(waiting_on, waited)| Error::Timeout {
                op: format!("{} (watchdog)", self.op),
                seq: self.seq,
                rank,
                waiting_on,
                stalled: None,
                waited,
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Times> {
        crate::lock(&self.inner)
    }

    fn to_json(&self) -> serde_json::Value {
        let t = self.lock();
        serde_json::json!({
            "seq": self.seq,
            "op": self.op,
            "dtype": self.dtype,
            "count": self.count,
            "peer": self.peer,
            "state": t.state.name(),
            "scheduled_us": epoch_us(t.scheduled),
            "started_us": t.started.map(|(s, _)| epoch_us(s)),
            "finished_us": t.finished.map(epoch_us),
            "duration_us": match (t.started, t.finished) {
                (Some((s, _)), Some(f)) => f.duration_since(s).ok().map(|d| d.as_micros() as u64),
                _ => None,
            },
        })
    }
}

/// The last `capacity` collectives of a group.
#[derive(Debug)]
pub struct FlightRecorder {
    capacity: usize,
    entries: Mutex<VecDeque<Arc<Entry>>>,
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` entries.
    pub fn new(capacity: usize) -> Self {
        FlightRecorder {
            capacity: capacity.max(1),
            entries: Mutex::new(VecDeque::new()),
        }
    }

    /// Records a newly issued call.
    pub fn schedule(
        &self,
        seq: u64,
        op: &'static str,
        dtype: String,
        count: usize,
        peer: Option<usize>,
    ) -> Arc<Entry> {
        let e = Arc::new(Entry {
            seq,
            op,
            dtype,
            count,
            peer,
            inner: Mutex::new(Times {
                state: State::Scheduled,
                scheduled: SystemTime::now(),
                started: None,
                finished: None,
                watchdog: None,
            }),
        });
        let mut q = crate::lock(&self.entries);
        if q.len() == self.capacity {
            q.pop_front();
        }
        q.push_back(e.clone());
        e
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        crate::lock(&self.entries).iter().cloned().collect()
    }

    /// The oldest call still running longer than `timeout`, if any.
    pub fn overdue(&self, timeout: Duration) -> Option<(Arc<Entry>, Duration)> {
        self.entries()
            .into_iter()
            .find_map(|e| e.running_for().filter(|d| *d > timeout).map(|d| (e, d)))
    }

    /// The recorder as JSON, with why it was dumped.
    pub fn dump(
        &self,
        group: &str,
        rank: usize,
        stuck_seq: Option<u64>,
        reason: &str,
    ) -> serde_json::Value {
        serde_json::json!({
            "group": group,
            "rank": rank,
            "reason": reason,
            "stuck_seq": stuck_seq,
            "entries": self.entries().iter().map(|e| e.to_json()).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_entries_and_their_states() {
        let r = FlightRecorder::new(3);
        let es: Vec<_> = (0..5)
            .map(|s| r.schedule(s, "all_reduce", "float".into(), 10, None))
            .collect();
        es[3].start();
        es[3].finish(true);
        es[4].start();
        let seqs: Vec<u64> = r.entries().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [2, 3, 4]);
        assert_eq!(es[3].state(), State::Completed);
        assert!(r.overdue(Duration::ZERO).is_some_and(|(e, _)| e.seq == 4));
        assert!(r.overdue(Duration::from_secs(60)).is_none());
        let d = r.dump("g", 0, Some(4), "test");
        assert_eq!(d["stuck_seq"], 4);
        assert_eq!(d["entries"][2]["state"], "started");
        assert_eq!(d["entries"][1]["state"], "completed");
    }
}
