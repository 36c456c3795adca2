//! PyTorch's `torch.optim.swa_utils`: weight averaging.
//!
//! - [`AveragedModel`]: a copy of a model whose weights are a running average of the model's,
//!   updated by [`update_parameters`](AveragedModel::update_parameters) after each optimizer step
//!   (or epoch): Stochastic Weight Averaging by default, an exponential moving average with
//!   [`get_ema_multi_avg_fn`] or [`get_ema_avg_fn`], or a function of your own ([`AvgFn`],
//!   [`MultiAvgFn`]). It is a module itself, whose state dict is PyTorch's (`n_averaged`,
//!   `module.<key>`), so PyTorch's saved `AveragedModel` loads into it and the other way round.
//! - [`update_bn`]: recomputes the running statistics of the `BatchNorm` layers of a model (an
//!   averaged one, typically) in one pass over data;
//! - [`SwaLr`]: PyTorch's `SWALR`, the learning rate annealed to a constant for the averaging
//!   phase.
//!
//! ```
//! use module_runtime::optim::swa_utils::{get_ema_multi_avg_fn, AveragedModel};
//! use module_runtime::optim::{Optimizer, SgdOptions, SGD};
//! use module_runtime::prelude::*;
//!
//! let dev = Device::Cpu;
//! let model = Linear::new(4, 2, &dev)?;
//! let mut opt = SGD::new(&model, SgdOptions::new(0.1))?;
//! // ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
//! let ema_model = AveragedModel::new(&model)?
//!     .multi_avg_fn(get_ema_multi_avg_fn(0.99)?)
//!     .use_buffers(true);
//! let x = Tensor::randn(0f32, 1.0, (8, 4), &dev)?;
//! for _ in 0..3 {
//!     opt.backward_step(&model.call(&x)?.sqr()?.mean_all()?)?;
//!     ema_model.update_parameters(&model)?;
//! }
//! assert_eq!(ema_model.n_averaged()?, 3);
//! // The averaged model runs as the model does, and saves PyTorch's keys.
//! let y = ema_model.call(&x)?;
//! let keys: Vec<String> = ema_model.state_dict()?.keys().map(String::from).collect();
//! assert_eq!(keys, ["n_averaged", "module.weight", "module.bias"]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod avg_fn;
mod swalr;
mod update_bn;

use candle_core::{DType, Device, Tensor};
use module_core::{Buffer, Forward, Module, Param};
use module_derive::Module;
use module_functional::FunctionalExt;
use module_hooks::{ModuleExt, TensorTree};

use crate::error::{Error, Result};

pub use avg_fn::{
    get_ema_avg_fn, get_ema_multi_avg_fn, get_swa_avg_fn, get_swa_multi_avg_fn, AvgFn, MultiAvgFn,
};
pub use swalr::{AnnealStrategy, SwaLr};
pub use update_bn::update_bn;

/// How an [`AveragedModel`] averages.
#[derive(Clone, Debug)]
enum Averaging {
    /// No function given: SWA's running average, PyTorch's foreach form on CUDA, its per-tensor
    /// form elsewhere.
    Swa,
    Single(AvgFn),
    Multi(MultiAvgFn),
}

/// A running average of a model's weights: PyTorch's `torch.optim.swa_utils.AveragedModel`, for
/// Stochastic Weight Averaging (SWA) and exponential moving averages (EMA).
///
/// [`new`](Self::new) makes an independent copy of the model (PyTorch's `deepcopy`, through
/// [`deep_clone`](module_functional::FunctionalExt::deep_clone), so the model must be `Clone`);
/// [`update_parameters`](Self::update_parameters) then folds the model's current weights into it,
/// exactly as PyTorch does:
///
/// - the first call (`n_averaged == 0`) copies the model's values;
/// - later calls average with the function given ([`avg_fn`](Self::avg_fn) per tensor,
///   [`multi_avg_fn`](Self::multi_avg_fn) per list of tensors of one device and dtype), or with
///   SWA's equally weighted running average `avg + (model - avg) / (n_averaged + 1)` when none is;
/// - with [`use_buffers(true)`](Self::use_buffers) the buffers (a `BatchNorm`'s running
///   statistics and `num_batches_tracked`) are averaged with the parameters; otherwise they are
///   copied from the model at every call;
/// - `n_averaged` is incremented.
///
/// It is a module: [`call`](module_hooks::ModuleExt::call) runs the averaged copy (PyTorch's
/// `forward`), and its state dict is PyTorch's, the buffer `n_averaged` (an `i64` scalar) and the
/// copy's keys under `module.`, so `torch.save(swa_model.state_dict(), …)` loads into it strictly
/// and its own state dict loads into PyTorch's `AveragedModel`. The averaging function and
/// `use_buffers` are not saved (as in PyTorch). To keep the average on another device, PyTorch's
/// `device` argument, move it with [`to_device`](module_hooks::ModuleExt::to_device): the model's
/// values are moved to the average's device at each update.
///
/// See the [module docs](self) for an EMA over a training loop.
#[derive(Module, Clone)]
#[module(crate = module_core)]
#[module(class_name = String::from("AveragedModel"))]
pub struct AveragedModel<M: Module> {
    /// The number of models averaged so far, an `i64` scalar buffer (PyTorch's `n_averaged`).
    pub n_averaged: Buffer,
    /// The averaged copy of the model (PyTorch's `module`).
    pub module: M,
    #[module(skip)]
    averaging: Averaging,
    #[module(skip)]
    use_buffers: bool,
}

impl<M: Module + Clone> AveragedModel<M> {
    /// An average of `model`'s weights, starting from an independent copy of it, with SWA's
    /// running average and buffers copied (PyTorch's `AveragedModel(model)`). `n_averaged` is 0:
    /// the first [`update_parameters`](Self::update_parameters) copies the model's values.
    ///
    /// Fails as [`deep_clone`](module_functional::FunctionalExt::deep_clone) does: on an unbuilt
    /// model, or one that shares a module holding weights through an `Arc`.
    pub fn new(model: &M) -> Result<Self> {
        Ok(Self {
            n_averaged: Buffer::new(Tensor::new(0i64, &Device::Cpu)?),
            module: model.deep_clone()?,
            averaging: Averaging::Swa,
            use_buffers: false,
        })
    }
}

impl<M: Module> AveragedModel<M> {
    /// Averages with `avg_fn`, a function of one tensor (PyTorch's `avg_fn` argument; see
    /// [`get_ema_avg_fn`], [`get_swa_avg_fn`]). It replaces a [`multi_avg_fn`](Self::multi_avg_fn)
    /// set before (PyTorch refuses both at once).
    pub fn avg_fn(mut self, avg_fn: AvgFn) -> Self {
        self.averaging = Averaging::Single(avg_fn);
        self
    }

    /// Averages with `multi_avg_fn`, a function of the lists of tensors (PyTorch's `multi_avg_fn`
    /// argument; see [`get_ema_multi_avg_fn`], [`get_swa_multi_avg_fn`]). It replaces an
    /// [`avg_fn`](Self::avg_fn) set before.
    pub fn multi_avg_fn(mut self, multi_avg_fn: MultiAvgFn) -> Self {
        self.averaging = Averaging::Multi(multi_avg_fn);
        self
    }

    /// Whether the buffers are averaged with the parameters (PyTorch's `use_buffers`, default
    /// `false`: they are copied from the model at each update).
    pub fn use_buffers(mut self, use_buffers: bool) -> Self {
        self.use_buffers = use_buffers;
        self
    }

    /// The number of models averaged so far (the `n_averaged` buffer's value).
    pub fn n_averaged(&self) -> Result<i64> {
        Ok(self
            .n_averaged
            .tensor()?
            .to_dtype(DType::I64)?
            .to_scalar::<i64>()?)
    }

    /// Folds `model`'s current weights into the average: PyTorch's
    /// `AveragedModel.update_parameters(model)` (see [`AveragedModel`] for the rule). Gradients are
    /// not recorded.
    ///
    /// `model` must have the averaged copy's parameters (and buffers): the same paths, shapes
    /// and number, or this is [`Error::AveragedModelMismatch`] naming the first that differs.
    /// Every new value is computed before any is written, so on an error (of the check, or of
    /// an averaging function) the average and `n_averaged` are unchanged; the writes are one
    /// [`atomic_update`](module_core::atomic_update), so a thread calling the averaged model
    /// (serving the EMA weights) sees the previous average or the new one, never a mix.
    pub fn update_parameters(&self, model: &M) -> Result<()> {
        let _no_grad = module_core::no_grad();
        let n = self.n_averaged()?;
        let averaged_params = self.module.named_parameters();
        let model_params = model.named_parameters();
        let averaged_buffers = self.module.named_buffers();
        let model_buffers = model.named_buffers();
        let params = pairs(&averaged_params, &model_params, param_value, "parameter")?;
        let buffers = pairs(&averaged_buffers, &model_buffers, buffer_value, "buffer")?;
        let (averaged, copied) = if self.use_buffers {
            (params.into_iter().chain(buffers).collect(), Vec::new())
        } else {
            (params, buffers)
        };
        let new = if n == 0 {
            averaged.iter().map(|p| p.current.clone()).collect()
        } else {
            self.average(&averaged, n)?
        };
        // Everything is computed: write it as one update, so a thread calling the averaged model
        // sees the old average or the new one, never a mix.
        let count = self.n_averaged.tensor()?;
        let next = count.broadcast_add(&count.ones_like()?)?;
        module_core::atomic_update(|| -> Result<()> {
            for (p, value) in averaged.iter().zip(new) {
                p.write(&value)?;
            }
            for p in &copied {
                p.write(&p.current)?;
            }
            self.n_averaged.set(&next)?;
            Ok(())
        })
    }

    /// The new averaged values, one per pair, for `n > 0`.
    fn average(&self, pairs: &[Pair], n: i64) -> Result<Vec<Tensor>> {
        let multi = match &self.averaging {
            Averaging::Single(f) => {
                return pairs
                    .iter()
                    .map(|p| checked(f.call(&p.averaged, &p.current, n)?, p))
                    .collect();
            }
            Averaging::Multi(f) => f.clone(),
            Averaging::Swa => match pairs.first().map(|p| p.averaged.device().is_cuda()) {
                Some(true) => get_swa_multi_avg_fn(),
                _ => {
                    let f = get_swa_avg_fn();
                    return pairs
                        .iter()
                        .map(|p| f.call(&p.averaged, &p.current, n))
                        .collect();
                }
            },
        };
        // PyTorch calls a multi-tensor function once per (device, dtype) group, in the order
        // the groups first appear.
        let mut groups: Vec<(candle_core::DeviceLocation, DType, Vec<usize>)> = Vec::new();
        for (i, p) in pairs.iter().enumerate() {
            let key = (p.averaged.device().location(), p.averaged.dtype());
            match groups.iter_mut().find(|(l, d, _)| (*l, *d) == key) {
                Some((_, _, members)) => members.push(i),
                None => groups.push((key.0, key.1, vec![i])),
            }
        }
        let mut out: Vec<Option<Tensor>> = vec![None; pairs.len()];
        for (_, _, members) in groups {
            let averaged: Vec<Tensor> =
                members.iter().map(|&i| pairs[i].averaged.clone()).collect();
            let current: Vec<Tensor> = members.iter().map(|&i| pairs[i].current.clone()).collect();
            let new = multi.call(&averaged, &current, n)?;
            if new.len() != members.len() {
                return Err(Error::AveragedModelMismatch {
                    path: pairs[members[0]].path.clone(),
                    reason: format!(
                        "the multi_avg_fn returned {} tensors for {} inputs",
                        new.len(),
                        members.len()
                    ),
                });
            }
            for (&i, t) in members.iter().zip(new) {
                out[i] = Some(checked(t, &pairs[i])?);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }
}

/// What a hand-written averaging function returned must fit the averaged value it replaces.
fn checked(t: Tensor, p: &Pair) -> Result<Tensor> {
    if t.shape() != p.averaged.shape() {
        return Err(Error::AveragedModelMismatch {
            path: p.path.clone(),
            reason: format!(
                "the averaging function returned shape {:?} for a value of shape {:?}",
                t.dims(),
                p.averaged.dims()
            ),
        });
    }
    Ok(t.to_dtype(p.averaged.dtype())?)
}

/// One averaged value and the model's value it is updated from.
struct Pair {
    path: String,
    target: Target,
    averaged: Tensor,
    /// The model's value, detached, on the averaged value's device and in its dtype.
    current: Tensor,
}

enum Target {
    Param(Param),
    Buffer(Buffer),
}

impl Pair {
    fn write(&self, value: &Tensor) -> Result<()> {
        match &self.target {
            Target::Param(p) => p.set(value)?,
            Target::Buffer(b) => b.set(value)?,
        }
        Ok(())
    }
}

fn param_value(p: &Param) -> Result<(Target, Tensor)> {
    Ok((Target::Param(p.clone()), p.tensor()?.detach()))
}

fn buffer_value(b: &Buffer) -> Result<(Target, Tensor)> {
    Ok((Target::Buffer(b.clone()), b.tensor()?.detach()))
}

/// The averaged copy's leaves beside the model's, matched by position (as PyTorch zips them)
/// and checked to be the same leaves: the same path and shape.
fn pairs<L>(
    averaged: &[(String, L)],
    model: &[(String, L)],
    value: fn(&L) -> Result<(Target, Tensor)>,
    kind: &str,
) -> Result<Vec<Pair>> {
    if averaged.len() != model.len() {
        let path = averaged
            .iter()
            .map(|(p, _)| p)
            .chain(model.iter().map(|(p, _)| p))
            .find(|p| !averaged.iter().any(|(a, _)| a == *p) || !model.iter().any(|(m, _)| m == *p))
            .cloned()
            .unwrap_or_default();
        return Err(Error::AveragedModelMismatch {
            path,
            reason: format!(
                "the averaged model has {} {kind}s, the model {}",
                averaged.len(),
                model.len()
            ),
        });
    }
    averaged
        .iter()
        .zip(model)
        .map(|((path, a), (model_path, m))| {
            if path != model_path {
                return Err(Error::AveragedModelMismatch {
                    path: path.clone(),
                    reason: format!("the model's {kind} at this position is `{model_path}`"),
                });
            }
            let (target, averaged) = value(a)?;
            let (_, current) = value(m)?;
            if averaged.shape() != current.shape() {
                return Err(Error::AveragedModelMismatch {
                    path: path.clone(),
                    reason: format!(
                        "the average has shape {:?}, the model {:?}",
                        averaged.dims(),
                        current.dims()
                    ),
                });
            }
            let current = current
                .to_device(averaged.device())?
                .to_dtype(averaged.dtype())?;
            Ok(Pair {
                path: path.clone(),
                target,
                averaged,
                current,
            })
        })
        .collect()
}

/// The averaged model runs its copy of the model (PyTorch's `forward`).
impl<M, In> Forward<In> for AveragedModel<M>
where
    M: Module + Forward<In>,
    In: TensorTree,
    M::Output: TensorTree + 'static,
{
    type Output = M::Output;

    fn forward(&self, input: In) -> module_core::Result<M::Output> {
        self.module.call(input)
    }
}
