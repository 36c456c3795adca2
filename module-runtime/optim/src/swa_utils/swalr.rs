//! `SwaLr`: PyTorch's `torch.optim.swa_utils.SWALR`, the learning rate annealed to a constant for
//! the averaging phase of SWA.

use std::f64::consts::PI;

use candle_core::{DType, Device, Tensor};
use module_state::StateDict;

use crate::error::{Error, Result, StateError};
use crate::optimizer::Optimizer;
use crate::schedule::{load_progress, save_progress, set_all, LrScheduler};

/// How [`SwaLr`] goes from a group's learning rate to its SWA learning rate: PyTorch's
/// `anneal_strategy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnnealStrategy {
    /// `"cos"` (PyTorch's default): the weight of the SWA rate is `(1 - cos(pi * t)) / 2`.
    Cos,
    /// `"linear"`: the weight of the SWA rate is `t`.
    Linear,
}

impl AnnealStrategy {
    fn weight(self, t: f64) -> f64 {
        match self {
            Self::Cos => (1.0 - (PI * t).cos()) / 2.0,
            Self::Linear => t,
        }
    }

    /// How the state dict stores it (PyTorch saves the string).
    fn code(self) -> f64 {
        match self {
            Self::Cos => 0.0,
            Self::Linear => 1.0,
        }
    }
}

/// Anneals each parameter group's learning rate to its SWA learning rate over `anneal_epochs`
/// steps, then holds it: PyTorch's `torch.optim.swa_utils.SWALR`, stepped (like every
/// [`LrScheduler`]) once per epoch of the averaging phase, with its recursive rule, so the rates
/// are PyTorch's to the last bit, a rate set by another schedule before the phase included:
///
/// ```text
/// step s, t = clamp(s / max(1, anneal_epochs), 0, 1), alpha = anneal(t)
/// lr_before = the rate alpha(s - 1) blended in, taken back out of the group's current rate
/// lr = swa_lr * alpha + lr_before * (1 - alpha)
/// ```
///
/// ```
/// use module_runtime::optim::swa_utils::{AnnealStrategy, SwaLr};
/// use module_runtime::optim::{LrScheduler, Optimizer, SgdOptions, SGD};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(3, 2, &Device::Cpu)?;
/// let mut opt = SGD::new(&model, SgdOptions::new(0.1))?;
/// // swa_scheduler = SWALR(optimizer, swa_lr=0.05, anneal_epochs=2, anneal_strategy="linear")
/// let mut swa_scheduler = SwaLr::new(&mut opt, 0.05, 2, AnnealStrategy::Linear);
/// swa_scheduler.step(&mut opt);
/// assert!((opt.lr(0) - 0.075).abs() < 1e-12);
/// swa_scheduler.step(&mut opt);
/// assert_eq!(opt.lr(0), 0.05);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Its state dict has the common schedule keys, `anneal_epochs`, `_anneal_strategy` (0 for
/// `"cos"`, 1 for `"linear"`: PyTorch saves the string) and `swa_lrs` (one per group: PyTorch
/// keeps them in the optimizer's groups as `swa_lr`, which our optimizers do not have). A PyTorch
/// `SWALR` state read by [`read_pth_scheduler_state`](crate::read_pth_scheduler_state) has no
/// `swa_lrs`: loaded, the schedule keeps its own, so make it with the PyTorch run's `swa_lr`
/// (as a [`LambdaLr`](crate::LambdaLr) is made with the run's function).
pub struct SwaLr {
    swa_lrs: Vec<f64>,
    anneal_epochs: usize,
    strategy: AnnealStrategy,
    last_epoch: usize,
    base_lrs: Vec<f64>,
    last_lr: Vec<f64>,
}

impl SwaLr {
    /// The schedule with one SWA learning rate for every group (PyTorch's `swa_lr` as a float);
    /// sets the rates of step 0 (the groups' own, or `swa_lr` at once when `anneal_epochs` is 0).
    pub fn new(
        opt: &mut dyn Optimizer,
        swa_lr: f64,
        anneal_epochs: usize,
        anneal_strategy: AnnealStrategy,
    ) -> Self {
        let swa_lrs = vec![swa_lr; opt.num_param_groups()];
        Self::start(opt, swa_lrs, anneal_epochs, anneal_strategy)
    }

    /// The schedule with an SWA learning rate per group (PyTorch's `swa_lr` as a list): one per
    /// parameter group, else [`Error::InvalidHyperparameter`].
    pub fn per_group(
        opt: &mut dyn Optimizer,
        swa_lrs: Vec<f64>,
        anneal_epochs: usize,
        anneal_strategy: AnnealStrategy,
    ) -> Result<Self> {
        if swa_lrs.len() != opt.num_param_groups() {
            return Err(Error::InvalidHyperparameter {
                name: "swa_lr",
                value: swa_lrs.len() as f64,
                reason:
                    "one SWA learning rate per parameter group is needed (this many were given)",
                group: None,
            });
        }
        Ok(Self::start(opt, swa_lrs, anneal_epochs, anneal_strategy))
    }

    fn start(
        opt: &mut dyn Optimizer,
        swa_lrs: Vec<f64>,
        anneal_epochs: usize,
        strategy: AnnealStrategy,
    ) -> Self {
        let base_lrs = opt.lrs();
        let mut s = Self {
            swa_lrs,
            anneal_epochs,
            strategy,
            last_epoch: 0,
            last_lr: base_lrs.clone(),
            base_lrs,
        };
        s.apply(opt);
        s
    }

    /// The SWA learning rates, one per group.
    pub fn swa_lrs(&self) -> &[f64] {
        &self.swa_lrs
    }

    /// PyTorch's `get_lr` at step `last_epoch`, from the groups' current rates.
    fn apply(&mut self, opt: &mut dyn Optimizer) {
        let epochs = self.anneal_epochs.max(1) as f64;
        let step = if self.anneal_epochs == 0 {
            self.last_epoch.max(1)
        } else {
            self.last_epoch
        } as f64;
        let prev_alpha = self
            .strategy
            .weight(((step - 1.0) / epochs).clamp(0.0, 1.0));
        let alpha = self.strategy.weight((step / epochs).clamp(0.0, 1.0));
        self.last_lr = (0..opt.num_param_groups())
            .map(|g| {
                let (lr, swa_lr) = (opt.lr(g), self.swa_lrs[g]);
                let prev = if prev_alpha == 1.0 {
                    swa_lr
                } else {
                    (lr - prev_alpha * swa_lr) / (1.0 - prev_alpha)
                };
                swa_lr * alpha + prev * (1.0 - alpha)
            })
            .collect();
        set_all(opt, &self.last_lr);
    }
}

impl LrScheduler for SwaLr {
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
        "SWALR"
    }
    fn state_dict(&self) -> Result<StateDict> {
        let own = [
            ("anneal_epochs", self.anneal_epochs as f64),
            ("_anneal_strategy", self.strategy.code()),
        ];
        let mut sd = save_progress(self.last_epoch, &self.last_lr, &self.base_lrs, &own)?;
        sd.insert(
            "swa_lrs",
            Tensor::new(self.swa_lrs.as_slice(), &Device::Cpu)?,
        );
        Ok(sd)
    }
    fn load_state_dict(&mut self, state: &StateDict, opt: &mut dyn Optimizer) -> Result<()> {
        let groups = opt.num_param_groups();
        // PyTorch's state has no SWA rates (they are in its optimizer's groups): keep ours.
        let swa_lrs = match state.get("swa_lrs") {
            Some(t) if t.dims() == [groups] => t.to_dtype(DType::F64)?.to_vec1()?,
            Some(t) => {
                return Err(invalid(
                    "swa_lrs",
                    format!(
                        "shape {:?}, but the optimizer has {groups} parameter groups",
                        t.dims()
                    ),
                ))
            }
            None if self.swa_lrs.len() == groups => self.swa_lrs.clone(),
            None => {
                return Err(StateError::MissingKeys {
                    keys: vec!["swa_lrs".into()],
                }
                .into())
            }
        };
        let rest: StateDict = state
            .iter()
            .filter(|(k, _)| *k != "swa_lrs")
            .map(|(k, t)| (k.to_owned(), t.clone()))
            .collect();
        let own = ["anneal_epochs", "_anneal_strategy"];
        let p = load_progress(&rest, groups, "SWALR", &own)?;
        let (epochs, code) = (p.own[0], p.own[1]);
        if !(epochs >= 0.0 && epochs.fract() == 0.0 && epochs < 1e15) {
            return Err(invalid("anneal_epochs", format!("{epochs} is not a count")));
        }
        let strategy = match code {
            0.0 => AnnealStrategy::Cos,
            1.0 => AnnealStrategy::Linear,
            _ => {
                return Err(invalid(
                    "_anneal_strategy",
                    format!("{code} is neither 0 (\"cos\") nor 1 (\"linear\")"),
                ))
            }
        };
        *self = Self {
            swa_lrs,
            anneal_epochs: epochs as usize,
            strategy,
            last_epoch: p.last_epoch,
            base_lrs: p.base_lrs,
            last_lr: p.last_lr,
        };
        set_all(opt, &self.last_lr);
        Ok(())
    }
}

fn invalid(key: &str, reason: String) -> Error {
    StateError::InvalidValue {
        key: key.to_owned(),
        reason,
    }
    .into()
}
