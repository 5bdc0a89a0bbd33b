//! What an `ncclComm_t` points to, and the registry that tells a live handle from a
//! destroyed or made-up one.
//!
//! The pointer handed to C is the address of a [`CommHandle`] kept alive by the
//! registry; every call looks it up there first, so a NULL, destroyed or foreign
//! handle is an `ncclInvalidArgument` with a message, never a dereference.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use super::{Failure, IN_PROGRESS, INVALID_ARGUMENT, INVALID_USAGE, result_of};
use crate::comm::Communicator;
use crate::lock;
use crate::types::{DataType, ReduceOp, Scalar};

/// Where a communicator is in its life.
pub enum Life {
    /// Its (deferred or non-blocking) initialisation has not finished.
    Initializing,
    /// Usable.
    Ready(Arc<Communicator>),
    /// Initialisation failed with this result and message.
    Failed(i32, String),
    /// `ncclCommFinalize` was called: only destroy is left.
    Finalized(Arc<Communicator>),
}

/// A reduction op made by `ncclRedOpCreatePreMulSum`.
#[derive(Clone, Copy, Debug)]
pub enum UserOp {
    /// The scalar, read when the op was made (`ncclScalarHostImmediate`).
    Immediate(DataType, Scalar),
    /// The scalar's address, read at every call (`ncclScalarDevice`; host memory here).
    AtCall(DataType, usize),
}

/// One communicator as the C API sees it.
pub struct CommHandle {
    /// The communicator, once initialised.
    pub life: Mutex<Life>,
    /// Whether the config asked for non-blocking calls (`blocking = 0`).
    pub nonblocking: bool,
    /// This rank (known from the init call, before initialisation finishes).
    pub rank: usize,
    /// Number of ranks.
    pub nranks: usize,
    /// Ops from `ncclRedOpCreatePreMulSum`: op value `ncclNumOps + i` is slot `i`.
    pub user_ops: Mutex<Vec<Option<UserOp>>>,
    /// Live registrations (`ncclCommRegister`), by the handle C got.
    pub registrations: Mutex<HashMap<usize, crate::transport::Registration>>,
    /// Live windows (`ncclCommWindowRegister`), by the handle C got.
    pub windows: Mutex<HashMap<usize, crate::transport::window::Window>>,
}

fn registry() -> &'static Mutex<HashMap<usize, Arc<CommHandle>>> {
    static LIVE: OnceLock<Mutex<HashMap<usize, Arc<CommHandle>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

impl CommHandle {
    /// A new handle in the registry; returns it and the pointer C gets.
    pub fn register(
        life: Life,
        nonblocking: bool,
        rank: usize,
        nranks: usize,
    ) -> (Arc<CommHandle>, *mut c_void) {
        let h = Arc::new(CommHandle {
            life: Mutex::new(life),
            nonblocking,
            rank,
            nranks,
            user_ops: Mutex::new(Vec::new()),
            registrations: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
        });
        let ptr = Arc::as_ptr(&h) as *mut c_void;
        lock(registry()).insert(ptr as usize, h.clone());
        (h, ptr)
    }

    /// The live handle at `ptr`.
    pub fn find(ptr: *const c_void) -> Result<Arc<CommHandle>, Failure> {
        if ptr.is_null() {
            return Err(Failure::new(INVALID_ARGUMENT, "comm is NULL"));
        }
        lock(registry())
            .get(&(ptr as usize))
            .cloned()
            .ok_or_else(|| {
                Failure::new(
                    INVALID_ARGUMENT,
                    format!(
                        "comm {ptr:?} is not a live communicator (destroyed, aborted, or never \
                     created by ncclCommInit*)"
                    ),
                )
            })
    }

    /// Removes the handle at `ptr` from the registry (destroy / abort).
    pub fn unregister(ptr: *const c_void) -> Option<Arc<CommHandle>> {
        lock(registry()).remove(&(ptr as usize))
    }

    /// The communicator, if it can run calls now.
    pub fn communicator(&self) -> Result<Arc<Communicator>, Failure> {
        match &*lock(&self.life) {
            Life::Ready(c) => Ok(c.clone()),
            Life::Initializing => Err(Failure::new(
                INVALID_USAGE,
                "the communicator is still initialising (non-blocking init or an open \
                 group): poll ncclCommGetAsyncError until it is not ncclInProgress",
            )),
            Life::Failed(code, why) => Err(Failure::new(
                *code,
                format!("the communicator's initialisation failed: {why}"),
            )),
            Life::Finalized(_) => Err(Failure::new(
                INVALID_USAGE,
                "the communicator was finalized (ncclCommFinalize): only ncclCommDestroy \
                 may follow",
            )),
        }
    }

    /// The communicator whatever its state after init (for count / rank queries).
    pub fn any_communicator(&self) -> Result<Arc<Communicator>, Failure> {
        match &*lock(&self.life) {
            Life::Ready(c) | Life::Finalized(c) => Ok(c.clone()),
            _ => self.communicator(),
        }
    }

    /// What `ncclCommGetAsyncError` reports.
    pub fn async_error(&self) -> i32 {
        self.async_error_and_reason().0
    }

    /// [`async_error`](Self::async_error) with the failure's description, if any.
    pub fn async_error_and_reason(&self) -> (i32, Option<String>) {
        // The life lock is released before asking the communicator anything.
        let comm = match &*lock(&self.life) {
            Life::Initializing => return (IN_PROGRESS, None),
            Life::Failed(code, why) => return (*code, Some(why.clone())),
            Life::Ready(c) | Life::Finalized(c) => c.clone(),
        };
        comm.poll_device();
        match comm.failure() {
            None => (super::SUCCESS, None),
            Some(why) => (
                result_of(&crate::Error::Aborted {
                    rank: comm.rank(),
                    reason: why.clone(),
                }),
                Some(why),
            ),
        }
    }

    /// Sets the outcome of a deferred or non-blocking initialisation.
    pub fn finish_init(&self, outcome: crate::Result<Communicator>) {
        *lock(&self.life) = match outcome {
            Ok(c) => Life::Ready(Arc::new(c)),
            Err(e) => Life::Failed(result_of(&e), e.to_string()),
        };
    }

    /// Resolves an `ncclRedOp_t` value: a built-in op, or one this communicator made.
    pub fn reduce_op(&self, op: i32, dtype: DataType) -> Result<ReduceOp, Failure> {
        if (0..super::NUM_OPS).contains(&op) {
            return ReduceOp::from_nccl(op).map_err(|e| Failure::from_error(&e));
        }
        let unknown = || {
            Failure::new(
                INVALID_ARGUMENT,
                format!(
                    "reduction op {op} is neither built in (0..=4) nor made on this \
                     communicator by ncclRedOpCreatePreMulSum (or it was destroyed)"
                ),
            )
        };
        let index = usize::try_from(op - super::NUM_OPS).map_err(|_| unknown())?;
        let found = lock(&self.user_ops).get(index).copied().flatten();
        let (made_for, scalar) = match found.ok_or_else(unknown)? {
            UserOp::Immediate(t, s) => (t, s),
            UserOp::AtCall(t, addr) => {
                // SAFETY: the application promised, when making the op, that the scalar
                // stays readable at this address for the op's lifetime.
                (t, unsafe { super::read_scalar(addr as *const c_void, t) }?)
            }
        };
        if made_for != dtype {
            return Err(Failure::new(
                INVALID_ARGUMENT,
                format!(
                    "reduction op {op} was made for {made_for} but the call is on {dtype} \
                     (NCCL ops from ncclRedOpCreatePreMulSum are per data type)"
                ),
            ));
        }
        Ok(ReduceOp::PreMulSum(scalar))
    }
}

/// Settings read from an `ncclConfig_t`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConfigSettings {
    /// `blocking = 0`.
    pub nonblocking: bool,
    /// ferroccl's `ferrocclDeterministic`, when set (configs from ferroccl's header only).
    pub deterministic: Option<bool>,
}

impl ConfigSettings {
    /// `config` with these settings applied.
    pub fn apply(&self, mut config: crate::comm::CommConfig) -> crate::comm::CommConfig {
        if let Some(on) = self.deterministic {
            config.deterministic = on;
        }
        config
    }
}

/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` puts in every config.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: i32 = i32::MIN;
/// Bytes of a config up to and including `blocking`.
const CONFIG_MIN_SIZE: usize = 20;
/// `sizeof(ncclConfig_t)` and `NCCL_VERSION_CODE` of ferroccl's `nccl.h`, whose config
/// ends with `ferrocclDeterministic` at [`DETERMINISTIC_AT`]: a config with both is
/// ferroccl's (NVIDIA's 2.21 config has this size but its own version; later ones are
/// larger).
const FERROCCL_CONFIG: (usize, u32) = (48, 22800);
/// Offset of `ferrocclDeterministic`.
const DETERMINISTIC_AT: usize = 44;

/// Reads the fields ferroccl uses from an `ncclConfig_t` of any NCCL version (they
/// only ever appended fields; `size` says how many there are). NULL means defaults.
///
/// # Safety
/// `config` is NULL or points to a config whose `size` field tells its true size.
pub unsafe fn read_config(config: *const c_void) -> Result<ConfigSettings, Failure> {
    if config.is_null() {
        return Ok(ConfigSettings::default());
    }
    let base = config as *const u8;
    // SAFETY: every config starts with `size_t size; unsigned magic; unsigned version`.
    let (size, magic) = unsafe {
        (
            std::ptr::read_unaligned(base as *const usize),
            std::ptr::read_unaligned(base.add(8) as *const u32),
        )
    };
    if magic != CONFIG_MAGIC {
        return Err(Failure::new(
            INVALID_ARGUMENT,
            format!(
                "config magic is {magic:#x}, not 0xcafebeef: initialise the config with \
                 NCCL_CONFIG_INITIALIZER"
            ),
        ));
    }
    if size < CONFIG_MIN_SIZE {
        return Err(Failure::new(
            INVALID_ARGUMENT,
            format!("config size {size} is too small for an ncclConfig_t"),
        ));
    }
    // SAFETY: `size` covers `blocking` at offset 16 (checked above).
    let blocking = unsafe { std::ptr::read_unaligned(base.add(16) as *const i32) };
    let nonblocking = match blocking {
        0 => true,
        1 | UNDEF_INT => false,
        other => {
            return Err(Failure::new(
                INVALID_ARGUMENT,
                format!("config.blocking is {other}; use 0 or 1"),
            ));
        }
    };
    // SAFETY: `size` covers `version` at offset 12 (checked above).
    let version = unsafe { std::ptr::read_unaligned(base.add(12) as *const u32) };
    let deterministic = if (size, version) == FERROCCL_CONFIG {
        // SAFETY: a config of ferroccl's layout (size checked) has the field there.
        match unsafe { std::ptr::read_unaligned(base.add(DETERMINISTIC_AT) as *const i32) } {
            UNDEF_INT => None,
            0 => Some(false),
            1 => Some(true),
            other => {
                return Err(Failure::new(
                    INVALID_ARGUMENT,
                    format!("config.ferrocclDeterministic is {other}; use 0 or 1"),
                ));
            }
        }
    } else {
        None
    };
    Ok(ConfigSettings {
        nonblocking,
        deterministic,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config of `size` bytes with `version` and `ferrocclDeterministic = value`.
    fn config(size: usize, version: u32, value: i32) -> Vec<u64> {
        let mut words = vec![0u64; size.div_ceil(8)];
        let bytes = words.as_mut_ptr() as *mut u8;
        // SAFETY: every write lies inside `words` (at least 48 bytes here).
        unsafe {
            std::ptr::write_unaligned(bytes as *mut usize, size);
            std::ptr::write_unaligned(bytes.add(8) as *mut u32, CONFIG_MAGIC);
            std::ptr::write_unaligned(bytes.add(12) as *mut u32, version);
            std::ptr::write_unaligned(bytes.add(16) as *mut i32, UNDEF_INT);
            std::ptr::write_unaligned(bytes.add(DETERMINISTIC_AT) as *mut i32, value);
        }
        words
    }

    fn read(words: &[u64]) -> Result<ConfigSettings, Failure> {
        // SAFETY: the buffer is as large as its `size` says.
        unsafe { read_config(words.as_ptr() as *const c_void) }
    }

    #[test]
    fn ferroccls_deterministic_field_is_read_from_ferroccls_configs_only() {
        let (size, version) = FERROCCL_CONFIG;
        assert_eq!(
            read(&config(size, version, 1)).unwrap().deterministic,
            Some(true)
        );
        assert_eq!(
            read(&config(size, version, 0)).unwrap().deterministic,
            Some(false)
        );
        assert_eq!(
            read(&config(size, version, UNDEF_INT))
                .unwrap()
                .deterministic,
            None
        );
        let err = read(&config(size, version, 2)).unwrap_err();
        assert!(
            err.message.contains("ferrocclDeterministic is 2"),
            "{err:?}"
        );
        // NVIDIA's 2.21 config has the same size; later ones put other fields there.
        assert_eq!(read(&config(size, 22105, 1)).unwrap().deterministic, None);
        assert_eq!(read(&config(96, version, 1)).unwrap().deterministic, None);
    }
}
