//! Loss scaling for float16 training: PyTorch's `torch.amp.GradScaler`.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use module_state::StateDict;

use crate::error::{Error, Result, StateError};
use crate::group::setters;
use crate::optimizer::Optimizer;

/// The options of a [`GradScaler`], PyTorch's arguments with its defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct GradScalerOptions {
    /// The scale before any update (default `2.0**16`).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` steps without inf/NaN gradients
    /// (default 2; must be > 1).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with inf/NaN gradients (default 0.5; must be
    /// < 1).
    pub backoff_factor: f64,
    /// How many consecutive steps without inf/NaN gradients grow the scale (default 2000; must
    /// be > 0).
    pub growth_interval: u32,
    /// Whether the scaler does anything (default true). Disabled, `scale` returns its input,
    /// `step` only steps the optimizer, `update` and `unscale_` do nothing, and the state dict is
    /// empty: one training loop serves both cases.
    pub enabled: bool,
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerOptions {
    setters! {
        /// Sets `init_scale`.
        init_scale: f64,
        /// Sets `growth_factor`.
        growth_factor: f64,
        /// Sets `backoff_factor`.
        backoff_factor: f64,
        /// Sets `growth_interval`.
        growth_interval: u32,
        /// Sets `enabled`.
        enabled: bool,
    }
}

/// Where an optimizer is between two [`GradScaler::update`]s (PyTorch's `OptState`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    Unscaled,
    Stepped,
}

/// What the scaler knows of one optimizer since the last update.
#[derive(Clone, Copy, Debug)]
struct OptimizerState {
    stage: Stage,
    /// Whether any of its gradients was inf or NaN; `None` when it had no gradient at all
    /// (PyTorch records no inf check then).
    found_inf: Option<bool>,
}

/// Dynamic loss scaling for float16 training: PyTorch's `torch.amp.GradScaler`.
///
/// Float16 gradients underflow to zero where float32 ones would not; multiplying the loss by a
/// large scale before `backward()` keeps them representable. The scaler then divides the
/// gradients by the scale before the optimizer uses them, skips the optimizer step when any of
/// them is inf or NaN (the scale was too large), and adapts the scale: halved after such a step,
/// doubled after `growth_interval` (2000) steps in a row without one. PyTorch's recipe,
///
/// ```text
/// scaler.scale(loss).backward()
/// scaler.step(optimizer)
/// scaler.update()
/// ```
///
/// reads the same here, with candle's gradients as values (see [`Optimizer`]): the gradient store
/// `backward()` returns is what [`unscale_`](Self::unscale_) divides and [`step`](Self::step)
/// passes to the optimizer.
///
/// ```
/// use module_runtime::optim::{GradScaler, GradScalerOptions, Optimizer, SgdOptions, SGD};
/// use module_runtime::prelude::*;
///
/// let dev = Device::Cpu;
/// let model = Linear::new(3, 2, &dev)?;
/// let mut opt = SGD::new(&model, SgdOptions::new(0.1))?;
/// let mut scaler = GradScaler::new(GradScalerOptions::default())?;
/// let x = Tensor::randn(0f32, 1.0, (4, 3), &dev)?;
/// let loss = model.call(&x)?.sqr()?.mean_all()?;
/// let mut grads = scaler.scale(&loss)?.backward()?; // scaler.scale(loss).backward()
/// // Unscale first to clip the true gradients: scaler.unscale_(optimizer).
/// scaler.unscale_(&opt, &mut grads)?;
/// assert!(scaler.step(&mut opt, &mut grads)?); // finite gradients: the step ran
/// scaler.update(None)?;
/// assert_eq!(scaler.get_scale(), 65536.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// The scaler tells optimizers apart by their address, as PyTorch tells them apart by
/// `id(optimizer)`: do not move an optimizer between `unscale_`/`step` and `update`.
///
/// Its [`state_dict`](Self::state_dict) has PyTorch's keys (`scale`, `growth_factor`,
/// `backoff_factor`, `growth_interval`, `_growth_tracker`), so a PyTorch checkpoint's
/// `scaler.state_dict()` loads through [`read_pth_grad_scaler_state`](crate::read_pth_grad_scaler_state), and a
/// [`TrainingCheckpoint`](crate::TrainingCheckpoint) saves it with the run.
#[derive(Clone, Debug)]
pub struct GradScaler {
    init_scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    enabled: bool,
    init_growth_tracker: u32,
    /// The scale and the growth tracker, made at the first use as PyTorch makes them
    /// (`_lazy_init_scale_growth_tracker`); the scale is float32, as PyTorch's tensor.
    scale: Option<f32>,
    growth_tracker: u32,
    per_optimizer: HashMap<usize, OptimizerState>,
}

fn misuse(reason: impl Into<String>) -> Error {
    Error::GradScaler {
        reason: reason.into(),
    }
}

/// The key an optimizer's state is kept under: its address (PyTorch's `id(optimizer)`).
fn key(optimizer: &dyn Optimizer) -> usize {
    optimizer as *const dyn Optimizer as *const () as usize
}

impl GradScaler {
    /// A scaler with `options`. PyTorch's checks: `growth_factor > 1`, `backoff_factor < 1`,
    /// `growth_interval > 0`, else [`Error::InvalidHyperparameter`].
    pub fn new(options: GradScalerOptions) -> Result<Self> {
        let invalid = |name, value, reason| Error::InvalidHyperparameter {
            name,
            value,
            reason,
            group: None,
        };
        let o = options;
        if o.enabled {
            // PyTorch's asserts.
            if o.growth_factor.is_nan() || o.growth_factor <= 1.0 {
                let reason = "the growth factor must be > 1.0";
                return Err(invalid("growth_factor", o.growth_factor, reason));
            }
            if o.backoff_factor.is_nan() || o.backoff_factor >= 1.0 {
                let reason = "the backoff factor must be < 1.0";
                return Err(invalid("backoff_factor", o.backoff_factor, reason));
            }
        }
        if o.growth_interval == 0 {
            let reason = "growth_interval must be a positive integer";
            return Err(invalid("growth_interval", 0.0, reason));
        }
        Ok(Self {
            init_scale: o.init_scale,
            growth_factor: o.growth_factor,
            backoff_factor: o.backoff_factor,
            growth_interval: o.growth_interval,
            enabled: o.enabled,
            init_growth_tracker: 0,
            scale: None,
            growth_tracker: 0,
            per_optimizer: HashMap::new(),
        })
    }

    /// Whether the scaler is enabled.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The current scale (the initial one before the first [`scale`](Self::scale)); 1 when
    /// disabled. PyTorch's `get_scale()`.
    pub fn get_scale(&self) -> f64 {
        match (self.enabled, self.scale) {
            (false, _) => 1.0,
            (true, Some(s)) => f64::from(s),
            (true, None) => self.init_scale,
        }
    }

    /// PyTorch's `get_growth_factor()`.
    pub fn get_growth_factor(&self) -> f64 {
        self.growth_factor
    }

    /// PyTorch's `set_growth_factor(new_factor)`.
    pub fn set_growth_factor(&mut self, new_factor: f64) {
        self.growth_factor = new_factor;
    }

    /// PyTorch's `get_backoff_factor()`.
    pub fn get_backoff_factor(&self) -> f64 {
        self.backoff_factor
    }

    /// PyTorch's `set_backoff_factor(new_factor)`.
    pub fn set_backoff_factor(&mut self, new_factor: f64) {
        self.backoff_factor = new_factor;
    }

    /// PyTorch's `get_growth_interval()`.
    pub fn get_growth_interval(&self) -> u32 {
        self.growth_interval
    }

    /// PyTorch's `set_growth_interval(new_interval)`.
    pub fn set_growth_interval(&mut self, new_interval: u32) {
        self.growth_interval = new_interval;
    }

    fn lazy_scale(&mut self) -> f32 {
        *self.scale.get_or_insert_with(|| {
            self.growth_tracker = self.init_growth_tracker;
            self.init_scale as f32
        })
    }

    /// `outputs` multiplied by the scale (PyTorch's `scale(outputs)`): call `backward()` on it.
    /// Disabled, `outputs` itself.
    ///
    /// The product's dtype is PyTorch's: a 0-dimensional output (a loss) is promoted to at least
    /// float32, as PyTorch's product with its float32 scale tensor is; any other keeps its dtype
    /// (where a float16 output and the default scale, 2¹⁶ > float16's largest value, give inf,
    /// as in PyTorch).
    pub fn scale(&mut self, outputs: &Tensor) -> Result<Tensor> {
        if !self.enabled {
            return Ok(outputs.clone());
        }
        let scale = self.lazy_scale();
        let dtype = match outputs.dtype() {
            DType::F16 | DType::BF16 if outputs.rank() == 0 => DType::F32,
            d => d,
        };
        let s = Tensor::new(scale, outputs.device())?.to_dtype(dtype)?;
        Ok(outputs.to_dtype(dtype)?.broadcast_mul(&s)?)
    }

    /// Divides the gradients of `optimizer`'s parameters in `grads` by the scale, in place, and
    /// records whether any of them is inf or NaN: PyTorch's `unscale_(optimizer)`, called before
    /// clipping the gradients. [`step`](Self::step) calls it if it was not called since the last
    /// [`update`](Self::update).
    ///
    /// Errors ([`Error::GradScaler`], nothing changed), as PyTorch's: a second call for the same
    /// optimizer before `update`, a call after `step`, a call before any `scale`, and float16
    /// gradients ("Attempting to unscale FP16 gradients": the parameters the optimizer updates
    /// should be float32 master weights).
    pub fn unscale_(&mut self, optimizer: &dyn Optimizer, grads: &mut GradStore) -> Result<()> {
        self.unscale_agreed(optimizer, grads, &Ok)
    }

    /// [`unscale_`](Self::unscale_), with this process's inf check (`None`: no gradient of the
    /// optimizer's was found) turned into the one every process agrees on by `agree`
    /// ([`ShardedGradScaler`](crate::ShardedGradScaler)'s all-reduce).
    pub(crate) fn unscale_agreed(
        &mut self,
        optimizer: &dyn Optimizer,
        grads: &mut GradStore,
        agree: &dyn Fn(Option<bool>) -> Result<Option<bool>>,
    ) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        match self.per_optimizer.get(&key(optimizer)).map(|s| s.stage) {
            Some(Stage::Unscaled) => {
                return Err(misuse(
                    "unscale_() has already been called on this optimizer since the last update().",
                ))
            }
            Some(Stage::Stepped) => return Err(misuse("unscale_() is being called after step().")),
            None => {}
        }
        let Some(scale) = self.scale else {
            return Err(misuse(
                "Attempted unscale_ but the scale is not set. This may indicate your script did \
                 not use scaler.scale(loss or outputs) earlier in the iteration.",
            ));
        };
        // PyTorch: self._scale.double().reciprocal().float()
        let inv_scale = (1.0 / f64::from(scale)) as f32;
        let mut found_inf = None;
        let mut unscaled = Vec::new();
        for g in 0..optimizer.num_param_groups() {
            for (path, param) in optimizer.group_params(g) {
                let var = param.var()?;
                let Some(grad) = grads.get(var.as_tensor()) else {
                    continue;
                };
                if grad.dtype() == DType::F16 {
                    return Err(misuse(format!(
                        "Attempting to unscale FP16 gradients (`{path}`): train float32 \
                         parameters (master weights) and run the float16 computation inside them"
                    )));
                }
                found_inf = Some(found_inf.unwrap_or(false) || !all_finite(grad)?);
                unscaled.push((var, multiply(grad, inv_scale)?));
            }
        }
        let found_inf = agree(found_inf)?;
        for (var, g) in unscaled {
            grads.insert(var.as_tensor(), g);
        }
        self.per_optimizer.insert(
            key(optimizer),
            OptimizerState {
                stage: Stage::Unscaled,
                found_inf,
            },
        );
        Ok(())
    }

    /// Steps `optimizer` on the unscaled gradients unless one of them was inf or NaN: PyTorch's
    /// `step(optimizer)`. Returns whether the optimizer stepped (PyTorch returns the optimizer's
    /// return value, `None` when it skipped). Unscales first if [`unscale_`](Self::unscale_) was not
    /// called for this optimizer since the last [`update`](Self::update); a skipped step leaves
    /// the parameters and the optimizer's state untouched. Disabled, it only steps.
    ///
    /// Errors ([`Error::GradScaler`]), as PyTorch's: a second `step` for the same optimizer
    /// before `update`, and an optimizer none of whose parameters has a gradient ("No inf checks
    /// were recorded for this optimizer.").
    pub fn step(&mut self, optimizer: &mut dyn Optimizer, grads: &mut GradStore) -> Result<bool> {
        self.step_agreed(optimizer, grads, &Ok)
    }

    /// [`step`](Self::step), unscaling through [`unscale_agreed`](Self::unscale_agreed).
    pub(crate) fn step_agreed(
        &mut self,
        optimizer: &mut dyn Optimizer,
        grads: &mut GradStore,
        agree: &dyn Fn(Option<bool>) -> Result<Option<bool>>,
    ) -> Result<bool> {
        if !self.enabled {
            optimizer.step(grads)?;
            return Ok(true);
        }
        let k = key(optimizer);
        match self.per_optimizer.get(&k).map(|s| s.stage) {
            Some(Stage::Stepped) => {
                return Err(misuse(
                    "step() has already been called since the last update().",
                ))
            }
            Some(Stage::Unscaled) => {}
            None => self.unscale_agreed(optimizer, grads, agree)?,
        }
        let state = self
            .per_optimizer
            .get_mut(&k)
            .expect("recorded by unscale_");
        let Some(found_inf) = state.found_inf else {
            return Err(misuse("No inf checks were recorded for this optimizer."));
        };
        if !found_inf {
            optimizer.step(grads)?;
        }
        state.stage = Stage::Stepped;
        Ok(!found_inf)
    }

    /// Updates the scale, PyTorch's `update(new_scale=None)`: with `new_scale`, sets it; otherwise
    /// halves it (`backoff_factor`) if any optimizer's gradients had an inf or NaN since the last
    /// update, and multiplies it by `growth_factor` when this is the `growth_interval`-th update
    /// in a row without (unless that would overflow float32). Then forgets the optimizers'
    /// stages. Disabled, it does nothing.
    ///
    /// Without `new_scale`, at least one optimizer must have been unscaled or stepped since the
    /// last update ("No inf checks were recorded prior to update."); before any
    /// [`scale`](Self::scale) there is no scale to update. Both are [`Error::GradScaler`].
    pub fn update(&mut self, new_scale: Option<f64>) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let Some(scale) = self.scale else {
            return Err(misuse(
                "Attempted update but the scale is not set. This may indicate your script did \
                 not use scaler.scale(loss or outputs) earlier in the iteration.",
            ));
        };
        if let Some(s) = new_scale {
            self.scale = Some(s as f32);
        } else {
            let checks: Vec<bool> = self
                .per_optimizer
                .values()
                .filter_map(|s| s.found_inf)
                .collect();
            if checks.is_empty() {
                return Err(misuse("No inf checks were recorded prior to update."));
            }
            // torch._amp_update_scale_
            if checks.contains(&true) {
                self.scale = Some((f64::from(scale) * self.backoff_factor) as f32);
                self.growth_tracker = 0;
            } else {
                let successful = self.growth_tracker + 1;
                if successful == self.growth_interval {
                    let grown = (f64::from(scale) * self.growth_factor) as f32;
                    if grown.is_finite() {
                        self.scale = Some(grown);
                    }
                    self.growth_tracker = 0;
                } else {
                    self.growth_tracker = successful;
                }
            }
        }
        self.per_optimizer.clear();
        Ok(())
    }

    /// The number of consecutive steps without inf/NaN gradients since the scale last changed.
    fn growth_tracker(&self) -> u32 {
        match self.scale {
            Some(_) => self.growth_tracker,
            None => self.init_growth_tracker,
        }
    }

    /// The scaler's state with PyTorch's keys (`scale`, `growth_factor`, `backoff_factor`,
    /// `growth_interval`, `_growth_tracker`) as 0-dimensional tensors: `f64` for the first three,
    /// `i64` for the others. Empty when disabled, as PyTorch's.
    pub fn state_dict(&self) -> Result<StateDict> {
        let mut sd = StateDict::new();
        if !self.enabled {
            return Ok(sd);
        }
        let cpu = &Device::Cpu;
        sd.insert("scale", Tensor::new(self.get_scale(), cpu)?);
        sd.insert("growth_factor", Tensor::new(self.growth_factor, cpu)?);
        sd.insert("backoff_factor", Tensor::new(self.backoff_factor, cpu)?);
        sd.insert(
            "growth_interval",
            Tensor::new(i64::from(self.growth_interval), cpu)?,
        );
        sd.insert(
            "_growth_tracker",
            Tensor::new(i64::from(self.growth_tracker()), cpu)?,
        );
        Ok(sd)
    }

    /// Loads a state [`state_dict`](Self::state_dict) or
    /// [`read_pth_grad_scaler_state`](crate::read_pth_grad_scaler_state) gave:
    /// PyTorch's `load_state_dict`, strictly (the five keys, no other) and all or nothing (an
    /// error, [`Error::State`], changes nothing). Disabled, it does nothing; an empty state
    /// (saved by a disabled scaler) is an error, as in PyTorch.
    pub fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        if state.is_empty() {
            return Err(misuse(
                "The source state dict is empty, possibly because it was saved from a disabled \
                 instance of GradScaler.",
            ));
        }
        let unexpected: Vec<String> = state
            .keys()
            .filter(|k| !KEYS.contains(k))
            .map(String::from)
            .collect();
        if !unexpected.is_empty() {
            return Err(StateError::UnexpectedKeys { keys: unexpected }.into());
        }
        let missing: Vec<String> = KEYS
            .iter()
            .filter(|k| !state.contains_key(k))
            .map(|k| k.to_string())
            .collect();
        if !missing.is_empty() {
            return Err(StateError::MissingKeys { keys: missing }.into());
        }
        let value = |k: &str| crate::state::scalar(state.get(k).expect("checked above"), k);
        let scale = value("scale")?;
        let growth_factor = value("growth_factor")?;
        let backoff_factor = value("backoff_factor")?;
        let growth_interval = count(value("growth_interval")?, "growth_interval")?;
        let tracker = count(value("_growth_tracker")?, "_growth_tracker")?;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(invalid_value(
                "scale",
                format!("{scale} is not a positive scale"),
            ));
        }
        if growth_interval == 0 {
            return Err(invalid_value("growth_interval", "must be positive".into()));
        }
        self.init_scale = scale;
        if self.scale.is_some() {
            self.scale = Some(scale as f32);
        }
        self.growth_factor = growth_factor;
        self.backoff_factor = backoff_factor;
        self.growth_interval = growth_interval;
        self.init_growth_tracker = tracker;
        self.growth_tracker = tracker;
        Ok(())
    }
}

/// The keys of a scaler's state dict, PyTorch's.
const KEYS: &[&str] = &[
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
];

pub(crate) fn invalid_value(key: &str, reason: String) -> Error {
    StateError::InvalidValue {
        key: key.to_owned(),
        reason,
    }
    .into()
}

/// A non-negative integer that fits a `u32`.
fn count(v: f64, key: &str) -> Result<u32> {
    if v >= 0.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX) {
        Ok(v as u32)
    } else {
        Err(invalid_value(key, format!("{v} is not a count")))
    }
}

/// Whether every element of `t` is finite: `t - t` is 0 for a finite value and NaN for an inf or
/// a NaN, so the sum is NaN exactly when one is not finite (computed where `t` lives).
fn all_finite(t: &Tensor) -> Result<bool> {
    let s = t
        .broadcast_sub(t)?
        .sum_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    Ok(!s.is_nan())
}

/// `grad * inv_scale`, as PyTorch's `_amp_foreach_non_finite_check_and_unscale_` computes it:
/// in float32 for half-precision gradients (rounded back), in the gradient's dtype otherwise;
/// a scale of 1 leaves the values as they are.
fn multiply(grad: &Tensor, inv_scale: f32) -> Result<Tensor> {
    if inv_scale == 1.0 {
        return Ok(grad.clone());
    }
    let dtype = grad.dtype();
    let compute = if dtype == DType::BF16 {
        DType::F32
    } else {
        dtype
    };
    let g = grad.to_dtype(compute)?;
    let s = Tensor::new(inv_scale, grad.device())?.to_dtype(compute)?;
    Ok(g.broadcast_mul(&s)?.to_dtype(dtype)?)
}
