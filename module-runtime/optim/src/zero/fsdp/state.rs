//! A sharded model's state: the full state dict gathered (FSDP's `FULL_STATE_DICT`), each rank's
//! shard (`SHARDED_STATE_DICT`), the full parameters for a while (`summon_full_params`), the
//! optimizer's state consolidated (`FSDP.optim_state_dict`) and sharded again
//! (`FSDP.optim_state_dict_to_load`), and gradient clipping over the shards.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use module_core::LoadReport;
use module_distributed::ReduceOp;
use module_hooks::ModuleExt;
use module_state::{LoadOptions, StateDict};

use super::{shard_of, FullyShardedDataParallel, Sharded};
use crate::clip;
use crate::error::{Error, Result};
use crate::optimizer::Optimizer;

/// The rank a sharded state dict was saved on.
const RANK_KEY: &str = "fsdp.rank";
/// The world size it was saved with.
const WORLD_KEY: &str = "fsdp.world_size";

impl<M: module_core::Module> FullyShardedDataParallel<M> {
    /// Runs `f` with every parameter of the model holding its full value (PyTorch's
    /// `FSDP.summon_full_params(model, writeback=True)`): each is all-gathered first, and
    /// afterwards this rank's piece of its value, as `f` left it, is written back into the shard
    /// (which the optimizer holds). Every rank must call it; the whole model is held on every rank
    /// meanwhile. The shards are restored also when `f` fails.
    pub fn summon_full_params<R>(&self, f: impl FnOnce(&M) -> Result<R>) -> Result<R> {
        for s in self.params.iter() {
            let full = self.gather_full(s)?;
            s.param.replace_var(Var::from_tensor(&full)?);
        }
        let result = f(&self.module);
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let mut restored = Ok(());
        for s in self.params.iter() {
            let full = s.param.own_tensor();
            s.param.replace_var(s.shard.clone());
            if let Ok(full) = full {
                let piece = shard_of(&full, rank, world)?;
                if let Err(e) = s.shard.set(piece.as_tensor()) {
                    restored = Err(e);
                }
            }
        }
        restored?;
        result
    }

    /// The model's full state dict (PyTorch's `StateDictType.FULL_STATE_DICT`): every parameter
    /// gathered, at its own shape and under its path, and the buffers; on every rank (save it on
    /// rank 0). It is the state dict of the model in one process, which an unwrapped model loads
    /// strictly.
    pub fn state_dict(&self) -> Result<StateDict> {
        self.summon_full_params(|m| Ok(m.state_dict()?))
    }

    /// Loads a full state dict (one [`state_dict`](Self::state_dict) gave, or a single
    /// process's checkpoint) into the shards, with `options` as
    /// [`ModuleExt::load_state_dict`] takes them (strict by default, all or nothing). Every rank
    /// must call it with the same state dict.
    pub fn load_state_dict(&self, state: &StateDict, options: &LoadOptions) -> Result<LoadReport> {
        self.summon_full_params(|m| Ok(m.load_state_dict(state, options)?))
    }

    /// This rank's shard of the model's state (PyTorch's `StateDictType.SHARDED_STATE_DICT`):
    /// every parameter's 1-D shard under its path, the buffers, and `fsdp.rank` and
    /// `fsdp.world_size`. Save one file per rank; [`load_sharded_state_dict`](Self::load_sharded_state_dict)
    /// takes it back on the same rank of a group of the same size.
    pub fn sharded_state_dict(&self) -> Result<StateDict> {
        let mut sd = self.module.state_dict()?;
        let scalar = |v: usize| Tensor::new(v as f64, &Device::Cpu);
        sd.insert(RANK_KEY, scalar(self.comm.rank())?);
        sd.insert(WORLD_KEY, scalar(self.comm.world_size())?);
        Ok(sd)
    }

    /// Loads this rank's [`sharded_state_dict`](Self::sharded_state_dict), strictly and all or
    /// nothing. A shard of another rank or world size is [`Error::ShardedModel`].
    pub fn load_sharded_state_dict(&self, state: &StateDict) -> Result<LoadReport> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let read = |key: &str| -> Result<f64> {
            let t = state.get(key).ok_or_else(|| Error::ShardedModel {
                rank,
                path: key.to_owned(),
                reason: "is missing: not a sharded state dict (a full one loads with \
                         `load_state_dict`)"
                    .to_owned(),
            })?;
            crate::state::scalar(t, key)
        };
        let (r, w) = (read(RANK_KEY)?, read(WORLD_KEY)?);
        if r != rank as f64 || w != world as f64 {
            return Err(Error::ShardedModel {
                rank,
                path: RANK_KEY.to_owned(),
                reason: format!(
                    "the shard of rank {r} of {w} cannot be loaded on rank {rank} of {world}: \
                     load each rank's own shard, or a full state dict"
                ),
            });
        }
        let mut own = StateDict::new();
        for (k, t) in state.iter() {
            if k != RANK_KEY && k != WORLD_KEY {
                own.insert(k, t.clone());
            }
        }
        Ok(self.module.load_state_dict(&own, &LoadOptions::default())?)
    }
}

impl<M> FullyShardedDataParallel<M> {
    /// The full value of `s`, gathered from every rank's shard.
    fn gather_full(&self, s: &Sharded) -> Result<Tensor> {
        self.gather_flat(s.shard.as_tensor(), s.numel())?
            .reshape(s.shape.clone())
            .map_err(Into::into)
    }

    /// Every rank's `piece` (a shard-sized tensor), concatenated and cut to `numel`.
    fn gather_flat(&self, piece: &Tensor, numel: usize) -> Result<Tensor> {
        let world = self.comm.world_size();
        let piece = piece.flatten_all()?.contiguous()?;
        let out = Tensor::zeros(world * piece.elem_count(), piece.dtype(), piece.device())?;
        self.comm.all_gather(&piece, &out)?;
        Ok(out.narrow(0, 0, numel)?)
    }

    /// The parameter `path` and the state name of an optimizer's `state.<path>.<name>` key.
    fn state_entry(&self, key: &str) -> Option<(&Sharded, String)> {
        let rest = key.strip_prefix("state.")?;
        let (path, name) = rest.rsplit_once('.')?;
        let s = self.params.iter().find(|s| s.path == path)?;
        Some((s, name.to_owned()))
    }

    /// The optimizer's whole state, consolidated (PyTorch's `FSDP.optim_state_dict(model,
    /// optim)` under `FULL_STATE_DICT`): `optim`'s state dict with every per-parameter state
    /// tensor gathered to the parameter's full shape, so it is the state dict the same optimizer
    /// has in one process ([`Optimizer::load_state_dict`] of an unwrapped model's optimizer takes
    /// it, [`Optimizer::save_state`]'s file is PyTorch's). Every rank must call it; every rank
    /// gets it.
    pub fn optim_state_dict(&self, optim: &impl Optimizer) -> Result<StateDict> {
        let local = optim.state_dict()?;
        let mut full = StateDict::new();
        for (key, t) in local.iter() {
            let value = match self.state_entry(key) {
                Some((s, _)) if t.dims() == s.shard.dims() => {
                    self.gather_flat(t, s.numel())?.reshape(s.shape.clone())?
                }
                _ => t.clone(),
            };
            full.insert(key, value);
        }
        Ok(full)
    }

    /// This rank's part of a consolidated optimizer state dict (one
    /// [`optim_state_dict`](Self::optim_state_dict) gave, or a single process's): every
    /// per-parameter state tensor of the parameter's full shape cut to this rank's shard, for
    /// [`Optimizer::load_state_dict`] of the optimizer made over [`module()`](Self::module)
    /// (PyTorch's `FSDP.optim_state_dict_to_load`). Needs no collective.
    pub fn optim_state_dict_to_load(&self, full: &StateDict) -> Result<StateDict> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let mut own = StateDict::new();
        for (key, t) in full.iter() {
            let value = match self.state_entry(key) {
                Some((s, _)) if t.dims() == s.shape.dims() => {
                    shard_of(t, rank, world)?.as_tensor().clone()
                }
                _ => t.clone(),
            };
            own.insert(key, value);
        }
        Ok(own)
    }

    /// Scales the shard gradients in `grads` so that the norm of the whole model's gradients
    /// is at most `max_norm`, and returns that norm (PyTorch's `FSDP.clip_grad_norm_`). Every
    /// rank must call it, after the backward.
    ///
    /// Each rank sums the `norm_type`-th powers of its shards (its maximum for the infinity
    /// norm) per parameter; one all-reduce gives every rank every rank's sums, and each
    /// parameter's norm is combined from them and the total from those in parameter order, as
    /// [`clip_grad_norm`](crate::clip_grad_norm) combines them. The partial sums round
    /// differently from one process's per-tensor norms: the total agrees within float32
    /// rounding, not bit for bit. The coefficient is `clip_grad_norm`'s.
    pub fn clip_grad_norm(
        &self,
        grads: &mut GradStore,
        max_norm: f64,
        norm_type: f64,
    ) -> Result<f64> {
        clip::check_norm_type(norm_type)?;
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let n = self.params.len();
        // Per rank, per parameter: the partial sum (or maximum), and whether it had a gradient.
        let mut local = vec![0.0; 2 * world * n];
        for (i, s) in self.params.iter().enumerate() {
            if let Some(g) = grads.get(s.shard.as_tensor()) {
                let g = g.to_dtype(DType::F64)?.abs()?;
                local[rank * n + i] = if norm_type.is_infinite() {
                    g.max_all()?.to_scalar::<f64>()?
                } else {
                    g.powf(norm_type)?.sum_all()?.to_scalar::<f64>()?
                };
                local[world * n + rank * n + i] = 1.0;
            }
        }
        let all = Tensor::new(local.as_slice(), &self.comm.device())?;
        self.comm.all_reduce(&all, ReduceOp::Sum)?;
        let all = all.to_vec1::<f64>()?;
        let mut norms = Vec::new();
        for i in 0..n {
            let had = (0..world).any(|r| all[world * n + r * n + i] > 0.0);
            if !had {
                continue;
            }
            let parts = (0..world).map(|r| all[r * n + i]);
            let norm = if norm_type.is_infinite() {
                parts.fold(0.0, f64::max)
            } else {
                parts.sum::<f64>().powf(1.0 / norm_type)
            };
            norms.push(f64::from(norm as f32));
        }
        if norms.is_empty() {
            return Ok(0.0);
        }
        let total = clip::total_norm(&norms, norm_type);
        let coef = clip::coefficient(total, max_norm);
        for s in self.params.iter() {
            let t = s.shard.as_tensor();
            if let Some(g) = grads.get(t) {
                let scaled = g.affine(coef, 0.0)?;
                grads.insert(t, scaled);
            }
        }
        Ok(total)
    }
}
