//! The cross-entropy of logits against class ids as one op: each row's loss
//! `logsumexp(x) - x[target]` in one pass, and a backward that writes the logits' gradient
//! `g (softmax(x) - onehot(target))` in one pass.
//!
//! Composed (a log-softmax, then a gather), the loss of a language model's head over its whole
//! vocabulary (`[positions, 49152]`) leaves five tensors of the logits' size in the graph (the
//! shifted logits, their exponentials, the log-probabilities, …), and candle's backward makes
//! about as many again, each a fresh zero-filled buffer and a sum: on the SmolLM-135M-shaped
//! training step that was gigabytes of peak memory and several passes over 100 MB per step. Here
//! the forward keeps one float per row (the log-sum-exp) and the backward makes one tensor, the
//! gradient itself. PyTorch's `cross_entropy` is the same two kernels (`log_softmax` and
//! `nll_loss`), with the log-probabilities kept between them.

use std::sync::OnceLock;

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::cpu::f32_slice;
use crate::error::{Error, Result};
use crate::fused_grad::with_f32;
use crate::fusion::is_fusion_enabled;
use crate::pool::{block_len, par_map};
use crate::vector_exp::{exp_vectorized, map_in_place};

/// The cross-entropy of each row of `logits` `[rows, classes]` against its class id in `targets`
/// (`rows` ids, any integer dtype), `0` for a row whose id is `ignore_index`: a `[rows]` float32
/// tensor whose gradient flows back to `logits` in one pass (the softmax less the target's one-hot,
/// times the row's incoming gradient). PyTorch's `cross_entropy(logits, targets,
/// ignore_index=ignore_index, reduction='none')`.
///
/// `None` where it does not apply: fusion is off ([`without_fusion`](crate::without_fusion)),
/// or `logits` is not a float32 CPU matrix; the caller composes the loss instead. An id outside
/// `0..classes` (other than `ignore_index`), or a count of ids other than `rows`, is an
/// [`Error::InvalidInput`] naming it.
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor, Var};
/// let logits = Var::new(&[[0f32, 0.], [1., 3.]], &Device::Cpu)?;
/// let targets = Tensor::new(&[1i64, -100], &Device::Cpu)?;
/// let losses = module_kernels::cross_entropy_rows(logits.as_tensor(), &targets, -100)?.unwrap();
/// let got = losses.to_vec1::<f32>()?;
/// assert!((got[0] - 2f32.ln()).abs() < 1e-6 && got[1] == 0.);
/// let grad = losses.sum_all()?.backward()?.get(&logits).unwrap().to_vec2::<f32>()?;
/// assert!((grad[0][0] - 0.5).abs() < 1e-6 && (grad[0][1] + 0.5).abs() < 1e-6);
/// assert_eq!(grad[1], [0., 0.]); // the ignored row
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn cross_entropy_rows(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Option<Tensor>> {
    let applies = is_fusion_enabled()
        && logits.rank() == 2
        && logits.dtype() == DType::F32
        && logits.device().is_cpu()
        && logits.dim(1)? > 0;
    if !applies {
        return Ok(None);
    }
    let (rows, classes) = logits.dims2()?;
    let targets = targets
        .flatten_all()?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?;
    if targets.len() != rows {
        return Err(invalid(format!(
            "{} target ids for logits {:?}: one per row expected",
            targets.len(),
            logits.dims()
        )));
    }
    if let Some((row, id)) = targets
        .iter()
        .enumerate()
        .find(|(_, t)| **t != ignore_index && !(0..classes as i64).contains(*t))
    {
        return Err(invalid(format!(
            "target {id} of row {row} is outside the {classes} classes (0..{classes})"
        )));
    }
    let op = CrossEntropyRows {
        targets,
        ignore_index,
        classes,
        log_sum_exp: OnceLock::new(),
    };
    Ok(Some(logits.contiguous()?.apply_op1(op)?))
}

/// [`cross_entropy_rows`]'s error for bad targets.
fn invalid(message: String) -> Error {
    Error::InvalidInput {
        layer: "cross_entropy",
        message,
    }
}

/// The candle op of [`cross_entropy_rows`]: the checked target ids, and each row's log-sum-exp,
/// kept by the forward for the backward.
struct CrossEntropyRows {
    targets: Vec<i64>,
    ignore_index: i64,
    classes: usize,
    log_sum_exp: OnceLock<Vec<f32>>,
}

impl CrossEntropyRows {
    /// The class of row `row`, or `None` for an ignored row.
    fn target(&self, row: usize) -> Option<usize> {
        let t = self.targets[row];
        (t != self.ignore_index).then_some(t as usize)
    }
}

impl candle_core::CustomOp1 for CrossEntropyRows {
    fn name(&self) -> &'static str {
        "cross-entropy-fused"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(x, layout, self.name())?;
        let width = self.classes;
        let level = crate::kernel_choice().elementwise;
        // Each row's log-sum-exp, `max + ln Σ exp(x - max)`, the exponentials in a scratch row.
        let jobs = x.chunks(block_len(x.len(), width)).collect();
        let parts = par_map(jobs, |x: &[f32]| {
            let mut scratch = vec![0f32; width];
            x.chunks_exact(width)
                .map(|row| {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    scratch.iter_mut().zip(row).for_each(|(s, &v)| *s = v - max);
                    map_in_place(level, &mut scratch, exp_vectorized);
                    max + scratch.iter().sum::<f32>().ln()
                })
                .collect::<Vec<f32>>()
        });
        let log_sum_exp: Vec<f32> = parts.into_iter().flatten().collect();
        let losses = log_sum_exp
            .iter()
            .enumerate()
            .map(|(row, &lse)| match self.target(row) {
                Some(t) => lse - x[row * width + t],
                None => 0.0,
            })
            .collect();
        let rows = log_sum_exp.len();
        // A second forward of the same op (never done: each call makes its own) keeps the first's.
        let _ = self.log_sum_exp.set(log_sum_exp);
        Ok((CpuStorage::F32(losses), Shape::from(rows)))
    }

    /// `dx = g (exp(x - lse) - onehot(target))` per row, zero for ignored rows.
    fn bwd(
        &self,
        x: &Tensor,
        _losses: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let lse = self
            .log_sum_exp
            .get()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: no forward", self.name())))?;
        let width = self.classes;
        let grad = grad.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let level = crate::kernel_choice().elementwise;
        let dx = with_f32([x], self.name(), |[x]| {
            let mut dx = vec![0f32; x.len()];
            let block = block_len(x.len(), width);
            let jobs: Vec<_> = dx
                .chunks_mut(block)
                .zip(x.chunks(block))
                .enumerate()
                .collect();
            par_map(jobs, |(i, (dx, x))| {
                let first = i * block / width;
                let rows = dx.chunks_exact_mut(width).zip(x.chunks_exact(width));
                for (row, (dx, x)) in (first..).zip(rows) {
                    let Some(t) = self.target(row) else { continue };
                    let (g, lse) = (grad[row], lse[row]);
                    dx.iter_mut().zip(x).for_each(|(d, &v)| *d = v - lse);
                    map_in_place(level, dx, exp_vectorized);
                    dx.iter_mut().for_each(|d| *d *= g);
                    dx[t] -= g;
                }
            });
            dx
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}
