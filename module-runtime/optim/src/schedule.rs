//! Learning-rate schedules: PyTorch's `torch.optim.lr_scheduler` and Hugging Face's
//! `get_*_schedule_with_warmup`.

use std::f64::consts::PI;

use candle_core::{DType, Device, Tensor};
use module_state::StateDict;

use crate::error::{Result, StateError};
use crate::optimizer::Optimizer;

/// A learning-rate schedule over any optimizer: PyTorch's `LRScheduler`.
///
/// As in PyTorch, making a schedule sets the optimizer's learning rates for the first step
/// (epoch 0), and [`step`](Self::step) is called after each `optimizer.step()` to set them for the
/// next one. The schedule does not hold the optimizer (so the training loop can keep stepping
/// it); pass the same optimizer to every call.
pub trait LrScheduler {
    /// Advances the schedule by one step and sets the optimizer's learning rates.
    fn step(&mut self, opt: &mut dyn Optimizer);

    /// The learning rates the schedule last set, one per parameter group.
    fn get_last_lr(&self) -> &[f64];

    /// The number of [`step`](Self::step) calls so far (PyTorch's `last_epoch`).
    fn last_epoch(&self) -> usize;

    /// The schedule's progress: `last_epoch` (a 0-dimensional `f64`), `last_lr` (one `f64` per
    /// group) and, for [`LambdaLr`], `base_lrs`. The factor function itself is not saved (as
    /// PyTorch saves no lambdas): resume by making the same schedule and loading this into it.
    /// [`StateDict::save_safetensors`] saves it to a file, atomically.
    fn state_dict(&self) -> Result<StateDict>;

    /// Loads a [`state_dict`](Self::state_dict), strictly and all or nothing, and sets `opt`'s
    /// learning rates to the loaded `last_lr`, so the next optimizer step runs at the rate the
    /// saved run would have used, whichever of the optimizer and the schedule is loaded first.
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()>;
}

/// Saves a schedule's progress.
fn save_progress(
    last_epoch: usize,
    last_lr: &[f64],
    base_lrs: Option<&[f64]>,
) -> Result<StateDict> {
    let mut sd = StateDict::new();
    sd.insert("last_epoch", Tensor::new(last_epoch as f64, &Device::Cpu)?);
    sd.insert("last_lr", Tensor::new(last_lr, &Device::Cpu)?);
    if let Some(b) = base_lrs {
        sd.insert("base_lrs", Tensor::new(b, &Device::Cpu)?);
    }
    Ok(sd)
}

/// Reads a schedule's progress: `(last_epoch, last_lr, base_lrs)`, checked against `groups`.
fn load_progress(
    sd: &StateDict,
    groups: usize,
    with_base: bool,
) -> Result<(usize, Vec<f64>, Option<Vec<f64>>)> {
    let mut names = vec!["last_epoch", "last_lr"];
    if with_base {
        names.push("base_lrs");
    }
    let missing: Vec<String> = names
        .iter()
        .filter(|n| !sd.contains_key(n))
        .map(|n| n.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(StateError::MissingKeys { keys: missing }.into());
    }
    let unexpected: Vec<String> = sd
        .keys()
        .filter(|k| !names.contains(k))
        .map(str::to_owned)
        .collect();
    if !unexpected.is_empty() {
        return Err(StateError::UnexpectedKeys { keys: unexpected }.into());
    }
    let epoch = crate::state::scalar(sd.get("last_epoch").expect("checked"), "last_epoch")?;
    if !(epoch >= 0.0 && epoch.fract() == 0.0) {
        return Err(StateError::InvalidValue {
            key: "last_epoch".into(),
            reason: format!("{epoch} is not a step count"),
        }
        .into());
    }
    let list = |key: &str| -> Result<Vec<f64>> {
        let t = sd.get(key).expect("checked");
        if t.dims() != [groups] {
            return Err(StateError::InvalidValue {
                key: key.to_owned(),
                reason: format!(
                    "shape {:?}, but the optimizer has {groups} parameter groups",
                    t.dims()
                ),
            }
            .into());
        }
        Ok(t.to_dtype(DType::F64)?.to_vec1()?)
    };
    let last_lr = list("last_lr")?;
    let base = if with_base {
        Some(list("base_lrs")?)
    } else {
        None
    };
    Ok((epoch as usize, last_lr, base))
}

fn set_all(opt: &mut dyn Optimizer, lrs: &[f64]) {
    for (g, &lr) in lrs.iter().enumerate() {
        opt.set_lr(g, lr);
    }
}

/// The learning rate `base_lr * factor(step)` for every group: PyTorch's `LambdaLR`, which Hugging
/// Face's `get_*_schedule_with_warmup` return. `base_lr` is each group's learning rate when the
/// schedule is made.
pub struct LambdaLr {
    base_lrs: Vec<f64>,
    last_lr: Vec<f64>,
    last_epoch: usize,
    factor: Box<dyn Fn(usize) -> f64 + Send + Sync>,
}

impl LambdaLr {
    /// A schedule with the learning rate `base_lr * factor(step)`; sets the rates of step 0.
    pub fn new(
        opt: &mut dyn Optimizer,
        factor: impl Fn(usize) -> f64 + Send + Sync + 'static,
    ) -> Self {
        let base_lrs = opt.lrs();
        let mut s = Self {
            last_lr: base_lrs.clone(),
            base_lrs,
            last_epoch: 0,
            factor: Box::new(factor),
        };
        s.apply(opt);
        s
    }

    fn apply(&mut self, opt: &mut dyn Optimizer) {
        let f = (self.factor)(self.last_epoch);
        self.last_lr = self.base_lrs.iter().map(|lr| lr * f).collect();
        set_all(opt, &self.last_lr);
    }

    /// The learning rate as made: Hugging Face's `get_constant_schedule`.
    pub fn constant(opt: &mut dyn Optimizer) -> Self {
        Self::new(opt, |_| 1.0)
    }

    /// Hugging Face's `get_constant_schedule_with_warmup`: the factor rises linearly from 0 over
    /// `num_warmup_steps`, then stays 1.
    pub fn constant_with_warmup(opt: &mut dyn Optimizer, num_warmup_steps: usize) -> Self {
        Self::after_warmup(opt, num_warmup_steps, num_warmup_steps, |_, _| 1.0)
    }

    /// Hugging Face's `get_linear_schedule_with_warmup`: the factor rises linearly from 0 over
    /// `num_warmup_steps`, then falls linearly to 0 at `num_training_steps` (and stays 0).
    pub fn linear_with_warmup(
        opt: &mut dyn Optimizer,
        num_warmup_steps: usize,
        num_training_steps: usize,
    ) -> Self {
        let decay = move |step: usize, span: f64| {
            let left = num_training_steps as f64 - step as f64;
            (left / span).max(0.0)
        };
        Self::after_warmup(opt, num_warmup_steps, num_training_steps, decay)
    }

    /// Hugging Face's `get_cosine_schedule_with_warmup` with its default `num_cycles = 0.5`: the
    /// factor rises linearly from 0 over `num_warmup_steps`, then follows half a cosine down to 0
    /// at `num_training_steps`.
    pub fn cosine_with_warmup(
        opt: &mut dyn Optimizer,
        num_warmup_steps: usize,
        num_training_steps: usize,
    ) -> Self {
        Self::cosine_with_warmup_cycles(opt, num_warmup_steps, num_training_steps, 0.5)
    }

    /// [`cosine_with_warmup`](Self::cosine_with_warmup) with `num_cycles` waves of the cosine
    /// after the warmup (0.5: from the maximum down to 0), clamped at 0.
    pub fn cosine_with_warmup_cycles(
        opt: &mut dyn Optimizer,
        num_warmup_steps: usize,
        num_training_steps: usize,
        num_cycles: f64,
    ) -> Self {
        let decay = move |step: usize, span: f64| {
            let progress = (step - num_warmup_steps) as f64 / span;
            (0.5 * (1.0 + (PI * num_cycles * 2.0 * progress).cos())).max(0.0)
        };
        Self::after_warmup(opt, num_warmup_steps, num_training_steps, decay)
    }

    /// Hugging Face's linear warmup over `num_warmup_steps`, then `decay(step, span)`, `span`
    /// being the steps from the end of the warmup to `num_training_steps` (at least 1).
    fn after_warmup(
        opt: &mut dyn Optimizer,
        num_warmup_steps: usize,
        num_training_steps: usize,
        decay: impl Fn(usize, f64) -> f64 + Send + Sync + 'static,
    ) -> Self {
        let span = (num_training_steps as i128 - num_warmup_steps as i128).max(1) as f64;
        Self::new(opt, move |step| {
            if step < num_warmup_steps {
                warmup(step, num_warmup_steps)
            } else {
                decay(step, span)
            }
        })
    }

    /// The learning rates the schedule started from, one per group.
    pub fn base_lrs(&self) -> &[f64] {
        &self.base_lrs
    }
}

/// Hugging Face's warmup factor `step / max(1, num_warmup_steps)`.
fn warmup(step: usize, num_warmup_steps: usize) -> f64 {
    step as f64 / num_warmup_steps.max(1) as f64
}

impl LrScheduler for LambdaLr {
    fn step(&mut self, opt: &mut dyn Optimizer) {
        self.last_epoch += 1;
        self.apply(opt);
    }
    fn get_last_lr(&self) -> &[f64] {
        &self.last_lr
    }
    fn last_epoch(&self) -> usize {
        self.last_epoch
    }
    fn state_dict(&self) -> Result<StateDict> {
        save_progress(self.last_epoch, &self.last_lr, Some(&self.base_lrs))
    }
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()> {
        let (epoch, last_lr, base) = load_progress(state, opt.num_param_groups(), true)?;
        self.last_epoch = epoch;
        self.base_lrs = base.expect("asked for");
        self.last_lr = last_lr;
        set_all(opt, &self.last_lr);
        Ok(())
    }
}

/// Multiplies every group's learning rate by `gamma` every `step_size` steps: PyTorch's `StepLR`
/// (in its recursive form, so a rate changed by hand between steps is decayed from there, and the
/// values are PyTorch's to the last bit).
pub struct StepLr(Decay);

impl StepLr {
    /// The schedule; the optimizer's rates are those of step 0. Panics if `step_size` is 0.
    pub fn new(opt: &mut dyn Optimizer, step_size: usize, gamma: f64) -> Self {
        assert!(step_size > 0, "StepLR's step_size must be at least 1");
        Self(Decay::new(opt, step_size, gamma))
    }
}

/// Multiplies every group's learning rate by `gamma` at every step: PyTorch's `ExponentialLR`
/// (recursive, as [`StepLr`]).
pub struct ExponentialLr(Decay);

impl ExponentialLr {
    /// The schedule; the optimizer's rates are those of step 0.
    pub fn new(opt: &mut dyn Optimizer, gamma: f64) -> Self {
        Self(Decay::new(opt, 1, gamma))
    }
}

/// `StepLR`'s recursive decay, which `ExponentialLR` is with a step size of 1: every `step_size`
/// steps, each group's current rate times `gamma`.
struct Decay {
    step_size: usize,
    gamma: f64,
    last_lr: Vec<f64>,
    last_epoch: usize,
}

impl Decay {
    fn new(opt: &mut dyn Optimizer, step_size: usize, gamma: f64) -> Self {
        Self {
            step_size,
            gamma,
            last_lr: opt.lrs(),
            last_epoch: 0,
        }
    }
}

impl LrScheduler for Decay {
    fn step(&mut self, opt: &mut dyn Optimizer) {
        self.last_epoch += 1;
        if self.last_epoch.is_multiple_of(self.step_size) {
            let lrs: Vec<f64> = opt.lrs().iter().map(|lr| lr * self.gamma).collect();
            set_all(opt, &lrs);
        }
        self.last_lr = opt.lrs();
    }
    fn get_last_lr(&self) -> &[f64] {
        &self.last_lr
    }
    fn last_epoch(&self) -> usize {
        self.last_epoch
    }
    fn state_dict(&self) -> Result<StateDict> {
        save_progress(self.last_epoch, &self.last_lr, None)
    }
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()> {
        let (epoch, last_lr, _) = load_progress(state, opt.num_param_groups(), false)?;
        self.last_epoch = epoch;
        self.last_lr = last_lr;
        set_all(opt, &self.last_lr);
        Ok(())
    }
}

/// The [`LrScheduler`] of a schedule that wraps a [`Decay`].
macro_rules! forward_to_decay {
    ($($t:ty),*) => {$(
        impl LrScheduler for $t {
            fn step(&mut self, opt: &mut dyn Optimizer) {
                self.0.step(opt);
            }
            fn get_last_lr(&self) -> &[f64] {
                self.0.get_last_lr()
            }
            fn last_epoch(&self) -> usize {
                self.0.last_epoch()
            }
            fn state_dict(&self) -> Result<StateDict> {
                self.0.state_dict()
            }
            fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()> {
                self.0.load_state_dict(state, opt)
            }
        }
    )*};
}
forward_to_decay!(StepLr, ExponentialLr);
