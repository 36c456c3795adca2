//! Where this process sits in a job, read from the launcher's environment variables.

use super::{Collective, DistributedError, SingleProcess};
use crate::Result;

/// Which launcher's variables described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: one process.
    None,
    /// `torchrun` (or `torch.distributed.launch`, Slurm scripts that imitate it): `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.
    Torchrun,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
    /// A PMI launcher (MPICH's and Intel MPI's `mpiexec`, Slurm's `srun --mpi=pmi2`):
    /// `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`.
    Pmi,
}

/// This process's place in a data-parallel job, as its launcher describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// The launcher whose variables were found.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: usize,
    /// The number of processes.
    pub world_size: usize,
    /// The rank among the processes on this machine (picks the GPU), when the launcher says.
    pub local_rank: Option<usize>,
    /// `MASTER_ADDR` and `MASTER_PORT` (torchrun), the rendezvous of TCP-bootstrapped engines.
    pub master: Option<(String, u16)>,
}

impl DistEnv {
    /// Reads the process's environment; see [`from_vars`](Self::from_vars).
    pub fn from_env() -> Result<DistEnv> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the launcher variables through `var` (a map in tests, the environment in
    /// [`from_env`](Self::from_env)).
    ///
    /// Rules, each broken one a [`DistributedError::Env`] naming the variables:
    /// * torchrun: `RANK` and `WORLD_SIZE` come together; with a world larger than 1,
    ///   `MASTER_ADDR` and `MASTER_PORT` must be set too (as torch's `env://` requires);
    ///   `LOCAL_RANK`, `MASTER_ADDR` or `MASTER_PORT` without `RANK` and `WORLD_SIZE` is a
    ///   half-set environment.
    /// * Open MPI: `OMPI_COMM_WORLD_RANK` and `OMPI_COMM_WORLD_SIZE` come together; PMI:
    ///   `PMI_RANK` and `PMI_SIZE` come together.
    /// * Every value is a non-negative integer (a port fits in 16 bits), the world size is at
    ///   least 1 and the rank below it.
    /// * When several launchers' variables are set they must agree on rank and world size (a
    ///   torchrun-style script run under `mpiexec` that exports `RANK` itself, say).
    ///
    /// With no variables at all, the job is one process of rank 0.
    ///
    /// ```
    /// use module_runtime::distributed::{DistEnv, Launcher};
    /// let vars = [("PMI_RANK", "1"), ("PMI_SIZE", "2")];
    /// let env = DistEnv::from_vars(|n| vars.iter().find(|v| v.0 == n).map(|v| v.1.to_string()))?;
    /// assert_eq!((env.launcher, env.rank, env.world_size), (Launcher::Pmi, 1, 2));
    ///
    /// let half = [("RANK", "0")];
    /// assert!(DistEnv::from_vars(|n| half.iter().find(|v| v.0 == n).map(|v| v.1.to_string())).is_err());
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let mut found: Vec<DistEnv> = Vec::new();

        // torchrun
        let rank = get("RANK");
        let world = get("WORLD_SIZE");
        let local = get("LOCAL_RANK");
        let addr = get("MASTER_ADDR");
        let port = get("MASTER_PORT");
        match (&rank, &world) {
            (Some(rank), Some(world)) => {
                let rank = parse("RANK", rank)?;
                let world_size = parse("WORLD_SIZE", world)?;
                let master = match (&addr, &port) {
                    (Some(addr), Some(port)) => Some((addr.clone(), parse_port(port)?)),
                    (None, None) if world_size <= 1 => None,
                    _ => {
                        return Err(env_error(format!(
                            "RANK and WORLD_SIZE={world_size} are set, but {}: torchrun sets \
                             MASTER_ADDR and MASTER_PORT too",
                            missing(&[("MASTER_ADDR", &addr), ("MASTER_PORT", &port)])
                        )))
                    }
                };
                let local_rank = local
                    .as_deref()
                    .map(|v| parse("LOCAL_RANK", v))
                    .transpose()?;
                found.push(DistEnv {
                    launcher: Launcher::Torchrun,
                    rank,
                    world_size,
                    local_rank,
                    master,
                });
            }
            (None, None) => {
                let set: Vec<&str> = [
                    ("LOCAL_RANK", &local),
                    ("MASTER_ADDR", &addr),
                    ("MASTER_PORT", &port),
                ]
                .iter()
                .filter(|(_, v)| v.is_some())
                .map(|(n, _)| *n)
                .collect();
                if !set.is_empty() {
                    return Err(env_error(format!(
                        "{} set without RANK and WORLD_SIZE: a half-set torchrun environment",
                        set.join(", ")
                    )));
                }
            }
            _ => {
                return Err(env_error(format!(
                    "{}: RANK and WORLD_SIZE must be set together",
                    missing(&[("RANK", &rank), ("WORLD_SIZE", &world)])
                )))
            }
        }

        // MPI launchers
        for (launcher, rank_var, size_var, local_var) in [
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            (Launcher::Pmi, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ] {
            let (rank, world) = (get(rank_var), get(size_var));
            match (&rank, &world) {
                (Some(rank), Some(world)) => found.push(DistEnv {
                    launcher,
                    rank: parse(rank_var, rank)?,
                    world_size: parse(size_var, world)?,
                    local_rank: get(local_var).map(|v| parse(local_var, &v)).transpose()?,
                    master: None,
                }),
                (None, None) => {}
                _ => {
                    return Err(env_error(format!(
                        "{}: {rank_var} and {size_var} must be set together",
                        missing(&[(rank_var, &rank), (size_var, &world)])
                    )))
                }
            }
        }

        for env in &found {
            if env.world_size == 0 || env.rank >= env.world_size {
                return Err(env_error(format!(
                    "rank {} is not below world size {} ({:?} variables)",
                    env.rank, env.world_size, env.launcher
                )));
            }
        }
        if let Some(first) = found.first()
            && let Some(other) = found
                .iter()
                .find(|e| (e.rank, e.world_size) != (first.rank, first.world_size))
        {
            return Err(env_error(format!(
                "the {:?} variables say rank {} of {}, the {:?} variables rank {} of {}",
                first.launcher,
                first.rank,
                first.world_size,
                other.launcher,
                other.rank,
                other.world_size
            )));
        }
        // torchrun's variables first (they carry the rendezvous); fill a missing local rank from
        // the MPI launcher.
        let mut env = found.first().cloned().unwrap_or(DistEnv {
            launcher: Launcher::None,
            rank: 0,
            world_size: 1,
            local_rank: None,
            master: None,
        });
        if env.local_rank.is_none() {
            env.local_rank = found.iter().find_map(|e| e.local_rank);
        }
        Ok(env)
    }

    /// Whether the job has more than one process.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

/// The process group the launcher's environment asks for.
///
/// * A `torchrun`-style launch (`RANK`, `WORLD_SIZE`, …), built with the `nccl` feature: the
///   NCCL engine on `cuda:LOCAL_RANK`, at any world size, 1 included (so `comm.device()` is the
///   GPU); see `Nccl::from_env`. This is PyTorch's choice for GPUs, and the only engine here
///   that bootstraps over TCP.
/// * No launcher variables, or a world of 1 otherwise: [`SingleProcess`].
/// * An MPI launcher (`mpiexec`, `mpirun`, `srun`), built with the `mpi` feature: the MPI engine
///   (MPI's own rank and size, checked against the variables).
/// * Anything else with a world larger than 1 is an error that says what is missing, never a
///   silent single-process run that would train `world_size` unsynchronized copies.
///
/// Each launcher has exactly one engine, so there is no `backend=` switch as in PyTorch's
/// `init_process_group`: to use another engine, make it directly (`Mpi::init()`,
/// `Nccl::new(..)`) instead of calling this function.
///
/// Half-set variables are errors; see [`DistEnv::from_vars`].
pub fn init_from_env() -> Result<Box<dyn Collective>> {
    let env = DistEnv::from_env()?;
    #[cfg(feature = "nccl")]
    if env.launcher == Launcher::Torchrun {
        let nccl = super::Nccl::from_dist_env(&env, |name| std::env::var(name).ok())?;
        return Ok(Box::new(nccl));
    }
    if !env.is_distributed() {
        return Ok(Box::new(SingleProcess));
    }
    #[cfg(feature = "mpi")]
    if matches!(env.launcher, Launcher::OpenMpi | Launcher::Pmi) {
        let mpi = super::Mpi::init()?;
        if (mpi.rank(), mpi.world_size()) != (env.rank, env.world_size) {
            return Err(env_error(format!(
                "MPI says rank {} of {}, the launcher's variables rank {} of {}",
                mpi.rank(),
                mpi.world_size(),
                env.rank,
                env.world_size
            )));
        }
        return Ok(Box::new(mpi));
    }
    let hint = match env.launcher {
        Launcher::Torchrun => {
            "build with the `nccl` feature (GPUs), or launch with `mpiexec` and the `mpi` feature"
        }
        _ => "build module-runtime with the `mpi` feature",
    };
    Err(env_error(format!(
        "a world of {} ranks ({:?} variables) needs a multi-process engine: {hint}",
        env.world_size, env.launcher
    )))
}

fn env_error(reason: String) -> crate::Error {
    DistributedError::Env { reason }.into()
}

fn missing(vars: &[(&str, &Option<String>)]) -> String {
    let set: Vec<&str> = vars.iter().filter(|v| v.1.is_some()).map(|v| v.0).collect();
    let unset: Vec<&str> = vars.iter().filter(|v| v.1.is_none()).map(|v| v.0).collect();
    format!("{} set but {} not", set.join(", "), unset.join(", "))
}

fn parse(name: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| env_error(format!("{name}={value:?} is not a non-negative integer")))
}

fn parse_port(value: &str) -> Result<u16> {
    value
        .trim()
        .parse()
        .map_err(|_| env_error(format!("MASTER_PORT={value:?} is not a port number")))
}
