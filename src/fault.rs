//! Fault injection for the failure-model tests (cargo feature `fault-injection`, which
//! the test suite turns on; a build without the feature has none of this).
//!
//! `FERROCCL_FAULT_INJECT=ACTION:STEP:CALL` makes this process fail on purpose the first
//! time its engine starts a plan step of kind `STEP` during a call whose sequence number
//! on its communicator is `CALL` or later:
//!
//! - `ACTION`: `kill` sends the process SIGKILL (a crash: nothing is cleaned up, no
//!   close notice is sent), `stop` sends it SIGSTOP (a stalled rank, alive but silent,
//!   until someone sends SIGCONT), `exit` ends it with `_exit(9)` (no destructors).
//! - `STEP`: `send` (a step that only sends), `recv` (only receives), `reduce` (any step
//!   that reduces: `RecvReduceSend`, `RecvReduceCopy`, `RecvReduceCopySend`, `Reduce`),
//!   `copy` (a step that copies without reducing: `CopySend`, `RecvCopySend`, `Copy`),
//!   or `any`.
//!
//! The fault strikes at most once per process, at the start of the step, in whichever
//! thread runs the plan (the caller's for blocking calls and groups, the progress
//! thread's for asynchronous ones).

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::plan::Step;

/// The environment variable read.
pub const VARIABLE: &str = "FERROCCL_FAULT_INJECT";

/// What the process does to itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Stop,
    /// `_exit(9)`.
    Exit,
}

/// Which steps a fault waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// `Send`.
    Send,
    /// `Recv`.
    Recv,
    /// A step that reduces.
    Reduce,
    /// A step that copies without reducing.
    Copy,
    /// Any step.
    Any,
}

impl StepKind {
    /// The kind of `step`.
    pub fn of(step: &Step) -> StepKind {
        match step {
            Step::Send { .. } => StepKind::Send,
            Step::Recv { .. } => StepKind::Recv,
            Step::RecvReduceSend { .. }
            | Step::RecvReduceCopy { .. }
            | Step::RecvReduceCopySend { .. }
            | Step::Reduce { .. } => StepKind::Reduce,
            Step::CopySend { .. } | Step::RecvCopySend { .. } | Step::Copy { .. } => StepKind::Copy,
        }
    }

    fn matches(self, step: &Step) -> bool {
        self == StepKind::Any || self == StepKind::of(step)
    }
}

/// A parsed `FERROCCL_FAULT_INJECT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub action: Action,
    /// At which kind of step.
    pub step: StepKind,
    /// From which call (sequence number) on.
    pub call: u64,
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let [action, step, call] = parts[..] else {
            return Err(format!("{s:?}: want ACTION:STEP:CALL, e.g. kill:reduce:3"));
        };
        let action = match action {
            "kill" => Action::Kill,
            "stop" => Action::Stop,
            "exit" => Action::Exit,
            other => return Err(format!("action {other:?}: want kill, stop or exit")),
        };
        let step = match step {
            "send" => StepKind::Send,
            "recv" => StepKind::Recv,
            "reduce" => StepKind::Reduce,
            "copy" => StepKind::Copy,
            "any" => StepKind::Any,
            other => {
                return Err(format!(
                    "step {other:?}: want send, recv, reduce, copy or any"
                ));
            }
        };
        let call = call
            .parse()
            .map_err(|_| format!("call {call:?}: want a call sequence number"))?;
        Ok(Fault { action, step, call })
    }
}

/// The fault this process was asked for, parsed once.
fn configured() -> &'static std::result::Result<Option<Fault>, String> {
    static FAULT: OnceLock<std::result::Result<Option<Fault>, String>> = OnceLock::new();
    FAULT.get_or_init(|| match std::env::var(VARIABLE) {
        Ok(v) => v.parse().map(Some),
        Err(_) => Ok(None),
    })
}

static STRUCK: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The fault, while this thread runs a call it applies to.
    static ARMED: Cell<Option<Fault>> = const { Cell::new(None) };
}

/// Called when a call with sequence number `seq` starts running in this thread: arms
/// the fault for its steps if it applies. A malformed variable is an error naming it.
pub fn arm(seq: u64) -> Result<()> {
    let fault = match configured() {
        Ok(f) => *f,
        Err(e) => return Err(Error::invalid(format!("{VARIABLE}: {e}"))),
    };
    let armed = fault.filter(|f| seq >= f.call && !STRUCK.load(Ordering::Relaxed));
    ARMED.with(|a| a.set(armed));
    Ok(())
}

/// Called as the engine starts `step`: strikes if the armed fault waits for its kind.
pub fn strike(step: &Step) {
    let Some(fault) = ARMED.with(|a| a.get()) else {
        return;
    };
    if !fault.step.matches(step) || STRUCK.swap(true, Ordering::Relaxed) {
        return;
    }
    ARMED.with(|a| a.set(None));
    tracing::warn!("{VARIABLE}: {:?} at step `{step}`", fault.action);
    // SAFETY: plain signal and exit calls on this process; nothing is borrowed.
    unsafe {
        match fault.action {
            Action::Kill => {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Action::Stop => {
                libc::kill(libc::getpid(), libc::SIGSTOP);
            }
            Action::Exit => libc::_exit(9),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_what_is_wrong() {
        assert_eq!(
            "kill:reduce:3".parse::<Fault>(),
            Ok(Fault {
                action: Action::Kill,
                step: StepKind::Reduce,
                call: 3
            })
        );
        assert!("stop:any:0".parse::<Fault>().is_ok());
        for (bad, named) in [
            ("kill:reduce", "ACTION:STEP:CALL"),
            ("maim:send:1", "maim"),
            ("kill:sned:1", "sned"),
            ("kill:send:x", "\"x\""),
        ] {
            let e = bad.parse::<Fault>().unwrap_err();
            assert!(e.contains(named), "{bad}: {e}");
        }
    }
}
