//! Adam and AdamW: PyTorch's `torch.optim.Adam` and `torch.optim.AdamW`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor};
use module_runtime::{Param, StateDict};
use rayon::prelude::*;

use crate::error::{Error, Result, StateError};
use crate::fused::{self, CHUNK};
use crate::group::{GroupOptions, NamedParams, ParamGroup, ParamGroups};
use crate::optimizer::Optimizer;
use crate::state::{non_negative, param_like, scalar, Buf, Core, Hyper, ParamState};

/// `Adam`'s and `AdamW`'s hyperparameters (PyTorch's names). [`Adam::options`] and
/// [`AdamW::options`] give each optimizer's defaults.
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
    /// an L2 penalty added to the gradient (Adam). [`AdamW`] always sets it.
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
    /// Sets `lr`.
    pub fn lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }
    /// Sets `betas`.
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.betas = (beta1, beta2);
        self
    }
    /// Sets `eps`.
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    /// Sets `weight_decay`.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Sets `amsgrad`.
    pub fn amsgrad(mut self, amsgrad: bool) -> Self {
        self.amsgrad = amsgrad;
        self
    }
    /// Sets `maximize`.
    pub fn maximize(mut self, maximize: bool) -> Self {
        self.maximize = maximize;
        self
    }
    /// Sets `decoupled_weight_decay`.
    pub fn decoupled_weight_decay(mut self, decoupled: bool) -> Self {
        self.decoupled_weight_decay = decoupled;
        self
    }
}

fn flag(b: bool) -> f64 {
    f64::from(u8::from(b))
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

    fn apply(&mut self, o: &GroupOptions, group: usize) -> Result<()> {
        let na = |option| {
            Err(Error::NotApplicable {
                option,
                optimizer: Self::OPTIMIZER,
                group,
            })
        };
        if o.momentum.is_some() {
            return na("momentum");
        }
        if o.dampening.is_some() {
            return na("dampening");
        }
        if o.nesterov.is_some() {
            return na("nesterov");
        }
        self.lr = o.lr.unwrap_or(self.lr);
        self.betas = o.betas.unwrap_or(self.betas);
        self.eps = o.eps.unwrap_or(self.eps);
        self.weight_decay = o.weight_decay.unwrap_or(self.weight_decay);
        self.amsgrad = o.amsgrad.unwrap_or(self.amsgrad);
        self.maximize = o.maximize.unwrap_or(self.maximize);
        Ok(())
    }

    fn validate(&self, group: Option<usize>) -> Result<()> {
        let bad = |name, value, reason| {
            Err(Error::InvalidHyperparameter {
                name,
                value,
                reason,
                group,
            })
        };
        if !non_negative(self.lr) {
            return bad("lr", self.lr, "the learning rate must be >= 0");
        }
        if !non_negative(self.eps) {
            return bad("eps", self.eps, "epsilon must be >= 0");
        }
        if !(0.0..1.0).contains(&self.betas.0) {
            return bad("betas.0", self.betas.0, "beta1 must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.betas.1) {
            return bad("betas.1", self.betas.1, "beta2 must be in [0, 1)");
        }
        if !non_negative(self.weight_decay) {
            return bad(
                "weight_decay",
                self.weight_decay,
                "weight decay must be >= 0",
            );
        }
        Ok(())
    }

    fn get(&self, name: &str) -> f64 {
        match name {
            "lr" => self.lr,
            "betas.0" => self.betas.0,
            "betas.1" => self.betas.1,
            "eps" => self.eps,
            "weight_decay" => self.weight_decay,
            "amsgrad" => flag(self.amsgrad),
            "maximize" => flag(self.maximize),
            "decoupled_weight_decay" => flag(self.decoupled_weight_decay),
            _ => unreachable!("not an Adam hyperparameter: {name}"),
        }
    }

    fn set(&mut self, name: &str, value: f64) {
        match name {
            "lr" => self.lr = value,
            "betas.0" => self.betas.0 = value,
            "betas.1" => self.betas.1 = value,
            "eps" => self.eps = value,
            "weight_decay" => self.weight_decay = value,
            "amsgrad" => self.amsgrad = value != 0.0,
            "maximize" => self.maximize = value != 0.0,
            "decoupled_weight_decay" => self.decoupled_weight_decay = value != 0.0,
            _ => unreachable!("not an Adam hyperparameter: {name}"),
        }
    }
}

/// Adam's state for one parameter (PyTorch's names).
pub(crate) struct AdamState {
    step: u64,
    exp_avg: Buf,
    exp_avg_sq: Buf,
    max_exp_avg_sq: Option<Buf>,
}

impl AdamState {
    /// Zero state for `p`: host vectors for the fused pass, tensors like `p` otherwise.
    fn zeros(p: &Tensor, amsgrad: bool, host: bool) -> Result<Self> {
        let z = || -> Result<Buf> {
            Ok(if host {
                Buf::Host(vec![0.0; p.elem_count()])
            } else {
                Buf::Tensor(p.zeros_like()?)
            })
        };
        Ok(Self {
            step: 0,
            exp_avg: z()?,
            exp_avg_sq: z()?,
            max_exp_avg_sq: if amsgrad { Some(z()?) } else { None },
        })
    }
}

impl ParamState<AdamOptions> for AdamState {
    const NAMES: &'static [&'static str] = &["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"];

    fn entries(&self, shape: &Shape, device: &Device) -> Result<Vec<(&'static str, Tensor)>> {
        let mut out = vec![
            // PyTorch keeps `step` as a float32 tensor; a float64 one holds every count exactly
            // up to 2^53.
            ("step", Tensor::new(self.step as f64, &Device::Cpu)?),
            ("exp_avg", self.exp_avg.tensor(shape, device)?),
            ("exp_avg_sq", self.exp_avg_sq.tensor(shape, device)?),
        ];
        if let Some(m) = &self.max_exp_avg_sq {
            out.push(("max_exp_avg_sq", m.tensor(shape, device)?));
        }
        Ok(out)
    }

    fn from_entries(
        take: &mut dyn FnMut(&'static str) -> Option<Tensor>,
        key: &dyn Fn(&str) -> String,
        options: &AdamOptions,
        param: &Param,
    ) -> Result<Self> {
        let mut missing = Vec::new();
        let mut get = |name: &'static str| {
            let t = take(name);
            if t.is_none() {
                missing.push(key(name));
            }
            t
        };
        let step = get("step");
        let exp_avg = get("exp_avg");
        let exp_avg_sq = get("exp_avg_sq");
        let max = if options.amsgrad {
            get("max_exp_avg_sq")
        } else {
            None
        };
        let (Some(step), Some(exp_avg), Some(exp_avg_sq)) = (step, exp_avg, exp_avg_sq) else {
            return Err(StateError::MissingKeys { keys: missing }.into());
        };
        if options.amsgrad && max.is_none() {
            return Err(StateError::MissingKeys { keys: missing }.into());
        }
        let step_key = key("step");
        let s = scalar(&step, &step_key)?;
        if !(s >= 0.0 && s.fract() == 0.0 && s <= 2f64.powi(53)) {
            return Err(StateError::InvalidValue {
                key: step_key,
                reason: format!("{s} is not a step count"),
            }
            .into());
        }
        let buf = |t: Tensor, name: &str| -> Result<Buf> {
            Ok(Buf::Tensor(param_like(t, &key(name), param)?))
        };
        Ok(Self {
            step: s as u64,
            exp_avg: buf(exp_avg, "exp_avg")?,
            exp_avg_sq: buf(exp_avg_sq, "exp_avg_sq")?,
            max_exp_avg_sq: max.map(|t| buf(t, "max_exp_avg_sq")).transpose()?,
        })
    }
}

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
/// (see [`set_fused`](Self::set_fused)); others by candle ops.
///
/// ```
/// use module_optim::{Adam, AdamOptions, Optimizer};
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

    /// Adam over every trainable parameter of `params` (a model), in one group.
    pub fn new(params: &(impl NamedParams + ?Sized), options: AdamOptions) -> Result<Self> {
        Self::with_groups(params, options, &ParamGroups::new())
    }

    /// Adam over the trainable parameters of `params`, split into `groups`, each with `options`
    /// overridden by its own.
    pub fn with_groups(
        params: &(impl NamedParams + ?Sized),
        options: AdamOptions,
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
    pub fn param_groups(&self) -> &[ParamGroup<AdamOptions>] {
        &self.core.groups
    }

    /// The parameter groups, with their hyperparameters writable.
    pub fn param_groups_mut(&mut self) -> &mut [ParamGroup<AdamOptions>] {
        &mut self.core.groups
    }

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
        let core = &mut self.core;
        for (group, states) in core.groups.iter().zip(core.state.iter_mut()) {
            let o = &group.options;
            for ((_, param), state) in group.params.iter().zip(states.iter_mut()) {
                let var = param.var()?;
                let p = var.as_tensor();
                let Some(g) = grads.get(p) else {
                    continue;
                };
                let fused = self.fused && fused::is_cpu_f32(p) && fused::is_cpu_f32(g);
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
                } else {
                    let new = step_composed(p, g, state, o, &s)?;
                    var.set(&new)?;
                }
            }
        }
        Ok(())
    }

    fn num_param_groups(&self) -> usize {
        self.core.groups.len()
    }
    fn lr(&self, group: usize) -> f64 {
        self.core.groups[group].options.lr
    }
    fn set_lr(&mut self, group: usize, lr: f64) {
        self.core.groups[group].options.lr = lr;
    }
    fn group_params(&self, group: usize) -> &[(String, Param)] {
        &self.core.groups[group].params
    }
    fn state_dict(&self) -> Result<StateDict> {
        self.core.state_dict()
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.core.load_state_dict(state)
    }
}

/// AdamW: PyTorch's `torch.optim.AdamW`, which is [`Adam`] with decoupled weight decay
/// (`p *= 1 - lr * weight_decay` before the update) and a default weight decay of 1e-2.
///
/// ```
/// use module_optim::{AdamW, Optimizer, ParamGroups};
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
        Self::with_groups(params, options, &ParamGroups::new())
    }

    /// AdamW over the trainable parameters of `params`, split into `groups`.
    pub fn with_groups(
        params: &(impl NamedParams + ?Sized),
        options: AdamOptions,
        groups: &ParamGroups,
    ) -> Result<Self> {
        Ok(Self(Adam::with_groups(
            params,
            options.decoupled_weight_decay(true),
            groups,
        )?))
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
    fn num_param_groups(&self) -> usize {
        self.0.num_param_groups()
    }
    fn lr(&self, group: usize) -> f64 {
        self.0.lr(group)
    }
    fn set_lr(&mut self, group: usize, lr: f64) {
        self.0.set_lr(group, lr);
    }
    fn group_params(&self, group: usize) -> &[(String, Param)] {
        self.0.group_params(group)
    }
    fn state_dict(&self) -> Result<StateDict> {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.0.load_state_dict(state)
    }
}

/// The step's scalars, computed in `f64` as PyTorch computes them in Python.
struct Scalars {
    /// `1 - beta1`, the weight of `lerp`.
    lerp_weight: f64,
    /// `lr / (1 - beta1^t)`.
    step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    bias_correction2_sqrt: f64,
}

impl Scalars {
    fn new(o: &AdamOptions, step: u64) -> Self {
        let t = step as f64;
        let bias_correction1 = 1.0 - o.betas.0.powf(t);
        let bias_correction2 = 1.0 - o.betas.1.powf(t);
        Self {
            lerp_weight: 1.0 - o.betas.0,
            step_size: o.lr / bias_correction1,
            // Python's `bias_correction2 ** 0.5` is C's `pow(x, 0.5)`, which may round otherwise
            // than `sqrt`.
            bias_correction2_sqrt: bias_correction2.powf(0.5),
        }
    }
}

/// One parameter's update with candle ops, one per PyTorch op; returns the new value.
fn step_composed(
    p: &Tensor,
    g: &Tensor,
    state: &mut AdamState,
    o: &AdamOptions,
    s: &Scalars,
) -> Result<Tensor> {
    let (shape, dev, dtype) = (p.shape().clone(), p.device().clone(), p.dtype());
    let mut p = p.detach();
    let mut g = if o.maximize { g.neg()? } else { g.clone() };
    if o.weight_decay != 0.0 {
        if o.decoupled_weight_decay {
            // param.mul_(1 - lr * weight_decay)
            p = p.affine(1.0 - o.lr * o.weight_decay, 0.0)?;
        } else {
            // grad = grad.add(param, alpha=weight_decay)
            g = (&g + p.affine(o.weight_decay, 0.0)?)?;
        }
    }
    // exp_avg.lerp_(grad, 1 - beta1), PyTorch's lerp: `m + w (g - m)` for a weight below 0.5,
    // `g - (g - m)(1 - w)` otherwise, with `1 - w` taken in the parameter's dtype.
    let m = state.exp_avg.tensor(&shape, &dev)?;
    let diff = (&g - &m)?;
    let m = if s.lerp_weight.abs() < 0.5 {
        (&m + diff.affine(s.lerp_weight, 0.0)?)?
    } else {
        // `1 - w` in the parameter's dtype: exact for float32, as `f64` otherwise.
        let one_minus_w = match dtype {
            DType::F32 => f64::from(1.0f32 - s.lerp_weight as f32),
            _ => 1.0 - s.lerp_weight,
        };
        (&g - diff.affine(one_minus_w, 0.0)?)?
    };
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    let v = state.exp_avg_sq.tensor(&shape, &dev)?;
    let v = (v.affine(o.betas.1, 0.0)? + (g.affine(1.0 - o.betas.1, 0.0)? * &g)?)?;
    let second = match &mut state.max_exp_avg_sq {
        Some(max) => {
            // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            let new_max = max.tensor(&shape, &dev)?.maximum(&v)?;
            *max = Buf::Tensor(new_max.clone());
            new_max
        }
        None => v.clone(),
    };
    // denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
    let bc2 = Tensor::new(s.bias_correction2_sqrt, &dev)?.to_dtype(dtype)?;
    let denom = second.sqrt()?.broadcast_div(&bc2)?.affine(1.0, o.eps)?;
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    let new = (&p + (m.affine(-s.step_size, 0.0)? / denom)?)?;
    state.exp_avg = Buf::Tensor(m);
    state.exp_avg_sq = Buf::Tensor(v);
    Ok(new)
}

/// The step's constants for the fused pass, each the `f32` the composed path's op uses.
struct Consts {
    /// `1 - lr * weight_decay` (decoupled decay).
    decay: f32,
    /// `weight_decay` (L2 decay).
    weight_decay: f32,
    /// The `lerp` weight `1 - beta1`, and `1 - weight` in `f32`.
    w: f32,
    one_minus_w: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

/// No weight decay, decoupled decay, L2 decay: the `DECAY` of [`rule`].
const NO_DECAY: u8 = 0;
const DECOUPLED: u8 = 1;
const L2: u8 = 2;

/// The update of one value, as [`step_composed`] computes it (candle's `affine(a, 0)` is
/// `x * a + 0.0`). The flags are constants, so each combination compiles to a loop without
/// branches, which the compiler vectorizes.
#[inline(always)]
fn rule<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool>(
    k: &Consts,
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    max: Option<&mut f32>,
) {
    let mut g = if MAXIMIZE { -g } else { g };
    if DECAY == DECOUPLED {
        *p = *p * k.decay + 0.0;
    } else if DECAY == L2 {
        g += *p * k.weight_decay + 0.0;
    }
    let diff = g - *m;
    *m = if SMALL {
        *m + (diff * k.w + 0.0)
    } else {
        g - (diff * k.one_minus_w + 0.0)
    };
    *v = (*v * k.beta2 + 0.0) + ((g * k.one_minus_beta2 + 0.0) * g);
    let second = match max {
        Some(max) => {
            // candle's `maximum`: `if a < b { b } else { a }`.
            *max = if *max < *v { *v } else { *max };
            *max
        }
        None => *v,
    };
    let denom = (second.sqrt() / k.bias_correction2_sqrt) * 1.0 + k.eps;
    *p += (*m * k.neg_step_size + 0.0) / denom;
}

/// [`rule`] over one chunk of values.
#[inline(always)]
fn chunk<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool>(
    k: &Consts,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: Option<&mut [f32]>,
) {
    match max {
        None => {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                rule::<MAXIMIZE, DECAY, SMALL>(k, p, g, m, v, None);
            }
        }
        Some(x) => {
            for ((((p, &g), m), v), x) in p.iter_mut().zip(g).zip(m).zip(v).zip(x) {
                rule::<MAXIMIZE, DECAY, SMALL>(k, p, g, m, v, Some(x));
            }
        }
    }
}

/// [`chunk`] compiled for AVX2 (8 lanes instead of SSE2's 4). The results are the same bits:
/// the compiler fuses no multiply-add without being told to, and AVX's division and square root
/// are IEEE's, as SSE's are.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn chunk_avx2<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool>(
    k: &Consts,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: Option<&mut [f32]>,
) {
    chunk::<MAXIMIZE, DECAY, SMALL>(k, p, g, m, v, max);
}

/// [`chunk`], through [`chunk_avx2`] where the CPU has AVX2.
fn chunk_best<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool>(
    k: &Consts,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: Option<&mut [f32]>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the one feature `chunk_avx2` is compiled for (checked just
        // above; the detection is cached, so this costs one load per chunk).
        unsafe { chunk_avx2::<MAXIMIZE, DECAY, SMALL>(k, p, g, m, v, max) };
        return;
    }
    chunk::<MAXIMIZE, DECAY, SMALL>(k, p, g, m, v, max);
}

/// The pass over a whole parameter, split in chunks over rayon's threads.
fn pass<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool>(
    k: &Consts,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: Option<&mut [f32]>,
) {
    let run = chunk_best::<MAXIMIZE, DECAY, SMALL>;
    if p.len() <= CHUNK {
        return run(k, p, g, m, v, max);
    }
    let chunks = p
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK));
    match max {
        None => chunks.for_each(|(((p, g), m), v)| run(k, p, g, m, v, None)),
        Some(x) => chunks
            .zip(x.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), x)| run(k, p, g, m, v, Some(x))),
    }
}

type Pass = fn(&Consts, &mut [f32], &[f32], &mut [f32], &mut [f32], Option<&mut [f32]>);

/// The [`pass`] for the flags.
fn pass_for(maximize: bool, decay: u8, small: bool) -> Pass {
    macro_rules! pick {
        ($($mx:literal, $d:ident, $s:literal);* $(;)?) => {
            match (maximize, decay, small) {
                $(($mx, $d, $s) => pass::<$mx, $d, $s>,)*
                _ => unreachable!("decay is one of the three kinds"),
            }
        };
    }
    pick!(
        false, NO_DECAY, true; false, NO_DECAY, false;
        false, DECOUPLED, true; false, DECOUPLED, false;
        false, L2, true; false, L2, false;
        true, NO_DECAY, true; true, NO_DECAY, false;
        true, DECOUPLED, true; true, DECOUPLED, false;
        true, L2, true; true, L2, false;
    )
}

/// [`step_composed`] as one in-place pass over CPU float32 values.
fn step_fused(
    p: &Tensor,
    g: &Tensor,
    state: &mut AdamState,
    o: &AdamOptions,
    s: &Scalars,
) -> Result<()> {
    let decay = match (o.weight_decay != 0.0, o.decoupled_weight_decay) {
        (false, _) => NO_DECAY,
        (true, true) => DECOUPLED,
        (true, false) => L2,
    };
    let w = s.lerp_weight as f32;
    let k = Consts {
        decay: (1.0 - o.lr * o.weight_decay) as f32,
        weight_decay: o.weight_decay as f32,
        w,
        one_minus_w: 1.0f32 - w,
        beta2: o.betas.1 as f32,
        one_minus_beta2: (1.0 - o.betas.1) as f32,
        bias_correction2_sqrt: s.bias_correction2_sqrt as f32,
        eps: o.eps as f32,
        neg_step_size: -s.step_size as f32,
    };
    let run = pass_for(o.maximize, decay, s.lerp_weight.abs() < 0.5);
    let exp_avg = state.exp_avg.host()?;
    let exp_avg_sq = state.exp_avg_sq.host()?;
    let max = match &mut state.max_exp_avg_sq {
        Some(b) => Some(b.host()?.as_mut_slice()),
        None => None,
    };
    fused::update_in_place(p, g, |p, g| run(&k, p, g, exp_avg, exp_avg_sq, max))
}
