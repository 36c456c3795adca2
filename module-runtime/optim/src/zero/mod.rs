//! [`ZeroRedundancyOptimizer`]: ZeRO stages 1 and 2 over a process group (PyTorch's
//! `torch.distributed.optim.ZeroRedundancyOptimizer`, and FSDP's `SHARD_GRAD_OP` for the
//! gradients).

mod consolidate;
mod exchange;
mod fsdp;
mod partition;
mod sharded_grad_scaler;

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use module_core::Param;
use module_distributed::{Collective, ReduceOp, DEFAULT_BUCKET_CAP_BYTES};
use module_state::StateDict;

use crate::error::{Error, Result};
use crate::optimizer::Optimizer;

pub use fsdp::{FsdpConfig, FullyShardedDataParallel};
pub use partition::partition_sizes;
pub use sharded_grad_scaler::ShardedGradScaler;

/// How much of data-parallel training a [`ZeroRedundancyOptimizer`] shards over the ranks (the
/// stages of the ZeRO paper and DeepSpeed; stage 0 is plain
/// [`DistributedDataParallel`](module_distributed::DistributedDataParallel)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// Stage 1: the optimizer state. Gradients are all-reduced as under data parallelism; each
    /// rank steps the parameters it owns and the updated values are all-gathered (PyTorch's
    /// `ZeroRedundancyOptimizer` behind `DistributedDataParallel`).
    One,
    /// Stage 2: the optimizer state and the gradients. Gradients are reduce-scattered: each rank
    /// keeps the averaged gradients of the parameters it owns and drops the others (FSDP's
    /// `ShardingStrategy.SHARD_GRAD_OP` without the parameter sharding of its forward).
    Two,
}

impl ZeroStage {
    /// The stage of number `stage`, 1 or 2. Anything else is
    /// [`Error::InvalidHyperparameter`] (0 is plain data parallelism; 3, the sharding of the
    /// parameters themselves, is [`FullyShardedDataParallel`], a model wrapper).
    ///
    /// ```
    /// use module_runtime::optim::ZeroStage;
    /// assert_eq!(ZeroStage::from_number(2)?, ZeroStage::Two);
    /// assert!(ZeroStage::from_number(3).is_err());
    /// # Ok::<(), module_runtime::optim::Error>(())
    /// ```
    pub fn from_number(stage: u8) -> Result<ZeroStage> {
        match stage {
            1 => Ok(ZeroStage::One),
            2 => Ok(ZeroStage::Two),
            _ => Err(Error::InvalidHyperparameter {
                name: "ZeRO stage",
                value: f64::from(stage),
                reason: "ZeroRedundancyOptimizer implements stages 1 (optimizer state) and 2 \
                         (and gradients); stage 0 is DistributedDataParallel alone, stage 3 \
                         (the parameters too, FSDP's FULL_SHARD) is FullyShardedDataParallel",
                group: None,
            }),
        }
    }

    /// The stage's number, 1 or 2.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
        }
    }
}

/// An optimizer whose state is sharded over the ranks of a process group: each rank owns a
/// partition of the parameters and keeps the optimizer state of those only (PyTorch's
/// `ZeroRedundancyOptimizer`; ZeRO stage 1, and stage 2 with the gradients sharded too).
///
/// It wraps any [`Optimizer`] made over **all** the trained parameters, the same on every rank
/// (its groups, hyperparameters, schedules and checkpoints are those of a single process). The
/// parameters are split between the ranks by size, deterministically
/// ([`partition_sizes`]: largest first, each to the rank with the fewest bytes so far).
/// [`step`](Optimizer::step) hands the inner optimizer only the gradients of this rank's
/// partition, so it creates and updates state for those alone (optimizer state is made lazily, at
/// a parameter's first step), then every rank's updated parameters are all-gathered, so every
/// rank holds the whole updated model, bitwise the values the owner computed.
///
/// The training step, with [`DistributedDataParallel`](module_distributed::DistributedDataParallel)
/// for the construction checks and the forward (the model stays the user's, its names unchanged):
///
/// ```
/// use module_runtime::distributed::{DdpConfig, DistributedDataParallel, SingleProcess};
/// use module_runtime::optim::{ZeroRedundancyOptimizer, ZeroStage};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let comm = SingleProcess; // `init_from_env()?` under a launcher
/// let ddp = DistributedDataParallel::new(&model, &comm, DdpConfig::default())?;
/// let adamw = AdamW::new(&model, AdamW::options().lr(1e-3))?;
/// let mut opt = ZeroRedundancyOptimizer::new(adamw, &comm, ZeroStage::Two)?;
///
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let mut grads = ddp.call(&x)?.sqr()?.mean_all()?.backward()?;
/// opt.reduce_gradients(&mut grads)?; // stage 2: each rank keeps its partition's average
/// opt.clip_grad_norm(&mut grads, 1.0, 2.0, false)?; // the global norm, from the shards
/// opt.step(&grads)?; // steps this rank's partition, all-gathers the parameters
/// let full = opt.consolidate_state_dict(0)?; // torch.optim's state dict, on rank 0
/// assert!(full.is_some());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Numerics
///
/// Every stage ends a step with the parameters of plain data parallelism: each gradient average
/// is the same sum of the ranks' values divided by the world size
/// ([`reduce_gradients`](Self::reduce_gradients)), the owner runs the inner optimizer's own
/// arithmetic, and the all-gather copies bits. That is bitwise with
/// [`LocalGroup`](module_distributed::LocalGroup) (which adds in rank order) and with MPI at 2
/// ranks; over more ranks MPI may order a sum differently for another message layout (stage 2's
/// buckets are not DDP's), which moves the last bits. Clipping
/// ([`clip_grad_norm`](Self::clip_grad_norm)) gathers each gradient's norm from its owner and
/// combines them in the optimizer's order, so the total is [`clip_grad_norm`](crate::clip_grad_norm)'s
/// over the whole gradients, bit for bit.
///
/// # State dicts
///
/// * [`state_dict`](Optimizer::state_dict) is this rank's shard: the groups, every parameter's
///   group, and the state of the parameters this rank owns, plus `zero.rank` and
///   `zero.world_size`; [`save_state`](Optimizer::save_state) writes it (one file per rank), and
///   [`load_state_dict`](Optimizer::load_state_dict) refuses another rank's shard.
/// * [`consolidate_state_dict`](Self::consolidate_state_dict) gathers the whole state on one
///   rank: the state dict of the inner optimizer in one process, which a single-process optimizer
///   loads (and [`load_state_dict`](Optimizer::load_state_dict) also takes it, keeping its own
///   partition).
///
/// # Differences from PyTorch
///
/// * It wraps an optimizer made over every parameter instead of taking an optimizer class
///   (`ZeroRedundancyOptimizer(params, optimizer_class=AdamW, lr=...)`): the groups are resolved
///   by path pattern once, the same on every rank, and `optim()` is that optimizer.
/// * `consolidate_state_dict(to)` returns the consolidated state on rank `to` (PyTorch stores it
///   for a later `state_dict()` call); `state_dict()` is the local shard.
/// * Candle's backward returns every gradient at once, so stage 2 frees the gradients of other
///   ranks' partitions after the reduce-scatter, not during the backward pass.
/// * Parameters are updated with one all-gather per size-capped bucket instead of a broadcast per
///   rank (`overlap_with_ddp` has no equivalent: there are no gradient hooks to overlap with).
pub struct ZeroRedundancyOptimizer<'a, O> {
    optim: O,
    comm: &'a dyn Collective,
    stage: ZeroStage,
    /// Every parameter the optimizer trains, group by group, with its group.
    params: Vec<(String, Param, usize)>,
    /// The rank that owns each of `params`.
    owner: Vec<usize>,
    bucket_cap_bytes: usize,
}

impl<O> std::fmt::Debug for ZeroRedundancyOptimizer<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroRedundancyOptimizer")
            .field("stage", &self.stage)
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("owned", &self.owned_paths(self.comm.rank()))
            .finish()
    }
}

impl<'a, O: Optimizer> ZeroRedundancyOptimizer<'a, O> {
    /// Shards `optim` (made over every trained parameter, identically on every rank) over
    /// `comm` at `stage`. Every rank must call it: the ranks check that their optimizers train
    /// the same parameters in the same groups ([`Error::ZeroMismatch`] on every rank otherwise).
    /// State `optim` already holds (a state dict loaded into it) is kept for this rank's
    /// partition and dropped for the others'.
    pub fn new(optim: O, comm: &'a dyn Collective, stage: ZeroStage) -> Result<Self> {
        let mut params = Vec::new();
        for g in 0..optim.num_param_groups() {
            for (path, p) in optim.group_params(g) {
                params.push((path.clone(), p.clone(), g));
            }
        }
        partition::verify_across_ranks(comm, &params)?;
        let sizes: Vec<usize> = params
            .iter()
            .map(|(_, p, _)| p.elem_count() * p.dtype().size_in_bytes())
            .collect();
        let owner = partition_sizes(&sizes, comm.world_size());
        let mut zero = ZeroRedundancyOptimizer {
            optim,
            comm,
            stage,
            params,
            owner,
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
        };
        let state = zero.optim.state_dict()?;
        let shard = zero.own_shard(&state)?;
        if shard.len() != state.len() {
            zero.optim.load_state_dict(&shard)?;
        }
        Ok(zero)
    }
}

impl<'a, O> ZeroRedundancyOptimizer<'a, O> {
    /// The inner optimizer (PyTorch's `optim` attribute): its typed groups and hyperparameters.
    pub fn optim(&self) -> &O {
        &self.optim
    }

    /// The inner optimizer, writable (hyperparameters; changing its parameters is not supported).
    pub fn optim_mut(&mut self) -> &mut O {
        &mut self.optim
    }

    /// The stage it shards at.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The process group.
    pub fn collective(&self) -> &'a dyn Collective {
        self.comm
    }

    /// The most bytes of gradients or parameters in one collective (25 MiB by default, as
    /// [`DdpConfig`](module_distributed::DdpConfig)'s buckets).
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_bytes
    }

    /// Sets [`bucket_cap_bytes`](Self::bucket_cap_bytes) (the same on every rank).
    pub fn set_bucket_cap_bytes(&mut self, bytes: usize) {
        self.bucket_cap_bytes = bytes;
    }

    /// The paths of the parameters each rank owns, rank by rank, each in the optimizer's order
    /// (PyTorch's `partition_parameters()`, by path).
    pub fn partition_parameters(&self) -> Vec<Vec<String>> {
        (0..self.comm.world_size())
            .map(|r| self.owned_paths(r))
            .collect()
    }

    fn owned_paths(&self, rank: usize) -> Vec<String> {
        self.params
            .iter()
            .zip(&self.owner)
            .filter(|(_, &o)| o == rank)
            .map(|((path, _, _), _)| path.clone())
            .collect()
    }

    /// Whether this rank owns parameter `i` of `params`.
    fn owns(&self, i: usize) -> bool {
        self.owner[i] == self.comm.rank()
    }
}

impl<O: Optimizer> Optimizer for ZeroRedundancyOptimizer<'_, O> {
    /// Steps the parameters this rank owns that have a gradient in `grads` with the inner
    /// optimizer, then all-gathers every rank's updated parameters. Every rank must call it.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let mut mine = GradStore::default();
        for (i, (_, p, _)) in self.params.iter().enumerate() {
            if !self.owns(i) {
                continue;
            }
            let var = p.var()?;
            if let Some(g) = grads.get(var.as_tensor()) {
                mine.insert(var.as_tensor(), g.clone());
            }
        }
        self.optim.step(&mine)?;
        drop(mine);
        self.all_gather_params()
    }

    fn num_param_groups(&self) -> usize {
        self.optim.num_param_groups()
    }

    fn lr(&self, group: usize) -> f64 {
        self.optim.lr(group)
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        self.optim.set_lr(group, lr);
    }

    fn group_params(&self, group: usize) -> &[(String, Param)] {
        self.optim.group_params(group)
    }

    /// This rank's shard: see [`ZeroRedundancyOptimizer`]'s "State dicts".
    fn state_dict(&self) -> Result<StateDict> {
        let mut sd = self.optim.state_dict()?;
        let scalar = |v: usize| Tensor::new(v as f64, &candle_core::Device::Cpu);
        sd.insert(consolidate::RANK_KEY, scalar(self.comm.rank())?);
        sd.insert(consolidate::WORLD_KEY, scalar(self.comm.world_size())?);
        Ok(sd)
    }

    /// Loads this rank's shard ([`state_dict`](Optimizer::state_dict) on this rank of a group of
    /// this size) or a consolidated state dict, keeping the state of this rank's partition;
    /// strictly and all or nothing, as the inner optimizer loads.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let shard = self.own_shard(state)?;
        self.optim.load_state_dict(&shard)
    }
}

/// The gradient of `p` in `grads`, or zeros of its size: a flat tensor of `p`'s dtype.
fn flat_grad(grads: &GradStore, p: &Param) -> Result<Tensor> {
    let var = p.var()?;
    let var = var.as_tensor();
    Ok(match grads.get(var) {
        Some(g) => g.to_dtype(var.dtype())?.flatten_all()?,
        None => Tensor::zeros(var.elem_count(), var.dtype(), var.device())?,
    })
}

/// The element-wise sum of every rank's `values`, on every rank.
fn all_sum(comm: &dyn Collective, values: &[f64]) -> Result<Vec<f64>> {
    let t = Tensor::new(values, &comm.device())?;
    comm.all_reduce(&t, ReduceOp::Sum)?;
    Ok(t.to_vec1::<f64>()?)
}
