//! `AdamOptions`: Adam's and AdamW's hyperparameters, their defaults, overrides and range checks.

use crate::error::Result;
use crate::group::setters;
use crate::state::{check, non_negative, Field, Hyper};

/// `Adam`'s and `AdamW`'s hyperparameters (PyTorch's names).
/// [`Adam::options`](crate::Adam::options) and [`AdamW::options`](crate::AdamW::options) give
/// each optimizer's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamOptions {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the running averages of the gradient and of its square (default
    /// `(0.9, 0.999)`).
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability (default 1e-8).
    pub eps: f64,
    /// Weight decay (Adam: 0, an L2 penalty added to the gradient; AdamW: 1e-2, decoupled).
    pub weight_decay: f64,
    /// The AMSGrad variant: divide by the running maximum of the second moment (default false).
    pub amsgrad: bool,
    /// Maximize the objective instead of minimizing it (default false).
    pub maximize: bool,
    /// Decoupled weight decay, `p *= 1 - lr * weight_decay` before the update (AdamW), instead of
    /// an L2 penalty added to the gradient (Adam). [`AdamW`](crate::AdamW) always sets it.
    pub decoupled_weight_decay: bool,
}

impl Default for AdamOptions {
    /// `torch.optim.Adam`'s defaults.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            maximize: false,
            decoupled_weight_decay: false,
        }
    }
}

impl AdamOptions {
    setters! {
        /// Sets `lr`.
        lr: f64,
        /// Sets `eps`.
        eps: f64,
        /// Sets `weight_decay`.
        weight_decay: f64,
        /// Sets `amsgrad`.
        amsgrad: bool,
        /// Sets `maximize`.
        maximize: bool,
        /// Sets `decoupled_weight_decay`.
        decoupled_weight_decay: bool,
    }

    /// Sets `betas`.
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.betas = (beta1, beta2);
        self
    }
}

impl Hyper for AdamOptions {
    const OPTIMIZER: &'static str = "Adam";
    const NAMES: &'static [&'static str] = &[
        "lr",
        "betas.0",
        "betas.1",
        "eps",
        "weight_decay",
        "amsgrad",
        "maximize",
        "decoupled_weight_decay",
    ];

    fn validate(&self, group: Option<usize>) -> Result<()> {
        let (lr, eps, (beta1, beta2), wd) = (self.lr, self.eps, self.betas, self.weight_decay);
        let reason = "the learning rate must be >= 0";
        check(non_negative(lr), "lr", lr, reason, group)?;
        check(non_negative(eps), "eps", eps, "epsilon must be >= 0", group)?;
        let reason = "beta1 must be in [0, 1)";
        check((0.0..1.0).contains(&beta1), "betas.0", beta1, reason, group)?;
        let reason = "beta2 must be in [0, 1)";
        check((0.0..1.0).contains(&beta2), "betas.1", beta2, reason, group)?;
        let reason = "weight decay must be >= 0";
        check(non_negative(wd), "weight_decay", wd, reason, group)
    }

    fn field(&mut self, name: &str) -> Field<'_> {
        match name {
            "lr" => Field::Value(&mut self.lr),
            "betas.0" => Field::Value(&mut self.betas.0),
            "betas.1" => Field::Value(&mut self.betas.1),
            "eps" => Field::Value(&mut self.eps),
            "weight_decay" => Field::Value(&mut self.weight_decay),
            "amsgrad" => Field::Flag(&mut self.amsgrad),
            "maximize" => Field::Flag(&mut self.maximize),
            "decoupled_weight_decay" => Field::Flag(&mut self.decoupled_weight_decay),
            _ => unreachable!("not an Adam hyperparameter: {name}"),
        }
    }
}
