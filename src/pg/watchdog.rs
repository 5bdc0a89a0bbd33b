//! The watchdog thread of a process group, and the desync check.
//!
//! Every rank's watchdog publishes, through the store, how many collectives its rank
//! has issued (when that changes), and watches for two things: one of its own calls
//! running past the timeout, and another rank's request to dump. On a timeout it
//! requests the dump, names the ranks whose published count shows they never reached
//! the stuck call, gives the call's `Work` that error, dumps its recorder and aborts the
//! communicator.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Inner;
use crate::error::{Error, Result};

/// How often the watchdog looks.
fn period(inner: &Inner) -> Duration {
    (inner.options.timeout / 10).clamp(Duration::from_millis(20), Duration::from_millis(500))
}

pub(super) fn start(inner: Arc<Inner>) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("ferroccl-watchdog-{}", inner.comm.rank()))
        .spawn(move || run(&inner))
        .map_err(|e| Error::io("start the watchdog thread", e))
}

fn progress_key(rank: usize) -> String {
    format!("progress/{rank}")
}

const DUMP_KEY: &str = "dump";

fn run(inner: &Inner) {
    let rank = inner.comm.rank();
    let mut published = u64::MAX;
    let mut dumped = false;
    let mut fired = false;
    let mut last = Instant::now();
    while !inner.stop.load(Ordering::SeqCst) {
        // Short naps, so that destroying a group does not wait for a whole period.
        std::thread::sleep(Duration::from_millis(10));
        if last.elapsed() < period(inner) {
            continue;
        }
        last = Instant::now();
        // The store may be gone when the job ends; the watchdog then has nothing to do.
        let issued = inner.seq.load(Ordering::SeqCst);
        if issued != published
            && inner
                .store
                .set(&progress_key(rank), issued.to_string().as_bytes())
                .is_ok()
        {
            published = issued;
        }
        if !fired && let Some((entry, waited)) = inner.recorder.overdue(inner.options.timeout) {
            fired = true;
            // Ask every rank to dump (and to record the verdict on its own copy of the
            // call) before aborting, so their calls fail with the diagnosis too.
            // A send or receive waits on its one peer (and is numbered apart from the
            // collectives); a collective waits on the ranks that never issued it.
            let p2p = super::is_p2p(entry.op);
            if !p2p {
                let _ = inner.store.set(DUMP_KEY, entry.seq.to_string().as_bytes());
            }
            let behind = match entry.peer {
                Some(peer) if p2p => vec![peer],
                _ => ranks_behind(inner, entry.seq),
            };
            entry.set_timed_out(behind.clone(), waited);
            let error = entry.watchdog_error(rank).expect("just set");
            tracing::error!(
                "rank {rank} group {}: {error}; dumping the flight recorder and aborting",
                inner.name
            );
            if !dumped {
                dump(inner, Some(entry.seq), &format!("timeout: {error}"));
                dumped = true;
            }
            std::thread::sleep(period(inner) * 3);
            match behind.first() {
                Some(&r) if r != rank => inner.comm.abort_blaming(r, &error.to_string()),
                _ => inner.comm.abort(),
            }
        }
        if !dumped
            && inner.store.check(&[DUMP_KEY]).unwrap_or(false)
            && let Ok(v) = inner.store.get(DUMP_KEY)
        {
            let stuck = String::from_utf8_lossy(&v).parse::<u64>().ok();
            // This rank's own copy of the stuck call, if it is waiting in it, fails with
            // the same diagnosis.
            if let Some(seq) = stuck
                && let Some(entry) = inner.recorder.entries().into_iter().find(|e| {
                    e.seq == seq
                        && !super::is_p2p(e.op)
                        && matches!(
                            e.state(),
                            super::recorder::State::Started | super::recorder::State::Scheduled
                        )
                })
            {
                let waited = entry.running_for().unwrap_or_default();
                entry.set_timed_out(ranks_behind(inner, seq), waited);
            }
            dump(inner, stuck, "another rank's watchdog timed out");
            dumped = true;
        }
    }
}

/// Ranks whose published count shows they had not issued call `seq`.
fn ranks_behind(inner: &Inner, seq: u64) -> Vec<usize> {
    (0..inner.comm.size())
        .filter(|&r| {
            let key = progress_key(r);
            let issued = inner
                .store
                .check(&[&key])
                .ok()
                .filter(|&b| b)
                .and_then(|_| inner.store.get(&key).ok())
                .and_then(|v| String::from_utf8_lossy(&v).parse::<u64>().ok())
                .unwrap_or(0);
            issued <= seq
        })
        .collect()
}

/// Writes the recorder to the dump directory and the log.
fn dump(inner: &Inner, stuck: Option<u64>, reason: &str) {
    let rank = inner.comm.rank();
    let doc = inner.recorder.dump(&inner.name, rank, stuck, reason);
    let file = inner.options.dump_dir.join(format!(
        "ferroccl-fr-{}-rank{rank}.json",
        inner.name.replace('/', "_")
    ));
    match std::fs::write(
        &file,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    ) {
        Ok(()) => tracing::error!(
            "rank {rank} group {}: flight recorder dumped to {} ({reason})",
            inner.name,
            file.display()
        ),
        Err(e) => tracing::error!("rank {rank}: cannot write {}: {e}", file.display()),
    }
    tracing::error!("rank {rank} flight recorder: {doc}");
}

/// Every rank publishes the call it is about to make as call `seq` and compares with
/// the others': a mismatch (or a rank that never gets there) is an error naming them.
pub(super) fn check_desync(inner: &Inner, seq: u64, signature: &str) -> Result<()> {
    let rank = inner.comm.rank();
    let n = inner.comm.size();
    let key = |r: usize| format!("desync/{seq}/{r}");
    inner.store.set(&key(rank), signature.as_bytes())?;
    let keys: Vec<String> = (0..n).map(key).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let start = Instant::now();
    if let Err(e) = inner.store.wait(&refs, inner.options.timeout) {
        let missing: Vec<usize> = (0..n)
            .filter(|&r| !inner.store.check(&[&keys[r]]).unwrap_or(false))
            .collect();
        return Err(Error::Timeout {
            op: format!("desync check of collective #{seq} ({signature}); {e}"),
            seq,
            rank,
            waiting_on: missing,
            stalled: None,
            waited: start.elapsed(),
        });
    }
    let all: Vec<String> = inner
        .store
        .multi_get(&refs)?
        .into_iter()
        .map(|v| String::from_utf8_lossy(&v).into_owned())
        .collect();
    let mut kinds: Vec<(String, Vec<usize>)> = Vec::new();
    for (r, s) in all.into_iter().enumerate() {
        match kinds.iter_mut().find(|(k, _)| *k == s) {
            Some((_, ranks)) => ranks.push(r),
            None => kinds.push((s, vec![r])),
        }
    }
    if kinds.len() == 1 {
        return Ok(());
    }
    let described: Vec<String> = kinds
        .iter()
        .map(|(s, ranks)| format!("ranks {ranks:?} called {s}"))
        .collect();
    Err(Error::invalid(format!(
        "collective desync at #{seq} of group {}: {}",
        inner.name,
        described.join(", but ")
    )))
}
