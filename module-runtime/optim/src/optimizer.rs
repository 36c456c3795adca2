//! The [`Optimizer`] trait every optimizer implements.

use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use module_core::Param;
use module_state::StateDict;

use crate::error::Result;

/// What every optimizer does: PyTorch's `torch.optim.Optimizer`.
///
/// **Gradients are values in candle.** `loss.backward()` returns a fresh
/// [`GradStore`]; [`step`](Self::step) reads the gradient of each of the optimizer's parameters
/// from it (a parameter without one is skipped, as PyTorch skips `p.grad is None`). So there is no
/// `zero_grad`: dropping the store is zeroing the gradients. To accumulate gradients over several
/// micro-batches, sum them in a [`GradAccumulator`](crate::GradAccumulator) and step once; to
/// clip them, pass the store to [`clip_grad_norm`](crate::clip_grad_norm) first.
///
/// The trait is object-safe, so schedules and training loops can take `&mut dyn Optimizer`. Each
/// optimizer also has typed `param_groups()` / `param_groups_mut()` for all its hyperparameters.
pub trait Optimizer {
    /// Updates every parameter that has a gradient in `grads`, by the optimizer's rule.
    fn step(&mut self, grads: &GradStore) -> Result<()>;

    /// `loss.backward()`, then [`step`](Self::step).
    fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        self.step(&grads)
    }

    /// The number of parameter groups.
    fn num_param_groups(&self) -> usize;

    /// The learning rate of parameter group `group`. Panics if there is no such group.
    fn lr(&self, group: usize) -> f64;

    /// Sets the learning rate of parameter group `group` (what a schedule does). Panics if there
    /// is no such group.
    fn set_lr(&mut self, group: usize, lr: f64);

    /// The learning rates of all groups, in order.
    fn lrs(&self) -> Vec<f64> {
        (0..self.num_param_groups()).map(|g| self.lr(g)).collect()
    }

    /// The parameters of group `group` with their paths. Panics if there is no such group.
    fn group_params(&self, group: usize) -> &[(String, Param)];

    /// Every parameter the optimizer trains, group by group.
    fn params(&self) -> Vec<Param> {
        (0..self.num_param_groups())
            .flat_map(|g| self.group_params(g).iter().map(|(_, p)| p.clone()))
            .collect()
    }

    /// The paths of every parameter the optimizer trains, group by group: PyTorch numbers its
    /// parameters 0, 1, 2, … in this order in an optimizer state dict, so `param_paths()[i]` is
    /// the path of PyTorch's parameter `i`.
    fn param_paths(&self) -> Vec<String> {
        (0..self.num_param_groups())
            .flat_map(|g| self.group_params(g).iter().map(|(path, _)| path.clone()))
            .collect()
    }

    /// The optimizer's state, keyed by parameter path:
    ///
    /// - `state.<path>.<name>` for each parameter that has been stepped (`exp_avg`, `exp_avg_sq`,
    ///   `max_exp_avg_sq`, `step` for Adam; `momentum_buffer` for SGD with momentum): PyTorch's
    ///   per-parameter state, keyed by path instead of by index;
    /// - `param_groups.<i>.<name>`: each group's hyperparameters (`lr`, `weight_decay`, …) as
    ///   0-dimensional `f64` tensors (booleans as 0 or 1);
    /// - `params.<path>`: the group of every parameter the optimizer trains, stepped or not, as a
    ///   0-dimensional `u32`.
    fn state_dict(&self) -> Result<StateDict>;

    /// Loads a state dict [`state_dict`](Self::state_dict) gave, strictly and all or nothing: the
    /// same groups, the same parameters in each, state tensors of their parameters' shapes, no key
    /// left over and none missing; on any error ([`StateError`](crate::StateError)) the optimizer is
    /// unchanged. The groups' hyperparameters are taken from the state dict (as PyTorch's
    /// `load_state_dict` does); state tensors are moved to their parameter's device and dtype.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;

    /// Saves [`state_dict`](Self::state_dict) as a safetensors file, as
    /// `torch.save(optimizer.state_dict(), path)` does, through [`StateDict::save_safetensors`]:
    /// atomically (a temporary file beside `path`, flushed, renamed over it), so a failed save
    /// leaves an earlier file intact and no temporary file behind. A path that is a folder or in
    /// a missing folder is an [`Error::Runtime`](crate::Error::Runtime) naming it.
    fn save_state(&self, path: &Path) -> Result<()> {
        Ok(self.state_dict()?.save_safetensors(path)?)
    }

    /// Reads a safetensors file [`save_state`](Self::save_state) wrote and
    /// [loads](Self::load_state_dict) it.
    fn load_state(&mut self, path: &Path) -> Result<()> {
        let state = StateDict::read(path, &module_state::LoadOptions::default())?;
        self.load_state_dict(&state)
    }
}

/// The [`Optimizer`] methods that only read or write the groups and the state, forwarded to
/// `self.$field`: a `Core` (whose inherent methods have the same names), or an optimizer another
/// one wraps (`AdamW` over `Adam`).
macro_rules! forward_to {
    ($field:tt) => {
        fn num_param_groups(&self) -> usize {
            self.$field.num_param_groups()
        }
        fn lr(&self, group: usize) -> f64 {
            self.$field.lr(group)
        }
        fn set_lr(&mut self, group: usize, lr: f64) {
            self.$field.set_lr(group, lr);
        }
        fn group_params(&self, group: usize) -> &[(String, Param)] {
            self.$field.group_params(group)
        }
        fn state_dict(&self) -> Result<StateDict> {
            self.$field.state_dict()
        }
        fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
            self.$field.load_state_dict(state)
        }
    };
}
pub(crate) use forward_to;

/// The inherent constructors and accessors of an optimizer over a `Core` (a struct with fields
/// `core` and `fused`): `new`, `with_groups`, `set_fused`, `param_groups`, `param_groups_mut`.
/// `$name` names the optimizer in their docs, `$options` is its options type.
macro_rules! core_methods {
    ($name:literal, $options:ty) => {
        #[doc = concat!($name, " over every trainable parameter of `params` (a model), in one group.")]
        pub fn new(params: &(impl NamedParams + ?Sized), options: $options) -> Result<Self> {
            Self::with_groups(params, options, &ParamGroups::new())
        }

        #[doc = concat!(
            $name,
            " over the trainable parameters of `params`, split into `groups`, each with `options` \
             overridden by its own."
        )]
        pub fn with_groups(
            params: &(impl NamedParams + ?Sized),
            options: $options,
            groups: &ParamGroups,
        ) -> Result<Self> {
            Ok(Self {
                core: Core::new(params, options, groups)?,
                fused: true,
            })
        }

        /// Whether contiguous CPU float32 parameters are updated by the fused in-place pass (the
        /// default) or by composed candle ops. Both compute the same values.
        pub fn set_fused(&mut self, fused: bool) {
            self.fused = fused;
        }

        /// The parameter groups.
        pub fn param_groups(&self) -> &[ParamGroup<$options>] {
            &self.core.groups
        }

        /// The parameter groups, with their hyperparameters writable.
        pub fn param_groups_mut(&mut self) -> &mut [ParamGroup<$options>] {
            &mut self.core.groups
        }
    };
}
pub(crate) use core_methods;
