//! Asynchronous calls: one progress thread per communicator, and the ticket order that
//! keeps blocking and asynchronous calls in the order they were issued.
//!
//! Every call on a communicator takes a ticket when it is issued and runs only when all
//! earlier tickets are done, so a rank's calls reach the wire in issue order — which is
//! what makes them match the other ranks' — whether they run in the caller's thread
//! (blocking calls: no hand-off) or on the progress thread (asynchronous calls, fed by a
//! queue, started on first use).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::Duration;

use crate::error::{Error, Result};

thread_local! {
    /// The [`Turns`] (by address) whose call this thread is running in its turn, so
    /// that calls made from inside it on the same communicator (an asynchronous job
    /// calling a blocking method) do not queue behind themselves; 0 when none. Calls on
    /// another communicator still take their turn there.
    static IN_TURN: Cell<usize> = const { Cell::new(0) };
}

/// Issue-order tickets.
///
/// The uncontended path (a blocking call whose turn it already is) costs two atomic
/// operations; the mutex and condition variable are touched only when a call has to
/// wait for an earlier one.
#[derive(Debug, Default)]
pub struct Turns {
    issued: AtomicU64,
    /// Tickets completed (the ticket whose turn it is).
    done: AtomicU64,
    /// Calls blocked waiting for their turn.
    waiters: AtomicU64,
    lock: Mutex<()>,
    advanced: Condvar,
}

impl Turns {
    /// Takes the next ticket.
    pub fn ticket(&self) -> u64 {
        self.issued.fetch_add(1, Ordering::SeqCst)
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        crate::lock(&self.lock)
    }

    /// Waits until every ticket before `ticket` is done, runs `f`, then lets the next
    /// ticket go.
    pub fn run_in_turn<R>(&self, ticket: u64, f: impl FnOnce() -> R) -> R {
        if self.done.load(Ordering::SeqCst) != ticket {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let mut g = self.guard();
            while self.done.load(Ordering::SeqCst) != ticket {
                g = self.advanced.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            drop(g);
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
        struct Finish<'a>(&'a Turns, usize);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                IN_TURN.with(|t| t.set(self.1));
                let turns = self.0;
                turns.done.fetch_add(1, Ordering::SeqCst);
                // A waiter either saw the new `done` or is counted here; it checks
                // `done` under the lock, so notifying under the lock cannot be missed.
                if turns.waiters.load(Ordering::SeqCst) > 0 {
                    let _g = turns.guard();
                    turns.advanced.notify_all();
                }
            }
        }
        let outer = IN_TURN.with(|t| t.replace(self as *const Turns as usize));
        let _finish = Finish(self, outer);
        f()
    }

    /// Runs `f` now if this thread is already inside its turn, else in a new turn.
    pub fn run_blocking<R>(&self, f: impl FnOnce() -> R) -> R {
        if IN_TURN.with(Cell::get) == self as *const Turns as usize {
            f()
        } else {
            let t = self.ticket();
            self.run_in_turn(t, f)
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs submitted jobs one after another.
#[derive(Debug)]
pub struct ProgressThread {
    queue: Mutex<Option<Sender<Job>>>,
    handle: Mutex<Option<JoinHandle<()>>>,
    id: ThreadId,
}

impl ProgressThread {
    /// Starts the thread.
    pub fn start(name: String) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in rx {
                    // A job that panics must not take the thread (and every call queued
                    // behind it) down: its caller sees its result channel close.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .map_err(|e| Error::io("start the progress thread", e))?;
        Ok(ProgressThread {
            id: handle.thread().id(),
            queue: Mutex::new(Some(tx)),
            handle: Mutex::new(Some(handle)),
        })
    }

    /// Queues `job`.
    pub fn submit(&self, job: Job) -> Result<()> {
        let queue = crate::lock(&self.queue);
        match queue.as_ref() {
            Some(tx) => tx.send(job).map_err(|_| Error::Aborted {
                rank: usize::MAX,
                reason: "the progress thread has stopped".into(),
            }),
            None => Err(Error::Aborted {
                rank: usize::MAX,
                reason: "the communicator is being destroyed".into(),
            }),
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has run what was queued.
        crate::lock(&self.queue).take();
        let handle = crate::lock(&self.handle).take();
        // The last owner may be a job on the progress thread itself: it cannot join
        // itself, and it ends on its own once the queue is closed.
        if let Some(h) = handle
            && std::thread::current().id() != self.id
        {
            let _ = h.join();
        }
    }
}

/// The result of an asynchronous call, once it is done.
#[derive(Debug)]
pub struct Pending<R> {
    rx: Receiver<Result<R>>,
    ready: Option<Result<R>>,
}

/// Makes a [`Pending`] and the function that completes it.
pub fn pending<R: Send + 'static>() -> (Pending<R>, impl FnOnce(Result<R>) + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    (Pending { rx, ready: None }, move |r| drop(tx.send(r)))
}

impl<R> Pending<R> {
    fn poll(&mut self, wait: Option<Duration>) {
        if self.ready.is_some() {
            return;
        }
        let got = match wait {
            None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => self.rx.recv_timeout(d),
        };
        self.ready = match got {
            Ok(r) => Some(r),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Err(Error::Aborted {
                rank: usize::MAX,
                reason: "the call was dropped before it ran (communicator destroyed)".into(),
            })),
        };
    }

    /// Whether the call has finished (successfully or not).
    pub fn is_completed(&mut self) -> bool {
        self.poll(Some(Duration::ZERO));
        self.ready.is_some()
    }

    /// Waits for the call and returns its result.
    pub fn wait(mut self) -> Result<R> {
        self.poll(None);
        self.ready
            .take()
            .expect("a blocking poll always yields a result")
    }

    /// Waits at most `timeout`; `Err(self)` if the call is still running.
    pub fn wait_timeout(mut self, timeout: Duration) -> std::result::Result<Result<R>, Self> {
        self.poll(Some(timeout));
        match self.ready.take() {
            Some(r) => Ok(r),
            None => Err(self),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn tickets_run_in_issue_order_across_threads() {
        let turns = Arc::new(Turns::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        let tickets: Vec<u64> = (0..8).map(|_| turns.ticket()).collect();
        let hs: Vec<_> = tickets
            .into_iter()
            .rev()
            .map(|t| {
                let (turns, log) = (turns.clone(), log.clone());
                std::thread::spawn(move || turns.run_in_turn(t, || log.lock().unwrap().push(t)))
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*log.lock().unwrap(), (0..8).collect::<Vec<_>>());
        // Inside a turn, a blocking call runs at once instead of waiting for itself.
        let t = turns.ticket();
        assert_eq!(turns.run_in_turn(t, || turns.run_blocking(|| 42)), 42);
    }

    #[test]
    fn a_turn_on_one_communicator_does_not_skip_anothers_order() {
        let (a, b) = (Turns::default(), Arc::new(Turns::default()));
        let log = Arc::new(Mutex::new(Vec::new()));
        let earlier = b.ticket();
        let t = {
            let (b, log) = (b.clone(), log.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                b.run_in_turn(earlier, || log.lock().unwrap().push("b: earlier"));
            })
        };
        // Inside a turn of `a`, a blocking call on `b` still waits for `b`'s earlier one.
        a.run_blocking(|| b.run_blocking(|| log.lock().unwrap().push("b: later")));
        t.join().unwrap();
        assert_eq!(*log.lock().unwrap(), ["b: earlier", "b: later"]);
    }

    #[test]
    fn pending_results_arrive() {
        let thread = ProgressThread::start("test-progress".into()).unwrap();
        let (p, complete) = pending::<u32>();
        thread
            .submit(Box::new(move || {
                std::thread::sleep(Duration::from_millis(20));
                complete(Ok(7));
            }))
            .unwrap();
        let p = match p.wait_timeout(Duration::ZERO) {
            Err(p) => p,
            Ok(r) => panic!("done too early: {r:?}"),
        };
        assert_eq!(p.wait().unwrap(), 7);
    }
}
