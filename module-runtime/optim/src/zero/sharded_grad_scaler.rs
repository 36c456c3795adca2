//! [`ShardedGradScaler`]: float16 loss scaling when each rank holds only its shard of the
//! gradients (PyTorch's `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`).

use std::rc::Rc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use module_distributed::{Collective, ReduceOp};
use module_state::StateDict;

use crate::error::Result;
use crate::grad_scaler::{GradScaler, GradScalerOptions};
use crate::optimizer::Optimizer;

/// A [`GradScaler`] whose inf/NaN check is agreed over a process group: PyTorch's
/// `ShardedGradScaler`, for [`FullyShardedDataParallel`](crate::FullyShardedDataParallel) and
/// [`ZeroRedundancyOptimizer`](crate::ZeroRedundancyOptimizer) at stage 2.
///
/// With sharded gradients a rank sees only its shard, so an inf in another rank's shard goes
/// unseen: a plain `GradScaler` would skip the step on one rank and take it on the others, and
/// the ranks' models would part. Here [`unscale_`](Self::unscale_) (and the
/// [`step`](Self::step) that unscales) sums every rank's finding over `comm`, so every rank skips
/// or steps together, and [`update`](Self::update) moves every rank's scale the same way. Every
/// rank must call them (they run a collective). The rest is [`GradScaler`]'s, reached through
/// `Deref` (`get_scale()`, `is_enabled()`, ...), with its state dict.
///
/// ```
/// use std::rc::Rc;
/// use module_runtime::distributed::{Collective, SingleProcess};
/// use module_runtime::optim::{FsdpConfig, FullyShardedDataParallel, GradScalerOptions, ShardedGradScaler, SgdOptions};
/// use module_runtime::prelude::*;
///
/// let comm: Rc<dyn Collective> = Rc::new(SingleProcess);
/// let fsdp = FullyShardedDataParallel::new(Linear::new(3, 2, &Device::Cpu)?, comm.clone(), FsdpConfig::default())?;
/// let mut opt = SGD::new(fsdp.module(), SgdOptions::new(0.1))?;
/// let mut scaler = ShardedGradScaler::new(GradScalerOptions::default(), comm)?;
/// let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
/// let loss = fsdp.call(&x)?.sqr()?.mean_all()?;
/// let mut grads = scaler.scale(&loss)?.backward()?;
/// assert!(scaler.step(&mut opt, &mut grads)?); // every rank's shard was finite
/// scaler.update(None)?;
/// assert_eq!(scaler.get_scale(), 65536.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ShardedGradScaler {
    scaler: GradScaler,
    comm: Rc<dyn Collective>,
}

impl std::fmt::Debug for ShardedGradScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedGradScaler")
            .field("scaler", &self.scaler)
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .finish()
    }
}

impl std::ops::Deref for ShardedGradScaler {
    type Target = GradScaler;

    fn deref(&self) -> &GradScaler {
        &self.scaler
    }
}

impl ShardedGradScaler {
    /// A scaler with `options` whose inf checks are agreed over `comm` (PyTorch's
    /// `process_group`). The same checks as [`GradScaler::new`].
    pub fn new(options: GradScalerOptions, comm: Rc<dyn Collective>) -> Result<Self> {
        Ok(Self {
            scaler: GradScaler::new(options)?,
            comm,
        })
    }

    /// Multiplies `outputs` by the scale: [`GradScaler::scale`].
    pub fn scale(&mut self, outputs: &Tensor) -> Result<Tensor> {
        self.scaler.scale(outputs)
    }

    /// Unscales this rank's gradients of `optimizer` ([`GradScaler::unscale_`]) and agrees with
    /// every rank on whether any gradient anywhere was inf or NaN. A rank that holds no gradient
    /// of the optimizer's takes the others' finding (PyTorch's `ShardedGradScaler` counts such a
    /// rank as finite too).
    pub fn unscale_(&mut self, optimizer: &dyn Optimizer, grads: &mut GradStore) -> Result<()> {
        let comm = self.comm.clone();
        self.scaler
            .unscale_agreed(optimizer, grads, &|found| agree(&*comm, found))
    }

    /// Steps `optimizer` unless a gradient on any rank was inf or NaN ([`GradScaler::step`]);
    /// unscales first, agreeing, if [`unscale_`](Self::unscale_) was not called. Returns whether
    /// it stepped: the same on every rank.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer, grads: &mut GradStore) -> Result<bool> {
        let comm = self.comm.clone();
        self.scaler
            .step_agreed(optimizer, grads, &|found| agree(&*comm, found))
    }

    /// Updates the scale from the agreed findings: [`GradScaler::update`].
    pub fn update(&mut self, new_scale: Option<f64>) -> Result<()> {
        self.scaler.update(new_scale)
    }

    /// [`GradScaler::state_dict`], PyTorch's keys (the same on every rank).
    pub fn state_dict(&self) -> Result<StateDict> {
        self.scaler.state_dict()
    }

    /// [`GradScaler::load_state_dict`].
    pub fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.scaler.load_state_dict(state)
    }
}

/// Every rank's inf check combined: found on some rank, checked on some rank.
fn agree(comm: &dyn Collective, found: Option<bool>) -> Result<Option<bool>> {
    let flag = |b: bool| if b { 1f32 } else { 0f32 };
    let mine = [flag(found == Some(true)), flag(found.is_some())];
    let t = Tensor::new(&mine, &Device::Cpu)?.to_device(&comm.device())?;
    comm.all_reduce(&t, ReduceOp::Sum)?;
    let [found_any, checked_any] = <[f32; 2]>::try_from(t.to_vec1::<f32>()?)
        .map_err(|_| candle_core::Error::Msg("an all-reduce changed a tensor's size".to_owned()))?;
    Ok((checked_any > 0.0).then_some(found_any > 0.0))
}
