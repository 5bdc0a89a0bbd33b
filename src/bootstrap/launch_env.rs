//! Where a process sits in a job, read from the variables its launcher set.
//!
//! Three launchers are understood, first match wins:
//!
//! | launcher | rank | world size | local rank | local world size |
//! | --- | --- | --- | --- | --- |
//! | torchrun, `ferrorun`, by hand | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` |
//! | Slurm `srun` | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_NTASKS_PER_NODE`, else from `SLURM_TASKS_PER_NODE` |
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//!
//! The store server is always at `MASTER_ADDR:MASTER_PORT` when those are set. Under
//! Slurm, `MASTER_ADDR` defaults to the first host of the step's node list; under Slurm
//! and Open MPI `MASTER_PORT` defaults to [`DEFAULT_MASTER_PORT`]. Under Open MPI
//! `MASTER_ADDR` must be given (`mpirun -x MASTER_ADDR=…`).

use crate::error::{Error, Result};

/// The port used when a launcher gives none (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `RANK`/`WORLD_SIZE` (torchrun, `ferrorun`, or set by hand).
    Torchrun,
    /// Slurm's `srun` (`SLURM_PROCID`, …).
    Slurm,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, …).
    OpenMpi,
}

/// A process's place in the job, as its launcher described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Whose variables these came from.
    pub launcher: Launcher,
    /// This process's rank in `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// This process's rank among the ranks on its host.
    pub local_rank: usize,
    /// Number of ranks on this host.
    pub local_world_size: usize,
    /// Host of the store server.
    pub master_addr: String,
    /// Port of the store server.
    pub master_port: u16,
    /// The launcher already runs the store server (torchrun's
    /// `TORCHELASTIC_USE_AGENT_STORE=True`, which `ferrorun` sets too), so rank 0 must
    /// connect to it rather than start one.
    pub agent_store: bool,
    /// This node's index among the job's nodes (`GROUP_RANK`, set by torchrun and
    /// `ferrorun`), when known. With an agent store, node 0's launcher runs it.
    pub group_rank: Option<usize>,
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads variables through `lookup` (the environment, or a map in tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let number = |name: &str| -> Result<Option<usize>> {
            get(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| Error::Env {
                        var: name.into(),
                        detail: format!("{v:?} is not a non-negative integer"),
                    })
                })
                .transpose()
        };
        let required = |name: &str| -> Result<usize> {
            number(name)?.ok_or_else(|| Error::Env {
                var: name.into(),
                detail: "not set".into(),
            })
        };

        let (launcher, rank, world_size, local_rank, local_world_size) = if get("RANK").is_some() {
            let world = required("WORLD_SIZE")?;
            let rank = required("RANK")?;
            let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
            let local_world = number("LOCAL_WORLD_SIZE")?.unwrap_or(world);
            (Launcher::Torchrun, rank, world, local_rank, local_world)
        } else if get("SLURM_PROCID").is_some() {
            let world = required("SLURM_NTASKS")?;
            let local_world = match number("SLURM_NTASKS_PER_NODE")? {
                Some(n) => n,
                None => {
                    let node = number("SLURM_NODEID")?.unwrap_or(0);
                    get("SLURM_TASKS_PER_NODE")
                        .and_then(|spec| tasks_on_node(&spec, node))
                        .unwrap_or(world)
                }
            };
            (
                Launcher::Slurm,
                required("SLURM_PROCID")?,
                world,
                required("SLURM_LOCALID")?,
                local_world,
            )
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            (
                Launcher::OpenMpi,
                required("OMPI_COMM_WORLD_RANK")?,
                required("OMPI_COMM_WORLD_SIZE")?,
                required("OMPI_COMM_WORLD_LOCAL_RANK")?,
                required("OMPI_COMM_WORLD_LOCAL_SIZE")?,
            )
        } else {
            return Err(Error::Env {
                var: "RANK".into(),
                detail: "not set, and neither are SLURM_PROCID nor OMPI_COMM_WORLD_RANK: \
                         start the program with ferrorun, torchrun, srun or mpirun, or set \
                         RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                    .into(),
            });
        };

        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a.trim().to_string(),
            None if launcher == Launcher::Slurm => get("SLURM_STEP_NODELIST")
                .or_else(|| get("SLURM_JOB_NODELIST"))
                .or_else(|| get("SLURM_NODELIST"))
                .and_then(|list| first_host(&list))
                .ok_or_else(|| Error::Env {
                    var: "MASTER_ADDR".into(),
                    detail: "not set and no Slurm node list to take the first host from".into(),
                })?,
            None => {
                return Err(Error::Env {
                    var: "MASTER_ADDR".into(),
                    detail: "not set: the host of rank 0 (where the store server runs)".into(),
                });
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => p.trim().parse::<u16>().map_err(|_| Error::Env {
                var: "MASTER_PORT".into(),
                detail: format!("{p:?} is not a port number (0..=65535)"),
            })?,
            None if launcher != Launcher::Torchrun => DEFAULT_MASTER_PORT,
            None => {
                return Err(Error::Env {
                    var: "MASTER_PORT".into(),
                    detail: "not set: the port of the store server on MASTER_ADDR".into(),
                });
            }
        };
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        let group_rank = number("GROUP_RANK")?;

        let env = LaunchEnv {
            launcher,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            agent_store,
            group_rank,
        };
        env.validate()?;
        Ok(env)
    }

    fn validate(&self) -> Result<()> {
        let names = match self.launcher {
            Launcher::Torchrun => ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            Launcher::Slurm => [
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE",
            ],
            Launcher::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
        };
        let bad = |var: &str, detail: String| {
            Err(Error::Env {
                var: var.into(),
                detail,
            })
        };
        if self.world_size == 0 {
            return bad(names[1], "is 0; a job has at least one rank".into());
        }
        if self.rank >= self.world_size {
            return bad(
                names[0],
                format!(
                    "{} is not below the world size {}",
                    self.rank, self.world_size
                ),
            );
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return bad(
                names[3],
                format!(
                    "{} is not in 1..={} (the world size)",
                    self.local_world_size, self.world_size
                ),
            );
        }
        if self.local_rank >= self.local_world_size {
            return bad(
                names[2],
                format!(
                    "{} is not below the local world size {}",
                    self.local_rank, self.local_world_size
                ),
            );
        }
        Ok(())
    }

    /// `MASTER_ADDR:MASTER_PORT`, with brackets around an IPv6 address.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// Number of tasks on node `node` from Slurm's `SLURM_TASKS_PER_NODE` (`"4(x2),3"` means
/// 4 tasks on each of the first two nodes, then 3).
fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut first_node = 0;
    for group in spec.split(',') {
        let (count, repeat) = match group.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (group, 1),
        };
        let count = count.trim().parse::<usize>().ok()?;
        if node < first_node + repeat {
            return Some(count);
        }
        first_node += repeat;
    }
    None
}

/// The first host of a Slurm host list (`"node[03-05,9],gpu7"` → `"node03"`).
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find(',').unwrap_or(list.len());
    let bracket = list.find('[');
    match bracket {
        Some(open) if open < end => {
            let close = open + list[open..].find(']')?;
            let first_range = list[open + 1..close].split(',').next()?;
            let first = first_range.split('-').next()?;
            Some(format!(
                "{}{}{}",
                &list[..open],
                first,
                suffix(&list[close + 1..])
            ))
        }
        _ => Some(list[..end].to_string()).filter(|h| !h.is_empty()),
    }
}

/// What follows a bracket group up to the next host (`"-ib,other"` → `"-ib"`).
fn suffix(rest: &str) -> &str {
    &rest[..rest.find([',', '[']).unwrap_or(rest.len())]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let env = read(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert_eq!((env.rank, env.world_size), (5, 8));
        assert_eq!((env.local_rank, env.local_world_size), (1, 4));
        assert_eq!(env.store_addr(), "10.0.0.1:1234");
        assert!(!env.agent_store);
        assert_eq!(env.group_rank, None);
        let env = read(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("GROUP_RANK", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap();
        assert!(env.agent_store);
        assert_eq!(env.group_rank, Some(1));
        let bad = read(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("GROUP_RANK", "x"),
        ]);
        assert!(bad.unwrap_err().to_string().contains("GROUP_RANK"));
    }

    #[test]
    fn slurm_variables_and_defaults() {
        let env = read(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "4,3"),
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
        ])
        .unwrap();
        assert_eq!(env.launcher, Launcher::Slurm);
        assert_eq!((env.rank, env.world_size, env.local_rank), (6, 7, 2));
        assert_eq!(env.local_world_size, 3);
        assert_eq!(env.master_addr, "gpu07");
        assert_eq!(env.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn open_mpi_variables() {
        let env = read(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("MASTER_ADDR", "::1"),
        ])
        .unwrap();
        assert_eq!(env.launcher, Launcher::OpenMpi);
        assert_eq!(env.rank, 3);
        assert_eq!(env.store_addr(), "[::1]:29500");
        let err = read(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (&[("RANK", "0")], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "3")],
                "LOCAL_RANK",
            ),
        ];
        for (vars, name) in cases {
            let all: Vec<_> = vars.iter().chain(base.iter()).copied().collect();
            let err = read(&all).unwrap_err();
            assert!(
                matches!(&err, Error::Env { var, .. } if var == name),
                "{vars:?}: {err}"
            );
        }
        let err = read(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")]);
        assert!(err.unwrap_err().to_string().contains("MASTER_PORT"));
        let err = read(&[]).unwrap_err().to_string();
        assert!(err.contains("ferrorun"), "{err}");
    }

    #[test]
    fn slurm_lists() {
        assert_eq!(tasks_on_node("4(x2),3", 0), Some(4));
        assert_eq!(tasks_on_node("4(x2),3", 1), Some(4));
        assert_eq!(tasks_on_node("4(x2),3", 2), Some(3));
        assert_eq!(tasks_on_node("4(x2),3", 3), None);
        assert_eq!(first_host("node[03-05,9],gpu7").as_deref(), Some("node03"));
        assert_eq!(first_host("a1,b2").as_deref(), Some("a1"));
        assert_eq!(first_host("rack[2-3]-ib").as_deref(), Some("rack2-ib"));
    }
}
