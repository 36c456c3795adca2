//! Adam's update of one parameter: composed of candle ops (any device and dtype), or one fused
//! in-place pass over CPU float32 values, split over threads, which computes the same bits.

use candle_core::{DType, Tensor};

use super::state::AdamState;
use super::AdamOptions;
use crate::error::Result;
use crate::state::Buf;
use module_kernels::{chunked_update, update_in_place, ChunkRule, StateChunks};

/// The step's scalars, computed in `f64` as PyTorch computes them in Python.
pub(super) struct Scalars {
    /// `1 - beta1`, the weight of `lerp`.
    lerp_weight: f64,
    /// `lr / (1 - beta1^t)`.
    step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    bias_correction2_sqrt: f64,
}

impl Scalars {
    pub(super) fn new(o: &AdamOptions, step: u64) -> Self {
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
pub(super) fn step_composed(
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

/// No weight decay, decoupled decay, L2 decay: the `DECAY` of [`AdamRule`].
const NO_DECAY: u8 = 0;
const DECOUPLED: u8 = 1;
const L2: u8 = 2;

/// The update of one value, as [`step_composed`] computes it (candle's `affine(a, 0)` is
/// `x * a + 0.0`), for the flags of [`AdamRule`].
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

/// Adam's state buffers for one chunk: the moments, and the maximum with AMSGrad.
struct Moments<'a> {
    exp_avg: &'a mut [f32],
    exp_avg_sq: &'a mut [f32],
    max_exp_avg_sq: Option<&'a mut [f32]>,
}

impl StateChunks for Moments<'_> {
    fn split(self, mid: usize) -> (Self, Self) {
        let (m, m_tail) = self.exp_avg.split_at_mut(mid);
        let (v, v_tail) = self.exp_avg_sq.split_at_mut(mid);
        let (max, max_tail) = self.max_exp_avg_sq.split(mid);
        let head = Moments {
            exp_avg: m,
            exp_avg_sq: v,
            max_exp_avg_sq: max,
        };
        let tail = Moments {
            exp_avg: m_tail,
            exp_avg_sq: v_tail,
            max_exp_avg_sq: max_tail,
        };
        (head, tail)
    }
}

/// Adam's fused update, maximizing or not, with one of the three decays (`DECAY`), and the
/// `lerp` of a small weight or of a large one (`SMALL`).
struct AdamRule<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool>;

impl<const MAXIMIZE: bool, const DECAY: u8, const SMALL: bool> ChunkRule
    for AdamRule<MAXIMIZE, DECAY, SMALL>
{
    type Consts = Consts;
    type State<'a> = Moments<'a>;

    #[inline(always)]
    fn chunk(k: &Consts, p: &mut [f32], g: &[f32], state: Moments<'_>) {
        let (m, v) = (state.exp_avg, state.exp_avg_sq);
        match state.max_exp_avg_sq {
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
}

type Pass = fn(&Consts, &mut [f32], &[f32], Moments<'_>);

/// The [`pass`] for the flags.
fn pass_for(maximize: bool, decay: u8, small: bool) -> Pass {
    macro_rules! pick {
        ($($mx:literal, $d:ident, $s:literal);* $(;)?) => {
            match (maximize, decay, small) {
                $(($mx, $d, $s) => chunked_update::<AdamRule<$mx, $d, $s>>,)*
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
pub(super) fn step_fused(
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
    let moments = Moments {
        exp_avg: state.exp_avg.host()?,
        exp_avg_sq: state.exp_avg_sq.host()?,
        max_exp_avg_sq: match &mut state.max_exp_avg_sq {
            Some(b) => Some(b.host()?.as_mut_slice()),
            None => None,
        },
    };
    Ok(update_in_place(p, g, |p, g| run(&k, p, g, moments))?)
}
