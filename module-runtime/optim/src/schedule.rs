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

    /// PyTorch's class name of the schedule (`"StepLR"`), as errors about a state of another
    /// kind name it.
    fn class_name(&self) -> &'static str;

    /// The schedule's state under PyTorch's names (`lr_scheduler.state_dict()`): `last_epoch`,
    /// `_step_count` (PyTorch's count of `step` calls, the one its constructor makes included:
    /// `last_epoch + 1`), `_last_lr` and `base_lrs` (one value per group), and the schedule's own
    /// fields (`StepLR`'s `step_size` and `gamma`, `ExponentialLR`'s `gamma`), each an `f64`
    /// tensor (0-dimensional, or one value per group). The factor function of a [`LambdaLr`] is
    /// not saved (as PyTorch saves no lambdas): resume by making the same schedule and loading
    /// this into it. [`StateDict::save_safetensors`] saves it to a file, atomically;
    /// [`read_pth_scheduler_state`](crate::read_pth_scheduler_state) reads PyTorch's.
    fn state_dict(&self) -> Result<StateDict>;

    /// Loads a [`state_dict`](Self::state_dict), strictly and all or nothing, and sets `opt`'s
    /// learning rates to the loaded `_last_lr`, so the next optimizer step runs at the rate the
    /// saved run would have used, whichever of the optimizer and the schedule is loaded first.
    /// The schedule's own fields come from the state, as PyTorch's `load_state_dict` takes them
    /// (a `StepLR` saved with `step_size=3` steps by 3). A key the schedule does not have, or the
    /// state of another kind of schedule ([`StateError::SchedulerKind`]), is an error.
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()>;
}

/// What every schedule saves, under PyTorch's names.
pub(crate) const COMMON: &[&str] = &["last_epoch", "_step_count", "_last_lr", "base_lrs"];

/// Saves a schedule's progress and its own fields.
pub(crate) fn save_progress(
    last_epoch: usize,
    last_lr: &[f64],
    base_lrs: &[f64],
    own: &[(&str, f64)],
) -> Result<StateDict> {
    let mut sd = StateDict::new();
    let scalar = |x: f64| Tensor::new(x, &Device::Cpu);
    sd.insert("last_epoch", scalar(last_epoch as f64)?);
    sd.insert("_step_count", scalar(last_epoch as f64 + 1.0)?);
    sd.insert("_last_lr", Tensor::new(last_lr, &Device::Cpu)?);
    sd.insert("base_lrs", Tensor::new(base_lrs, &Device::Cpu)?);
    for (name, x) in own {
        sd.insert(*name, scalar(*x)?);
    }
    Ok(sd)
}

/// A schedule's state as read: the progress, and its own fields in the order asked for.
pub(crate) struct Progress {
    pub(crate) last_epoch: usize,
    pub(crate) last_lr: Vec<f64>,
    pub(crate) base_lrs: Vec<f64>,
    pub(crate) own: Vec<f64>,
}

/// Reads a schedule's progress and its own fields `own`, checked against `groups`; `class` is
/// the schedule's PyTorch class, for errors.
pub(crate) fn load_progress(
    sd: &StateDict,
    groups: usize,
    class: &'static str,
    own: &[&str],
) -> Result<Progress> {
    if sd.contains_key("last_lr") && !sd.contains_key("_last_lr") {
        return Err(StateError::InvalidValue {
            key: "last_lr".into(),
            reason: "this schedule state was saved by module-optim before it took PyTorch's \
                     names (`_last_lr`, `_step_count`, `base_lrs` for every schedule); it cannot \
                     be read any more: save it again with this version"
                .into(),
        }
        .into());
    }
    let names: Vec<&str> = COMMON.iter().chain(own).copied().collect();
    let keys: Vec<&str> = sd.keys().collect();
    crate::pth_scheduler::check_kind(class, &keys)?;
    let missing: Vec<String> = names
        .iter()
        .filter(|n| !sd.contains_key(n))
        .map(|n| n.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(StateError::MissingKeys { keys: missing }.into());
    }
    let unexpected: Vec<String> = keys
        .iter()
        .filter(|k| !names.contains(k))
        .map(|k| k.to_string())
        .collect();
    if !unexpected.is_empty() {
        return Err(StateError::UnexpectedKeys { keys: unexpected }.into());
    }
    let get = |key: &str| crate::state::scalar(sd.get(key).expect("checked"), key);
    let count = |key: &str, min: f64| -> Result<usize> {
        let x = get(key)?;
        if !(x >= min && x.fract() == 0.0 && x < 1e15) {
            return Err(StateError::InvalidValue {
                key: key.into(),
                reason: format!("{x} is not a step count of at least {min}"),
            }
            .into());
        }
        Ok(x as usize)
    };
    let last_epoch = count("last_epoch", 0.0)?;
    count("_step_count", 0.0)?;
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
    let last_lr = list("_last_lr")?;
    let base_lrs = list("base_lrs")?;
    let own = own
        .iter()
        .map(|&name| match name {
            "step_size" => count(name, 1.0).map(|n| n as f64),
            _ => get(name),
        })
        .collect::<Result<_>>()?;
    Ok(Progress {
        last_epoch,
        last_lr,
        base_lrs,
        own,
    })
}

pub(crate) fn set_all(opt: &mut dyn Optimizer, lrs: &[f64]) {
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
    fn class_name(&self) -> &'static str {
        "LambdaLR"
    }
    fn state_dict(&self) -> Result<StateDict> {
        save_progress(self.last_epoch, &self.last_lr, &self.base_lrs, &[])
    }
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()> {
        let p = load_progress(state, opt.num_param_groups(), "LambdaLR", &[])?;
        self.last_epoch = p.last_epoch;
        self.base_lrs = p.base_lrs;
        self.last_lr = p.last_lr;
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
        Self(Decay::new(opt, Some(step_size), gamma))
    }
}

/// Multiplies every group's learning rate by `gamma` at every step: PyTorch's `ExponentialLR`
/// (recursive, as [`StepLr`]).
pub struct ExponentialLr(Decay);

impl ExponentialLr {
    /// The schedule; the optimizer's rates are those of step 0.
    pub fn new(opt: &mut dyn Optimizer, gamma: f64) -> Self {
        Self(Decay::new(opt, None, gamma))
    }
}

/// `StepLR`'s recursive decay, which `ExponentialLR` is with a step size of 1: every `step_size`
/// steps, each group's current rate times `gamma`.
struct Decay {
    /// `StepLR`'s step size; `None` for `ExponentialLR`.
    step_size: Option<usize>,
    gamma: f64,
    base_lrs: Vec<f64>,
    last_lr: Vec<f64>,
    last_epoch: usize,
}

impl Decay {
    fn new(opt: &mut dyn Optimizer, step_size: Option<usize>, gamma: f64) -> Self {
        Self {
            step_size,
            gamma,
            base_lrs: opt.lrs(),
            last_lr: opt.lrs(),
            last_epoch: 0,
        }
    }
}

impl LrScheduler for Decay {
    fn step(&mut self, opt: &mut dyn Optimizer) {
        self.last_epoch += 1;
        if self.last_epoch.is_multiple_of(self.step_size.unwrap_or(1)) {
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
    fn class_name(&self) -> &'static str {
        match self.step_size {
            Some(_) => "StepLR",
            None => "ExponentialLR",
        }
    }
    fn state_dict(&self) -> Result<StateDict> {
        let mut own = Vec::new();
        if let Some(n) = self.step_size {
            own.push(("step_size", n as f64));
        }
        own.push(("gamma", self.gamma));
        save_progress(self.last_epoch, &self.last_lr, &self.base_lrs, &own)
    }
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()> {
        let own: &[&str] = match self.step_size {
            Some(_) => &["step_size", "gamma"],
            None => &["gamma"],
        };
        let p = load_progress(state, opt.num_param_groups(), self.class_name(), own)?;
        if let Some(n) = self.step_size.as_mut() {
            *n = p.own[0] as usize;
        }
        self.gamma = *p.own.last().expect("gamma");
        self.last_epoch = p.last_epoch;
        self.base_lrs = p.base_lrs;
        self.last_lr = p.last_lr;
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
            fn class_name(&self) -> &'static str {
                self.0.class_name()
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
