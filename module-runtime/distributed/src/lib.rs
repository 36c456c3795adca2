//! Data-parallel training: one replica of the model per process, gradients averaged over the
//! processes after each backward (PyTorch's `torch.distributed` + `DistributedDataParallel` +
//! `DistributedSampler`).
//!
//! * [`Collective`]: a process group (rank, world size, in-place all-reduce and broadcast of a
//!   candle tensor, barrier). Engines: [`SingleProcess`] (the default, no dependency),
//!   [`LocalGroup`] (ranks as threads, for tests), with the `mpi` feature `Mpi` (CPU clusters
//!   and tests under `mpiexec`), and with the `nccl` feature `Nccl` (one GPU per process under
//!   `torchrun`; compiled in CI, never run: no GPU was available to this project).
//! * [`RendezvousServer`] and [`fetch_blob`]: the TCP rendezvous that hands NCCL's unique id
//!   from rank 0 to the other ranks.
//! * [`init_from_env`] and [`DistEnv`]: the process group a launcher (`torchrun`, `mpiexec`,
//!   `srun`) describes, with half-set variables an error.
//! * [`DistributedDataParallel`]: checks and syncs the replicas at construction, averages the
//!   gradients in buckets, syncs buffers before forward.
//! * [`DistributedSampler`]: each rank's share of the dataset, with PyTorch's index lists.
//! * Pipeline parallelism: [`PipelineSplit`] (each stage's paths), [`PipelineStage`] (a rank's
//!   stage and its forward), [`ScheduleGPipe`] and [`Schedule1F1B`] (micro-batches over the
//!   stages, activations over [`Collective::send`] and [`Collective::recv`]).
//!
//! A training step on every rank:
//!
//! ```ignore
//! let comm = init_from_env()?;
//! let ddp = DistributedDataParallel::new(&model, &*comm, DdpConfig::default())?;
//! let mut sampler = DistributedSampler::for_collective(dataset_len, &*comm)?;
//! for epoch in 0..epochs {
//!     sampler.set_epoch(epoch);
//!     for batch in sampler.indices().chunks(batch_size) {
//!         let loss = loss_fn(&ddp.call(&inputs(batch))?, &targets(batch))?;
//!         let mut grads = loss.backward()?;
//!         ddp.reduce_gradients(&mut grads)?;
//!         opt.step(&grads)?;
//!     }
//!     if ddp.is_main() { model.save_safetensors("ckpt.safetensors")?; }
//!     ddp.barrier()?;
//! }
//! ```
//!
//! With a mean loss, the averaged gradient of `world` ranks on equal parts of a batch is the
//! gradient of the whole batch, so the run matches a single process on the full batch.
#![warn(missing_docs)]

// The lower crates' modules and items, under the names this crate's files use
// (`crate::views::ensure_built`, `crate::Param`).
#[cfg(feature = "nccl")]
use module_core::parse_device;
use module_core::views;
use module_core::{Buffer, Error, Forward, LoadReport, Module, Param, PathPattern, Result};
use module_hooks::{ModuleExt, TensorTree};
use module_state::{LoadOptions, StateDict};

mod collective;
mod ddp;
mod env;
mod local;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod pipeline;
mod rendezvous;
mod sampler;

pub use collective::{Collective, ReduceOp, SingleProcess};
pub use ddp::{plan_buckets, DdpConfig, DistributedDataParallel, DEFAULT_BUCKET_CAP_BYTES};
pub use env::{init_from_env, DistEnv, Launcher};
pub use local::LocalGroup;
pub use module_core::DistributedError;
#[cfg(feature = "mpi")]
pub use mpi::Mpi;
#[cfg(feature = "nccl")]
pub use nccl::{Nccl, DEFAULT_NCCL_TIMEOUT, RENDEZVOUS_TIMEOUT};
pub use pipeline::{PipelineSplit, PipelineStage, PipelineStep, Schedule1F1B, ScheduleGPipe};
pub use rendezvous::{fetch_blob, rendezvous_port, RendezvousServer, RENDEZVOUS_PORT_VAR};
pub use sampler::DistributedSampler;
