//! Adam and AdamW: PyTorch's `torch.optim.Adam` and `torch.optim.AdamW`.

//!
//! - [`options`]: [`AdamOptions`], the hyperparameters, with PyTorch's defaults and range checks;
//! - [`state`]: the per-parameter state and its state dict entries;
//! - [`update`]: the update rule, composed of candle ops or fused over CPU float32 values.

mod options;
mod state;
mod update;

use candle_core::backprop::GradStore;
use module_core::Param;
use module_state::StateDict;

pub use self::options::AdamOptions;
use self::state::AdamState;
use self::update::{step_composed, step_fused, Scalars};
use crate::error::Result;
use crate::fused;
use crate::group::{NamedParams, ParamGroup, ParamGroups};
use crate::optimizer::{core_methods, forward_to, Optimizer};
use crate::state::{Buf, Core};

/// Adam: PyTorch's `torch.optim.Adam`, with its update rule (`torch/optim/adam.py`,
/// `_single_tensor_adam`), step `t` counted per parameter:
///
/// ```text
/// g = g (or -g when maximizing)
/// p = p * (1 - lr * weight_decay)     if decoupled (AdamW), else g = g + weight_decay * p
/// m = m.lerp(g, 1 - beta1)
/// v = beta2 * v + (1 - beta2) * g * g
/// v_max = max(v_max, v)               with amsgrad (and v_max replaces v below)
/// p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// Scalars are computed in `f64` and used in the parameter's dtype, as PyTorch does. Contiguous
/// CPU float32 parameters are updated by one fused in-place pass per parameter, split over threads
/// (see [`set_fused`](Self::set_fused)); others by candle ops. Float16 and bfloat16 parameters
/// keep their state in float32 and are updated in float32, the result rounded into the parameter
/// (PyTorch keeps such state in the parameter's dtype; a `.pth` state is converted on load).
///
/// ```
/// use module_runtime::optim::{Adam, AdamOptions, Optimizer};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let mut opt = Adam::new(&model, Adam::options().lr(1e-2).amsgrad(true))?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let loss = model.call(&x)?.sqr()?.mean_all()?;
/// opt.backward_step(&loss)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Adam {
    core: Core<AdamOptions, AdamState>,
    fused: bool,
}

impl Adam {
    /// `torch.optim.Adam`'s defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn options() -> AdamOptions {
        AdamOptions::default()
    }

    core_methods!("Adam", AdamOptions);

    /// The number of steps taken for the parameter at `path` (0 if it never had a gradient or is
    /// not trained by this optimizer).
    pub fn step_count(&self, path: &str) -> u64 {
        for (group, states) in self.core.groups.iter().zip(&self.core.state) {
            for ((p, _), s) in group.params.iter().zip(states) {
                if p == path {
                    return s.as_ref().map_or(0, |s| s.step);
                }
            }
        }
        0
    }
}

impl Optimizer for Adam {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let fused_on = self.fused;
        self.core.each_with_grad(grads, |o, var, g, state| {
            // Half-precision parameters: float32 copies, state and arithmetic.
            let (p, g) = fused::in_state_dtype(var.as_tensor(), g)?;
            let (p, g) = (&p, &g);
            let fused = fused_on && fused::is_cpu_f32(p) && fused::is_cpu_f32(g);
            if state.is_none() {
                *state = Some(AdamState::zeros(p, o.amsgrad, fused)?);
            }
            let state = state.as_mut().expect("set above");
            if o.amsgrad && state.max_exp_avg_sq.is_none() {
                // amsgrad switched on after some steps (PyTorch keeps no such buffer then,
                // and fails): start the running maximum from zeros.
                state.max_exp_avg_sq = Some(Buf::Tensor(p.zeros_like()?));
            }
            state.step += 1;
            let s = Scalars::new(o, state.step);
            if fused {
                step_fused(p, g, state, o, &s)?;
                fused::write_back(var, p)
            } else {
                let new = step_composed(p, g, state, o, &s)?;
                var.set(&new.to_dtype(var.dtype())?)?;
                Ok(())
            }
        })
    }

    forward_to!(core);
}

/// AdamW: PyTorch's `torch.optim.AdamW`, which is [`Adam`] with decoupled weight decay
/// (`p *= 1 - lr * weight_decay` before the update) and a default weight decay of 1e-2.
///
/// ```
/// use module_runtime::optim::{AdamW, Optimizer, ParamGroups};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// // Hugging Face's habit: no weight decay for biases (and LayerNorm weights, in a transformer).
/// let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
/// let mut opt = AdamW::with_groups(&model, AdamW::options().lr(5e-5), &groups)?;
/// assert_eq!(opt.param_groups()[0].options.weight_decay, 0.0);
/// assert_eq!(opt.param_groups()[1].options.weight_decay, 0.01);
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// opt.backward_step(&model.call(&x)?.sqr()?.mean_all()?)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct AdamW(Adam);

impl AdamW {
    /// `torch.optim.AdamW`'s defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay
    /// 1e-2, decoupled.
    pub fn options() -> AdamOptions {
        AdamOptions::default()
            .weight_decay(1e-2)
            .decoupled_weight_decay(true)
    }

    /// AdamW over every trainable parameter of `params` (a model), in one group. The weight
    /// decay is decoupled whatever `options.decoupled_weight_decay` says.
    pub fn new(params: &(impl NamedParams + ?Sized), options: AdamOptions) -> Result<Self> {
        Ok(Self(Adam::new(
            params,
            options.decoupled_weight_decay(true),
        )?))
    }

    /// AdamW over the trainable parameters of `params`, split into `groups`.
    pub fn with_groups(
        params: &(impl NamedParams + ?Sized),
        options: AdamOptions,
        groups: &ParamGroups,
    ) -> Result<Self> {
        let options = options.decoupled_weight_decay(true);
        Ok(Self(Adam::with_groups(params, options, groups)?))
    }

    /// See [`Adam::set_fused`].
    pub fn set_fused(&mut self, fused: bool) {
        self.0.set_fused(fused);
    }

    /// The parameter groups.
    pub fn param_groups(&self) -> &[ParamGroup<AdamOptions>] {
        self.0.param_groups()
    }

    /// The parameter groups, with their hyperparameters writable.
    pub fn param_groups_mut(&mut self) -> &mut [ParamGroup<AdamOptions>] {
        self.0.param_groups_mut()
    }

    /// See [`Adam::step_count`].
    pub fn step_count(&self, path: &str) -> u64 {
        self.0.step_count(path)
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.0.step(grads)
    }
    forward_to!(0);
}
