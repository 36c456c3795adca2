//! Stochastic gradient descent: PyTorch's `torch.optim.SGD`.

use candle_core::backprop::GradStore;
use candle_core::{Device, Shape, Tensor};
use module_core::Param;
use module_state::StateDict;

use crate::error::Result;
use crate::fused;
use crate::group::{setters, NamedParams, ParamGroup, ParamGroups};
use crate::optimizer::{core_methods, forward_to, Optimizer};
use crate::state::{check, non_negative, param_like, Buf, Core, Field, Hyper, ParamState};
use module_kernels::{chunked_update, update_in_place, ChunkRule};

/// `SGD`'s hyperparameters (PyTorch's names and defaults; `lr` has no default).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdOptions {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (default 0: plain SGD, no state).
    pub momentum: f64,
    /// Dampening of the momentum (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (default false; needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// Maximize the objective instead of minimizing it (default false).
    pub maximize: bool,
}

impl SgdOptions {
    /// PyTorch's defaults with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
    setters! {
        /// Sets `momentum`.
        momentum: f64,
        /// Sets `dampening`.
        dampening: f64,
        /// Sets `weight_decay`.
        weight_decay: f64,
        /// Sets `nesterov`.
        nesterov: bool,
        /// Sets `maximize`.
        maximize: bool,
    }
}

impl Hyper for SgdOptions {
    const OPTIMIZER: &'static str = "SGD";
    const NAMES: &'static [&'static str] = &[
        "lr",
        "momentum",
        "dampening",
        "weight_decay",
        "nesterov",
        "maximize",
    ];

    fn validate(&self, group: Option<usize>) -> Result<()> {
        let (lr, momentum, wd) = (self.lr, self.momentum, self.weight_decay);
        let reason = "the learning rate must be >= 0";
        check(non_negative(lr), "lr", lr, reason, group)?;
        let reason = "momentum must be >= 0";
        check(non_negative(momentum), "momentum", momentum, reason, group)?;
        let reason = "weight decay must be >= 0";
        check(non_negative(wd), "weight_decay", wd, reason, group)?;
        let nesterov_ok = !self.nesterov || (momentum > 0.0 && self.dampening == 0.0);
        let reason = "Nesterov momentum requires a momentum > 0 and zero dampening";
        check(nesterov_ok, "momentum", momentum, reason, group)
    }

    fn field(&mut self, name: &str) -> Field<'_> {
        match name {
            "lr" => Field::Value(&mut self.lr),
            "momentum" => Field::Value(&mut self.momentum),
            "dampening" => Field::Value(&mut self.dampening),
            "weight_decay" => Field::Value(&mut self.weight_decay),
            "nesterov" => Field::Flag(&mut self.nesterov),
            "maximize" => Field::Flag(&mut self.maximize),
            _ => unreachable!("not an SGD hyperparameter: {name}"),
        }
    }
}

/// SGD's state for one parameter: the momentum buffer (none without momentum).
pub(crate) struct SgdState {
    momentum_buffer: Option<Buf>,
}

impl ParamState<SgdOptions> for SgdState {
    const NAMES: &'static [&'static str] = &["momentum_buffer"];

    fn entries(&self, shape: &Shape, device: &Device) -> Result<Vec<(&'static str, Tensor)>> {
        Ok(match &self.momentum_buffer {
            Some(b) => vec![("momentum_buffer", b.tensor(shape, device)?)],
            None => Vec::new(),
        })
    }

    fn from_entries(
        take: &mut dyn FnMut(&'static str) -> Option<Tensor>,
        key: &dyn Fn(&str) -> String,
        _options: &SgdOptions,
        param: &Param,
    ) -> Result<Self> {
        let momentum_buffer = match take("momentum_buffer") {
            Some(t) => Some(Buf::Tensor(param_like(t, &key("momentum_buffer"), param)?)),
            None => None,
        };
        Ok(Self { momentum_buffer })
    }
}

/// Stochastic gradient descent with optional momentum, Nesterov momentum, dampening, weight decay
/// and maximization: PyTorch's `torch.optim.SGD`, with its update rule (`torch/optim/sgd.py`,
/// `_single_tensor_sgd`):
///
/// ```text
/// d = g (or -g when maximizing)
/// d = d + weight_decay * p                       if weight_decay != 0
/// b = d (first step), else b = momentum * b + (1 - dampening) * d    if momentum != 0
/// d = d + momentum * b (Nesterov), else d = b                        if momentum != 0
/// p = p - lr * d
/// ```
///
/// ```
/// use module_runtime::optim::{Optimizer, SgdOptions, SGD};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let mut opt = SGD::new(&model, SgdOptions::new(0.1).momentum(0.9))?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let loss = model.call(&x)?.sqr()?.mean_all()?;
/// opt.backward_step(&loss)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::upper_case_acronyms)]
pub struct SGD {
    core: Core<SgdOptions, SgdState>,
    fused: bool,
}

impl SGD {
    core_methods!("SGD", SgdOptions);
}

impl Optimizer for SGD {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let fused_on = self.fused;
        self.core.each_with_grad(grads, |o, var, g, state| {
            let state = state.get_or_insert(SgdState {
                momentum_buffer: None,
            });
            // Half-precision parameters: float32 copies, state and arithmetic.
            let (p, g) = fused::in_state_dtype(var.as_tensor(), g)?;
            if fused_on && fused::is_cpu_f32(&p) && fused::is_cpu_f32(&g) {
                step_fused(&p, &g, state, o)?;
                fused::write_back(var, &p)
            } else {
                let new = step_composed(&p, &g, state, o)?;
                var.set(&new.to_dtype(var.dtype())?)?;
                Ok(())
            }
        })
    }

    forward_to!(core);
}

/// One parameter's update with candle ops, one per PyTorch op; returns the new value.
fn step_composed(p: &Tensor, g: &Tensor, state: &mut SgdState, o: &SgdOptions) -> Result<Tensor> {
    let p = p.detach();
    let mut d = if o.maximize { g.neg()? } else { g.clone() };
    if o.weight_decay != 0.0 {
        // grad.add(param, alpha=weight_decay)
        d = (&d + p.affine(o.weight_decay, 0.0)?)?;
    }
    if o.momentum != 0.0 {
        let b = match &state.momentum_buffer {
            None => d.clone(),
            Some(b) => {
                let b = b.tensor(p.shape(), p.device())?;
                // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                (b.affine(o.momentum, 0.0)? + d.affine(1.0 - o.dampening, 0.0)?)?
            }
        };
        d = if o.nesterov {
            (&d + b.affine(o.momentum, 0.0)?)?
        } else {
            b.clone()
        };
        state.momentum_buffer = Some(Buf::Tensor(b));
    }
    // param.add_(grad, alpha=-lr)
    Ok((&p + d.affine(-o.lr, 0.0)?)?)
}

/// The step's constants for the fused pass, each the `f32` the composed path's op uses.
struct Consts {
    weight_decay: f32,
    momentum: f32,
    one_minus_dampening: f32,
    neg_lr: f32,
}

/// No momentum, the first step with momentum (the buffer starts as the direction), a later one:
/// the `MOMENTUM` of [`SgdRule`].
const NONE: u8 = 0;
const FIRST: u8 = 1;
const LATER: u8 = 2;

/// The update of one value, as [`step_composed`] computes it, for the flags of [`SgdRule`].
#[inline(always)]
fn rule<const MAXIMIZE: bool, const DECAY: bool, const MOMENTUM: u8, const NESTEROV: bool>(
    k: &Consts,
    p: &mut f32,
    g: f32,
    b: &mut f32,
) {
    let mut d = if MAXIMIZE { -g } else { g };
    if DECAY {
        d += *p * k.weight_decay + 0.0;
    }
    if MOMENTUM != NONE {
        *b = if MOMENTUM == FIRST {
            d
        } else {
            (*b * k.momentum + 0.0) + (d * k.one_minus_dampening + 0.0)
        };
        d = if NESTEROV {
            d + (*b * k.momentum + 0.0)
        } else {
            *b
        };
    }
    *p += d * k.neg_lr + 0.0;
}

/// SGD's fused update, maximizing or not, with weight decay or not, with one of the three
/// momentum cases (`MOMENTUM`), Nesterov's or not. Its state is the momentum buffer (none
/// without momentum).
struct SgdRule<const MAXIMIZE: bool, const DECAY: bool, const MOMENTUM: u8, const NESTEROV: bool>;

impl<const MAXIMIZE: bool, const DECAY: bool, const MOMENTUM: u8, const NESTEROV: bool> ChunkRule
    for SgdRule<MAXIMIZE, DECAY, MOMENTUM, NESTEROV>
{
    type Consts = Consts;
    type State<'a> = Option<&'a mut [f32]>;

    #[inline(always)]
    fn chunk(k: &Consts, p: &mut [f32], g: &[f32], momentum_buffer: Option<&mut [f32]>) {
        match momentum_buffer {
            None => {
                let mut unused = 0.0;
                for (p, &g) in p.iter_mut().zip(g) {
                    rule::<MAXIMIZE, DECAY, MOMENTUM, NESTEROV>(k, p, g, &mut unused);
                }
            }
            Some(b) => {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(b) {
                    rule::<MAXIMIZE, DECAY, MOMENTUM, NESTEROV>(k, p, g, b);
                }
            }
        }
    }
}

type Pass = fn(&Consts, &mut [f32], &[f32], Option<&mut [f32]>);

/// The [`pass`] for the flags.
fn pass_for(maximize: bool, decay: bool, momentum: u8, nesterov: bool) -> Pass {
    macro_rules! pick {
        ($($mx:literal, $d:literal, $m:ident, $n:literal);* $(;)?) => {
            match (maximize, decay, momentum, nesterov) {
                $(($mx, $d, $m, $n) => chunked_update::<SgdRule<$mx, $d, $m, $n>>,)*
                (mx, d, _, _) => pick_plain(mx, d),
            }
        };
    }
    pick!(
        false, false, FIRST, false; false, false, LATER, false;
        false, false, FIRST, true; false, false, LATER, true;
        false, true, FIRST, false; false, true, LATER, false;
        false, true, FIRST, true; false, true, LATER, true;
        true, false, FIRST, false; true, false, LATER, false;
        true, false, FIRST, true; true, false, LATER, true;
        true, true, FIRST, false; true, true, LATER, false;
        true, true, FIRST, true; true, true, LATER, true;
    )
}

/// The [`pass`] without momentum.
fn pick_plain(maximize: bool, decay: bool) -> Pass {
    match (maximize, decay) {
        (false, false) => chunked_update::<SgdRule<false, false, NONE, false>>,
        (false, true) => chunked_update::<SgdRule<false, true, NONE, false>>,
        (true, false) => chunked_update::<SgdRule<true, false, NONE, false>>,
        (true, true) => chunked_update::<SgdRule<true, true, NONE, false>>,
    }
}

/// [`step_composed`] as one in-place pass over CPU float32 values.
fn step_fused(p: &Tensor, g: &Tensor, state: &mut SgdState, o: &SgdOptions) -> Result<()> {
    let k = Consts {
        weight_decay: o.weight_decay as f32,
        momentum: o.momentum as f32,
        one_minus_dampening: (1.0 - o.dampening) as f32,
        neg_lr: -o.lr as f32,
    };
    let decay = o.weight_decay != 0.0;
    if o.momentum == 0.0 {
        let run = pass_for(o.maximize, decay, NONE, false);
        return Ok(update_in_place(p, g, |p, g| run(&k, p, g, None))?);
    }
    let momentum = if state.momentum_buffer.is_none() {
        FIRST
    } else {
        LATER
    };
    let run = pass_for(o.maximize, decay, momentum, o.nesterov);
    let buf = state
        .momentum_buffer
        .get_or_insert_with(|| Buf::Host(vec![0.0; p.elem_count()]))
        .host()?;
    Ok(update_in_place(p, g, |p, g| {
        run(&k, p, g, Some(buf.as_mut_slice()))
    })?)
}
