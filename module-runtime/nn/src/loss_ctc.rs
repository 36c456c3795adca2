//! `CTCLoss`, the connectionist temporal classification loss: PyTorch's `torch.nn` class of that
//! name with its options (`blank`, `reduction`, `zero_infinity`).
//!
//! # How it runs
//!
//! The forward variable `α` of Graves et al. (2006) is computed in log space, one frame at a time,
//! from candle's differentiable ops, so the gradient is autograd's. Unreachable states hold a large
//! finite negative number instead of `-∞`, so no `-∞ - (-∞)` can turn a gradient into NaN; such
//! states contribute `exp(-1e30) = 0` to every sum. The lengths and the labels are read back to the
//! host (they choose the states), as PyTorch's CPU kernel reads them. One step per frame and per
//! sequence: fine for training small models, slow for long inputs.

use candle_core::{DType, Tensor};

use crate::common::{batched, input_shape_error};
use crate::error::Result;
use crate::loss_reduction::LossReduction;
use crate::{Forward, Module};

/// Stands for `log 0` in unreachable states: finite, so gradients through it stay finite.
const LOG_ZERO: f64 = -1e30;

/// The connectionist temporal classification loss of log-probabilities `[T, N, C]` (or `[T, C]`)
/// against label sequences: PyTorch's `nn.CTCLoss(blank=0, reduction='mean',
/// zero_infinity=False)`, called with `(log_probs, targets, input_lengths, target_lengths)`.
///
/// `targets` is `[N, S]` (padded) or the `N` sequences concatenated `[Σ target_lengths]`;
/// `input_lengths` and `target_lengths` are `[N]` (`[]` for an unbatched input); all are
/// integer tensors. `Mean` divides each sequence's loss by its target length, then averages over
/// the batch, as PyTorch does. A sequence too short for its labels has an infinite loss (zero with
/// `zero_infinity`). Inputs that do not fit are an [`Error::InputShape`](crate::Error::InputShape).
///
/// Gradient: this is the derivative with respect to `log_probs`. PyTorch's kernel returns Graves'
/// gradient with respect to the logits before a log-softmax instead; after that log-softmax (which
/// is how CTC is used) the two are the same, and that is what the tests compare.
///
/// Typed paths into it: [`CTCLossPath`], from [`CTCLoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct CTCLoss {
    /// The blank label's class id (PyTorch's default 0).
    pub blank: usize,
    /// How the per-sequence losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
    /// Whether an infinite loss (an impossible alignment) becomes 0, and its gradient with it
    /// (PyTorch's default `false`).
    pub zero_infinity: bool,
}

impl CTCLoss {
    /// PyTorch's defaults: blank 0, mean, infinities kept.
    pub fn new() -> Self {
        Self::default()
    }

    /// With the blank label `blank`, PyTorch's other defaults (set `reduction` and
    /// `zero_infinity` as fields: `CTCLoss { zero_infinity: true, ..CTCLoss::with_blank(4) }`).
    pub fn with_blank(blank: usize) -> Self {
        Self {
            blank,
            ..Self::default()
        }
    }
}

/// Integer values of a 0- or 1-dim tensor, for lengths and labels.
fn host_ints(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()?)
}

/// `α` shifted right by `k` states, `LOG_ZERO` coming in.
fn shift(alpha: &Tensor, k: usize) -> Result<Tensor> {
    let len = alpha.dim(0)?;
    let fill = (alpha.zeros_like()? + LOG_ZERO)?;
    if k >= len {
        return Ok(fill);
    }
    Ok(Tensor::cat(
        &[fill.narrow(0, 0, k)?, alpha.narrow(0, 0, len - k)?],
        0,
    )?)
}

/// `log(Σ exp(xᵢ))` of tensors of one shape, elementwise, stabilized by their maximum.
fn log_sum_exp(xs: &[Tensor]) -> Result<Tensor> {
    let mut max = xs[0].clone();
    for x in &xs[1..] {
        max = max.maximum(x)?;
    }
    let max = max.detach();
    let mut sum = xs[0].broadcast_sub(&max)?.exp()?;
    for x in &xs[1..] {
        sum = (sum + x.broadcast_sub(&max)?.exp()?)?;
    }
    Ok((sum.log()? + max)?)
}

impl CTCLoss {
    /// `-log p(labels | lp)` of one sequence, `lp` `[T, C]`.
    fn sequence_nll(&self, lp: &Tensor, labels: &[i64]) -> Result<Tensor> {
        // The labels with a blank before, between and after them.
        let blank = self.blank as u32;
        let mut extended = vec![blank];
        for &l in labels {
            extended.extend([l as u32, blank]);
        }
        let states = extended.len();
        let emit = lp
            .contiguous()?
            .index_select(&Tensor::new(extended.as_slice(), lp.device())?, 1)?;
        // A state may be entered from two back when it is a label other than the one two back.
        let skip: Vec<f32> = (0..states)
            .map(|s| {
                let allowed = s >= 2 && extended[s] != blank && extended[s] != extended[s - 2];
                if allowed {
                    0.0
                } else {
                    LOG_ZERO as f32
                }
            })
            .collect();
        let skip = Tensor::new(skip, lp.device())?.to_dtype(lp.dtype())?;
        let start: Vec<f32> = (0..states)
            .map(|s| if s < 2 { 0.0 } else { LOG_ZERO as f32 })
            .collect();
        let start = Tensor::new(start, lp.device())?.to_dtype(lp.dtype())?;
        let mut alpha = (emit.get(0)? + start)?;
        for t in 1..emit.dim(0)? {
            let from_two_back = (shift(&alpha, 2)? + &skip)?;
            let entered = log_sum_exp(&[alpha.clone(), shift(&alpha, 1)?, from_two_back])?;
            alpha = (entered + emit.get(t)?)?;
        }
        // The path ends in the last label or the blank after it.
        let mut ends = vec![alpha.get(states - 1)?];
        if states > 1 {
            ends.push(alpha.get(states - 2)?);
        }
        Ok(log_sum_exp(&ends)?.neg()?)
    }
}

impl Forward<(&Tensor, &Tensor, &Tensor, &Tensor)> for CTCLoss {
    type Output = Tensor;

    fn forward(
        &self,
        (log_probs, targets, input_lengths, target_lengths): (&Tensor, &Tensor, &Tensor, &Tensor),
    ) -> Result<Tensor> {
        const LAYER: &str = "CTCLoss";
        let (lp, unbatched) = batched(log_probs, 2, 1)?;
        let (frames, batch, classes) = match *lp.dims() {
            [t, n, c] if self.blank < c => (t, n, c),
            _ => {
                let expected = format!("[T, N, C] or [T, C] with C > blank = {}", self.blank);
                return Err(input_shape_error(LAYER, expected, log_probs));
            }
        };
        let integer = |t: &Tensor| !t.dtype().is_float();
        let lengths_shape: &[usize] = if unbatched { &[] } else { &[batch] };
        for lengths in [input_lengths, target_lengths] {
            if !integer(lengths) || lengths.dims() != lengths_shape {
                let expected = format!("{lengths_shape:?} integer lengths (one per sequence)");
                return Err(input_shape_error(LAYER, expected, lengths));
            }
        }
        let in_lens = host_ints(input_lengths)?;
        let tgt_lens = host_ints(target_lengths)?;
        let labels = host_ints(targets)?;
        // Padded `[N, S]` (or one `[S]` sequence when unbatched), or concatenated `[Σ lengths]`.
        let concatenated = !unbatched && targets.rank() == 1;
        let row = match *targets.dims() {
            [n, s] if !unbatched && n == batch => Some(s),
            [s] if unbatched => Some(s),
            _ => None,
        };
        let total: i64 = tgt_lens.iter().sum();
        let mut offset = 0usize;
        let mut losses = Vec::with_capacity(batch);
        for n in 0..batch {
            let (t_len, s_len) = (in_lens[n], tgt_lens[n]);
            let start = if concatenated {
                offset
            } else {
                n * row.unwrap_or(0)
            };
            let layout_ok = if concatenated {
                total >= 0 && total as usize == labels.len()
            } else {
                row.is_some_and(|row| s_len >= 0 && s_len as usize <= row)
            };
            let fits = integer(targets)
                && layout_ok
                && s_len >= 0
                && start + s_len as usize <= labels.len()
                && (0..=frames as i64).contains(&t_len);
            if !fits {
                let expected = format!(
                    "integer targets [N, S] or [sum of target_lengths] for sequence {n} of input \
                     length {t_len} (T = {frames}) and target length {s_len}"
                );
                return Err(input_shape_error(LAYER, expected, targets));
            }
            let seq = &labels[start..start + s_len as usize];
            offset += s_len as usize;
            if seq
                .iter()
                .any(|&l| l < 0 || l as usize >= classes || l as usize == self.blank)
            {
                let expected =
                    format!("labels in [0, {classes}) other than blank = {}", self.blank);
                return Err(input_shape_error(LAYER, expected, targets));
            }
            // Each label needs a frame, and a repeated label a blank frame between.
            let repeats = seq.windows(2).filter(|w| w[0] == w[1]).count();
            let loss = if t_len == 0 && seq.is_empty() {
                // No frames and no labels: the empty alignment, probability 1.
                Tensor::new(0f64, lp.device())?.to_dtype(lp.dtype())?
            } else if (t_len as usize) < seq.len() + repeats {
                let value = if self.zero_infinity {
                    0.0
                } else {
                    f64::INFINITY
                };
                Tensor::new(value, lp.device())?.to_dtype(lp.dtype())?
            } else {
                let frames_n = lp
                    .narrow(0, 0, t_len as usize)?
                    .narrow(1, n, 1)?
                    .squeeze(1)?;
                self.sequence_nll(&frames_n, seq)?
            };
            losses.push(match self.reduction {
                LossReduction::Mean => (loss / (s_len.max(1) as f64))?,
                _ => loss,
            });
        }
        let losses = Tensor::stack(&losses, 0)?;
        match self.reduction {
            LossReduction::None if unbatched => Ok(losses.squeeze(0)?),
            reduction => reduction.apply(losses),
        }
    }
}
