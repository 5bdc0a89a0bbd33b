//! Is a peer process still alive? A `pidfd` (opened while the peer is known to be
//! alive, so a recycled pid can never be mistaken for it) becomes readable when the
//! process exits, even before its parent reaps it; without pidfds, `/proc/<pid>/stat`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// How to tell whether one peer still runs.
#[derive(Debug)]
pub enum Liveness {
    /// The peer is a thread of this process: it cannot die alone (a panicking rank
    /// closes its communicator while unwinding).
    SameProcess,
    /// The peer is another process on this host.
    Process {
        /// Its pid.
        pid: u32,
        /// A pidfd for it, when the kernel has them.
        pidfd: Option<OwnedFd>,
    },
}

impl Liveness {
    /// Starts watching process `pid`.
    pub fn watch(pid: u32) -> Self {
        // SAFETY: pidfd_open(pid, 0) takes no pointers; a non-negative result is a new
        // descriptor that we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let pidfd = (fd >= 0).then(|| {
            // SAFETY: `fd` is a freshly opened descriptor owned by nobody else.
            unsafe { OwnedFd::from_raw_fd(fd as i32) }
        });
        Liveness::Process { pid, pidfd }
    }

    /// Whether the peer has exited (or been killed). Cheap: one `poll` or one small
    /// file read.
    pub fn has_exited(&self) -> bool {
        match self {
            Liveness::SameProcess => false,
            Liveness::Process {
                pidfd: Some(fd), ..
            } => {
                let mut pfd = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                let n = unsafe { libc::poll(&mut pfd, 1, 0) };
                n > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP) != 0
            }
            Liveness::Process { pid, pidfd: None } => {
                match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                    // The state follows the parenthesised command name.
                    Ok(stat) => stat
                        .rsplit_once(") ")
                        .is_some_and(|(_, rest)| rest.starts_with(['Z', 'X'])),
                    Err(_) => true,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_child_is_seen_dead_before_it_is_reaped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let watch = Liveness::watch(child.id());
        assert!(!watch.has_exited());
        child.kill().unwrap();
        let start = std::time::Instant::now();
        while !watch.has_exited() {
            assert!(start.elapsed().as_secs() < 5, "death not noticed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!Liveness::watch(std::process::id()).has_exited());
    }
}
