//! What can go wrong in data-parallel training: [`DistributedError`], carried by
//! [`Error::Distributed`](crate::Error::Distributed).

use std::time::Duration;

/// A failure of a collective operation or of data-parallel setup.
///
/// Every variant is raised on **every** rank that takes part (a mismatch found on one rank is
/// agreed through the collective first), so no rank is left waiting for the others.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// The launcher's environment variables are half set, contradictory or unparsable
    /// (`RANK` without `WORLD_SIZE`, `RANK=3` with `WORLD_SIZE=2`, …).
    #[error("distributed environment: {reason}")]
    Env {
        /// What is wrong, naming the variables.
        reason: String,
    },

    /// A rank or world size that does not fit (`rank >= world_size`, a world of 0, a root that
    /// is not a rank).
    #[error("invalid rank {rank} for a world of size {world_size}")]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The world size.
        world_size: usize,
    },

    /// The ranks did not build the same model: the digest of parameter and buffer paths,
    /// shapes, dtypes and `requires_grad` flags differs from rank 0's on `mismatched` ranks.
    #[error(
        "the ranks built different models: rank(s) {mismatched:?} differ from rank 0 \
         (this rank, {rank}: {local_params} parameters and {local_buffers} buffers; rank 0: \
         {root_params} parameters and {root_buffers} buffers); build the model identically on \
         every rank (same config, same lazy shapes) before wrapping it"
    )]
    ModelMismatch {
        /// This rank.
        rank: usize,
        /// The ranks whose model differs from rank 0's.
        mismatched: Vec<usize>,
        /// Parameters on this rank.
        local_params: usize,
        /// Buffers on this rank.
        local_buffers: usize,
        /// Parameters on rank 0.
        root_params: usize,
        /// Buffers on rank 0.
        root_buffers: usize,
    },

    /// The model has no parameter that requires a gradient (PyTorch's DDP refuses it too).
    #[error("DistributedDataParallel needs at least one parameter that requires a gradient")]
    NoTrainableParams,

    /// The model's tensors live on more than one device.
    #[error("DistributedDataParallel needs one device for the whole model: `{first}` is on {first_device}, `{other}` on {other_device}")]
    MixedDevices {
        /// A path on the first device.
        first: String,
        /// Its device.
        first_device: String,
        /// A path on another device.
        other: String,
        /// That device.
        other_device: String,
    },

    /// The ranks called different collectives, or the same one on tensors of different sizes or
    /// dtypes (a programming error that MPI or NCCL would turn into a hang or memory corruption;
    /// the in-process engine detects it).
    #[error("collective mismatch across ranks: {detail}")]
    OpMismatch {
        /// What each rank asked for.
        detail: String,
    },

    /// A collective did not complete within the engine's timeout: some rank did not join it
    /// (crashed, stuck, or took another branch). The engine is unusable afterwards.
    #[error("collective `{op}` timed out after {after:?} on rank {rank}: a rank did not join it")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The timeout.
        after: Duration,
    },

    /// An earlier collective failed or timed out, so the group is unusable.
    #[error("the process group is unusable after an earlier failure: {reason}")]
    Poisoned {
        /// The earlier failure.
        reason: String,
    },

    /// The engine cannot run this operation (a dtype or device it does not support).
    #[error("the {backend} collective does not support {what}")]
    Unsupported {
        /// The engine.
        backend: &'static str,
        /// What was asked for.
        what: String,
    },

    /// The TCP rendezvous that hands rank 0's bootstrap data (NCCL's unique id) to the other
    /// ranks failed: rank 0 was not reachable in time, a rank did not come, or the ranks
    /// disagree on the world size or their ranks.
    #[error("rendezvous at {address} failed on rank {rank}: {cause}")]
    Rendezvous {
        /// Rank 0's address (`host:port`).
        address: String,
        /// This rank.
        rank: usize,
        /// What went wrong.
        cause: String,
    },

    /// A point-to-point `send` or `recv` addressed to this rank itself (PyTorch refuses it too:
    /// it would wait for itself forever).
    #[error("`{op}` on rank {rank} names rank {rank} itself as its peer")]
    PeerIsSelf {
        /// `"send"` or `"recv"`.
        op: &'static str,
        /// This rank.
        rank: usize,
    },

    /// A pipeline split that does not fit the model or the group: a stage count other than the
    /// world size, a pattern matching nothing, a parameter or buffer in no stage or in two.
    #[error("pipeline split: {reason}")]
    StageSplit {
        /// What is wrong, naming the paths and stages.
        reason: String,
    },

    /// A pipeline step's batch that does not split into the schedule's micro-batches (a count of
    /// 0, or rows not divisible by it), or inputs and targets of different batch sizes.
    #[error(
        "pipeline step on stage {stage}: the {what} of {batch} rows does not split into \
         {n_microbatches} equal micro-batches"
    )]
    MicroBatches {
        /// This stage.
        stage: usize,
        /// `"input"` or `"target"`.
        what: &'static str,
        /// Its size along dimension 0.
        batch: usize,
        /// The schedule's micro-batch count.
        n_microbatches: usize,
    },

    /// A pipeline step called without what its stage needs: the first stage without an input,
    /// the last without a target.
    #[error("pipeline step on stage {stage} of {num_stages}: {reason}")]
    PipelineInput {
        /// This stage.
        stage: usize,
        /// The number of stages.
        num_stages: usize,
        /// What is missing.
        reason: String,
    },

    /// The engine itself failed (MPI initialization, …).
    #[error("{backend}: {message}")]
    Backend {
        /// The engine.
        backend: &'static str,
        /// Its message.
        message: String,
    },
}
