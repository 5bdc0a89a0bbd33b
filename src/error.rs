//! One structured error type for the whole library.
//!
//! Every failure ferroccl reports is a variant of [`Error`], carrying the facts a user needs
//! to act on it (which key, which rank, how long it waited) rather than a formatted string.
//! The C ABI maps these to `ncclResult_t` at its edge; Rust callers match on the variants.

use std::io;
use std::time::Duration;

/// The result type used throughout ferroccl.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ferroccl.
///
/// The enum is `#[non_exhaustive]`: later layers (transports, engine, C ABI) add variants
/// without breaking callers that match on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller passed a value that can never be valid (bad rank, empty key list, …).
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// What was wrong, naming the argument.
        what: String,
    },

    /// A store key is longer than the store accepts.
    #[error("store key of {len} bytes exceeds the limit of {max} bytes")]
    KeyTooLong {
        /// Length of the rejected key in bytes.
        len: usize,
        /// The limit in force.
        max: usize,
    },

    /// A store value is larger than the store accepts.
    #[error("store value of {len} bytes exceeds the limit of {max} bytes")]
    ValueTooLarge {
        /// Length of the rejected value in bytes.
        len: usize,
        /// The limit in force.
        max: usize,
    },

    /// A store operation waited for keys that did not all appear in time.
    #[error("{op} timed out after {waited:?}; keys still missing: {missing:?}")]
    StoreTimeout {
        /// The store operation (`wait`, `get`, `multi_get`, …).
        op: &'static str,
        /// How long it waited.
        waited: Duration,
        /// The keys that were still not set when it gave up.
        missing: Vec<String>,
    },

    /// A stored value could not be used as the operation requires (e.g. `add` on a
    /// key whose value is not a decimal integer).
    #[error("store key {key:?}: {detail}")]
    StoreValue {
        /// The key whose value was unusable.
        key: String,
        /// Why it was unusable.
        detail: String,
    },

    /// A TCP store client could not reach its server before the deadline.
    #[error("could not connect to store server at {addr} within {waited:?}: {source}")]
    StoreConnect {
        /// Address of the server.
        addr: String,
        /// How long the client kept retrying.
        waited: Duration,
        /// The last connection error.
        #[source]
        source: io::Error,
    },

    /// The connection to a TCP store server broke (server gone, reset, or silent past the
    /// store timeout) while an operation was in flight.
    #[error("store server at {addr} failed during {op}: {source}")]
    StoreConnection {
        /// Address of the server.
        addr: String,
        /// The operation in flight.
        op: &'static str,
        /// The underlying I/O error (EOF shows as `UnexpectedEof`).
        #[source]
        source: io::Error,
    },

    /// A peer violated the store wire protocol.
    #[error("store protocol error: {detail}")]
    StoreProtocol {
        /// What was malformed.
        detail: String,
    },

    /// An environment variable needed for initialisation is missing or malformed.
    #[error("environment variable {var}: {detail}")]
    Env {
        /// The variable's name.
        var: String,
        /// What was wrong with it.
        detail: String,
    },

    /// Not every rank arrived at a bootstrap rendezvous before the deadline.
    #[error(
        "bootstrap {phase} timed out after {waited:?}: {} of {world_size} ranks missing: {missing:?}",
        missing.len()
    )]
    BootstrapTimeout {
        /// Which rendezvous (`all_gather`, `barrier`, …).
        phase: String,
        /// The number of ranks expected.
        world_size: usize,
        /// The ranks that never arrived.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },

    /// A rendezvous payload from another rank could not be decoded.
    #[error("bootstrap: malformed data from rank {rank}: {detail}")]
    BootstrapData {
        /// The rank whose data was malformed.
        rank: usize,
        /// What was wrong.
        detail: String,
    },

    /// The request is valid but this build or machine cannot serve it (e.g. ranks on
    /// several hosts before the network transport exists, device memory without CUDA).
    #[error("not supported: {what}")]
    Unsupported {
        /// What cannot be done, and why.
        what: String,
    },

    /// The CUDA driver or NVRTC is missing, or one of their calls failed.
    #[error("CUDA: {what}")]
    Cuda {
        /// What was asked of CUDA and what it answered (or why it could not be asked).
        what: String,
    },

    /// A collective could not complete because a peer failed: its process died, or it
    /// closed or aborted its communicator.
    #[error("rank {rank}: {op} #{seq} failed: {detail}")]
    PeerFailed {
        /// The operation (`all_reduce`, …).
        op: String,
        /// Its sequence number on this communicator (0 for the first call).
        seq: u64,
        /// The rank reporting the failure.
        rank: usize,
        /// The rank that failed first, as far as this rank can tell.
        failed_rank: usize,
        /// What happened to it.
        detail: String,
    },

    /// A collective did not complete before its deadline.
    #[error(
        "rank {rank}: {op} #{seq} timed out after {waited:?} waiting on ranks {waiting_on:?}{}",
        stalled.map_or(String::new(), |s| format!(
            "; the waits lead to rank {s}, which is not running (stopped, or busy outside \
             the call)"
        ))
    )]
    Timeout {
        /// The operation.
        op: String,
        /// Its sequence number on this communicator.
        seq: u64,
        /// The rank reporting it.
        rank: usize,
        /// The peers it was still waiting for.
        waiting_on: Vec<usize>,
        /// The rank that stalls the wait, when the peers waited on wait in turn (through
        /// this host) for a rank that is not running.
        stalled: Option<usize>,
        /// How long it waited.
        waited: Duration,
    },

    /// The communicator was aborted (by its owner, or after an earlier failure) and can
    /// no longer be used.
    #[error("rank {rank}: communicator aborted: {reason}")]
    Aborted {
        /// The rank whose communicator it is.
        rank: usize,
        /// Why it was aborted (the earlier error, or "aborted by the user").
        reason: String,
    },

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What ferroccl was doing.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(what: impl Into<String>) -> Self {
        Error::InvalidArgument { what: what.into() }
    }

    /// Shorthand for [`Error::Io`] with a context string.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The rank a collective's failure blames, if it names one: the peer that failed
    /// first, or the rank a timeout's waits led to (else the first rank waited on). A
    /// job that goes on without it passes it to [`Communicator::shrink`](crate::Communicator::shrink).
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            Error::PeerFailed { failed_rank, .. } => Some(*failed_rank),
            Error::Timeout {
                stalled,
                waiting_on,
                ..
            } => stalled.or(waiting_on.first().copied()),
            _ => None,
        }
    }
}

/// The reason of a communicator aborted by its owner.
pub const ABORTED_BY_USER: &str = "aborted by the user";

/// What a call is, for error messages and the deadline.
#[derive(Clone, Debug)]
pub struct CallInfo {
    /// The operation's name (`all_reduce`, `group`, …).
    pub op: &'static str,
    /// Its sequence number on the communicator.
    pub seq: u64,
    /// How long it may take. The clock starts when the call first has to wait (a call
    /// that never waits reads no clock: on a VM a clock read costs tens of
    /// nanoseconds, a fifth of a small all-reduce).
    pub timeout: Duration,
}

impl CallInfo {
    /// The error `rank` returns for this call when `failure` (the rank to blame, and
    /// what happened) ended it.
    pub fn peer_failed(&self, rank: usize, (failed_rank, detail): (usize, String)) -> Error {
        Error::PeerFailed {
            op: self.op.to_string(),
            seq: self.seq,
            rank,
            failed_rank,
            detail,
        }
    }

    /// The error `rank` returns for this call when its deadline passed after `waited`,
    /// waiting on `waiting_on` (and, where known, on the `stalled` rank behind them).
    pub fn timed_out(
        &self,
        rank: usize,
        waiting_on: Vec<usize>,
        stalled: Option<usize>,
        waited: Duration,
    ) -> Error {
        Error::Timeout {
            op: self.op.to_string(),
            seq: self.seq,
            rank,
            waiting_on,
            stalled,
            waited,
        }
    }
}
