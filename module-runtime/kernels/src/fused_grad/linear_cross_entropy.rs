//! A language model's output projection and its cross-entropy as one op, by blocks of the
//! vocabulary: the `[positions, vocabulary]` logits are never whole, in the forward or the
//! backward (Liger's fused linear cross-entropy; PyTorch composes `linear` and `cross_entropy`).
//!
//! Composed, the logits stay in the graph for the loss's backward (96 MiB for 512 positions over
//! a 49152-word vocabulary), and candle's backward makes their gradient, a zero-filled buffer and
//! the sum of the two: four logits-sized tensors at once, the peak of a LoRA or QLoRA step with
//! checkpointing. Here the forward computes the logits a block of rows of the weight at a time and
//! keeps each position's log-sum-exp; the backward computes each block again and adds its share
//! of the hidden states' gradient (and, for a trained weight, writes the weight's gradient rows).

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use crate::error::{Error, Result};
use crate::fusion::is_fusion_enabled;
use crate::pool::{block_len, par_map};
use crate::vector_exp::{exp_vectorized, map_in_place};

/// Rows `start..start + len` of the output projection's weight, as a float32 `[len, hidden]` CPU
/// tensor (a view of a float weight, or a quantized weight's rows dequantized).
pub type WeightRows = Arc<dyn Fn(usize, usize) -> Result<Tensor> + Send + Sync>;

/// Rows of the weight computed at once: 4096 × 512 positions is 8 MiB of logits.
const BLOCK: usize = 4096;

/// The cross-entropy of `hidden · weightᵀ` (`[positions, hidden]` by a `[vocab, hidden]` weight
/// read through `rows`) against `targets` (one id per position, any integer dtype; `0` loss for
/// `ignore_index`), per position: PyTorch's `cross_entropy(linear(hidden, weight), targets,
/// ignore_index=ignore_index, reduction='none')` without the logits. The gradient flows to
/// `hidden`, and to `weight` when it is given (a trained weight: its `rows` must read it) and
/// records one.
///
/// `None` where it does not apply (fusion off, `hidden` not a float32 CPU matrix): compose
/// instead. A target outside `0..vocab`, or a count of targets other than `positions`, is
/// [`Error::InvalidInput`].
///
/// ```
/// use std::sync::Arc;
/// use module_runtime::candle_core::{Device, Tensor, Var};
/// let w = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 1.]], &Device::Cpu)?;
/// let h = Var::new(&[[0.5f32, -1.], [2., 0.]], &Device::Cpu)?;
/// let t = Tensor::new(&[2u32, 0], &Device::Cpu)?;
/// let rows = { let w = w.clone(); Arc::new(move |s, n| Ok(w.narrow(0, s, n)?)) };
/// let fused = module_kernels::linear_cross_entropy(h.as_tensor(), None, rows, 3, &t, -100)?.unwrap();
/// let logits = h.as_tensor().matmul(&w.t()?)?;
/// let composed = module_kernels::cross_entropy_rows(&logits, &t, -100)?.unwrap();
/// let d = (fused - composed)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(d < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: Option<&Tensor>,
    rows: WeightRows,
    vocab: usize,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Option<Tensor>> {
    let applies = is_fusion_enabled()
        && hidden.rank() == 2
        && hidden.dtype() == DType::F32
        && hidden.device().is_cpu()
        && vocab > 0;
    if !applies {
        return Ok(None);
    }
    let positions = hidden.dim(0)?;
    let targets = targets
        .flatten_all()?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?;
    if targets.len() != positions {
        return Err(invalid(format!(
            "{} target ids for hidden states {:?}: one per position expected",
            targets.len(),
            hidden.dims()
        )));
    }
    if let Some((row, id)) = targets
        .iter()
        .enumerate()
        .find(|(_, t)| **t != ignore_index && !(0..vocab as i64).contains(*t))
    {
        return Err(invalid(format!(
            "target {id} of position {row} is outside the {vocab} classes (0..{vocab})"
        )));
    }
    let op = LinearCrossEntropy {
        rows,
        vocab,
        targets,
        ignore_index,
        log_sum_exp: OnceLock::new(),
    };
    let hidden = hidden.contiguous()?;
    Ok(Some(match weight {
        Some(w) if w.track_op() => hidden.apply_op2(w, op)?,
        _ => hidden.apply_op1(op)?,
    }))
}

fn invalid(message: String) -> Error {
    Error::InvalidInput {
        layer: "linear_cross_entropy",
        message,
    }
}

struct LinearCrossEntropy {
    rows: WeightRows,
    vocab: usize,
    targets: Vec<i64>,
    ignore_index: i64,
    log_sum_exp: OnceLock<Vec<f32>>,
}

impl LinearCrossEntropy {
    fn target(&self, position: usize) -> Option<usize> {
        let t = self.targets[position];
        (t != self.ignore_index).then_some(t as usize)
    }

    /// Each block of the vocabulary in turn: its first row and its logits `[positions, len]`.
    fn blocks(
        &self,
        hidden: &Tensor,
        mut each: impl FnMut(usize, &Tensor, Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        for start in (0..self.vocab).step_by(BLOCK) {
            let len = BLOCK.min(self.vocab - start);
            let w = (self.rows)(start, len)?;
            let logits = hidden.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?;
            each(start, &w, logits)?;
        }
        Ok(())
    }

    /// The losses of `hidden` (a detached `[positions, hidden]` float32 tensor), keeping the
    /// log-sum-exps.
    fn forward(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        let positions = hidden.dim(0)?;
        let (mut max, mut sum) = (vec![f32::NEG_INFINITY; positions], vec![0f32; positions]);
        let mut picked = vec![0f32; positions];
        let level = crate::kernel_choice().elementwise;
        self.blocks(hidden, |start, _, mut logits| {
            let len = logits.len() / positions.max(1);
            // Per position: the block's max, then the running sum rescaled to the larger max.
            for (p, row) in logits.chunks_exact_mut(len).enumerate() {
                if let Some(t) = self.target(p).filter(|t| (start..start + len).contains(t)) {
                    picked[p] = row[t - start];
                }
                let m = row.iter().copied().fold(max[p], f32::max);
                row.iter_mut().for_each(|v| *v -= m);
                map_in_place(level, row, exp_vectorized);
                sum[p] = sum[p] * exp_vectorized(max[p] - m) + row.iter().sum::<f32>();
                max[p] = m;
            }
            Ok(())
        })?;
        let lse: Vec<f32> = max.iter().zip(&sum).map(|(m, s)| m + s.ln()).collect();
        let losses = (0..positions)
            .map(|p| self.target(p).map_or(0.0, |_| lse[p] - picked[p]))
            .collect();
        let _ = self.log_sum_exp.set(lse);
        Ok(losses)
    }

    /// The gradients of `hidden` and, with `weight_grad`, of the weight, for the losses'
    /// gradient `grad` (`[positions]`).
    fn backward(
        &self,
        hidden: &Tensor,
        grad: &[f32],
        weight_grad: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (positions, width) = hidden.dims2()?;
        let lse = self
            .log_sum_exp
            .get()
            .ok_or_else(|| invalid("the backward ran before the forward".to_owned()))?;
        let mut dh = Tensor::zeros((positions, width), DType::F32, hidden.device())?;
        let dw = match weight_grad {
            true => Some(Tensor::zeros(
                (self.vocab, width),
                DType::F32,
                hidden.device(),
            )?),
            false => None,
        };
        let level = crate::kernel_choice().elementwise;
        self.blocks(hidden, |start, w, mut logits| {
            let len = logits.len() / positions.max(1);
            // `g (softmax - onehot(target))` of each position's row of the block, in place.
            let rows = block_len(logits.len(), len);
            let jobs: Vec<(usize, &mut [f32])> = logits
                .chunks_mut(rows)
                .enumerate()
                .map(|(i, c)| (i * rows / len, c))
                .collect();
            par_map(jobs, |(first, chunk): (usize, &mut [f32])| {
                for (i, row) in chunk.chunks_exact_mut(len).enumerate() {
                    let p = first + i;
                    let g = if self.target(p).is_some() {
                        grad[p]
                    } else {
                        0.0
                    };
                    row.iter_mut().for_each(|v| *v -= lse[p]);
                    map_in_place(level, row, exp_vectorized);
                    row.iter_mut().for_each(|v| *v *= g);
                    if let Some(t) = self.target(p).filter(|t| (start..start + len).contains(t)) {
                        row[t - start] -= g;
                    }
                }
            });
            let p = Tensor::from_vec(logits, (positions, len), hidden.device())?;
            dh = (&dh + p.matmul(w)?)?;
            if let Some(dw) = &dw {
                dw.slice_set(&p.t()?.matmul(hidden)?, 0, start)?;
            }
            Ok(())
        })?;
        Ok((dh, dw))
    }
}

/// `grad` as a `Vec<f32>`.
fn grad_values(grad: &Tensor) -> candle_core::Result<Vec<f32>> {
    grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// The op's forward over the storage of `hidden`.
fn forward_storage(
    op: &LinearCrossEntropy,
    s: &CpuStorage,
    l: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let values = crate::cpu::f32_slice(s, l, "linear-cross-entropy")?.to_vec();
    let hidden = Tensor::from_vec(values, l.shape(), &candle_core::Device::Cpu)?;
    let losses = op.forward(&hidden).map_err(candle_core::Error::wrap)?;
    let n = losses.len();
    Ok((CpuStorage::F32(losses), Shape::from(n)))
}

impl candle_core::CustomOp1 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "linear-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        forward_storage(self, s, l)
    }

    fn bwd(&self, h: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (dh, _) = self
            .backward(&h.detach(), &grad_values(g)?, false)
            .map_err(candle_core::Error::wrap)?;
        Ok(Some(dh))
    }
}

impl candle_core::CustomOp2 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "linear-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        forward_storage(self, s, l)
    }

    fn bwd(
        &self,
        h: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dh, dw) = self
            .backward(&h.detach(), &grad_values(g)?, true)
            .map_err(candle_core::Error::wrap)?;
        Ok((Some(dh), dw))
    }
}
