//! `linear_cross_entropy`: a language model's head and its loss without the logits (PyTorch's
//! `F.linear_cross_entropy`).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use module_core::autocast::active_dtype;
use module_core::autocast::DeviceType;

use crate::error::Result;
use crate::loss_reduction::LossReduction;
use crate::{ClassLossConfig, CrossEntropyLoss, Linear, ModuleExt};

/// The mean cross-entropy of `head(input)` against `target`, over the positions whose target is
/// not `ignore_index`: PyTorch's `F.linear_cross_entropy(input, head.weight, target,
/// ignore_index=ignore_index)` (mean reduction), a causal language model's
/// `model(ids, labels=labels).loss` once the labels are shifted. `input` is `[..., in_features]`
/// and `target` the matching `[...]` class ids.
///
/// For a plain head (no bias, adapter or parametrization; float32 or quantized weight, on the
/// CPU, outside `autocast`) the logits are never made whole: they are computed by blocks of the
/// vocabulary in the forward, keeping each position's log-sum-exp, and again in the backward, so
/// the step never holds the `[positions, vocabulary]` logits, their gradient or candle's
/// zero-filled sum of it (on a 512-position, 49152-word step: ~380 MiB less at the peak). A
/// quantized head is read a block of rows at a time. The gradient reaches `input` and a trained
/// head's weight. Otherwise the head is called and the loss composed (the same values within
/// float32 rounding).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::loss::linear_cross_entropy;
/// use module_runtime::nn::{ClassLossConfig, CrossEntropyLoss};
/// let head = Linear::no_bias(4, 10, &Device::Cpu)?;
/// let x = Tensor::randn(0f32, 1., (2, 3, 4), &Device::Cpu)?;
/// let labels = Tensor::new(&[[1i64, 2, -100], [9, 0, 3]], &Device::Cpu)?;
/// let fused = linear_cross_entropy(&x, &head, &labels, -100)?;
/// let logits = head.call(&x)?.reshape((6, 10))?;
/// let composed = CrossEntropyLoss::with_config(
///     ClassLossConfig { ignore_index: -100, ..Default::default() }, &Device::Cpu)?
///     .call((&logits, &labels.flatten_all()?))?;
/// let d = (&fused - &composed)?.abs()?.to_scalar::<f32>()?;
/// assert!(d < 1e-5);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn linear_cross_entropy(
    input: &Tensor,
    head: &Linear,
    target: &Tensor,
    ignore_index: i64,
) -> Result<Tensor> {
    let width = input.dim(candle_core::D::Minus1)?;
    let hidden = input.reshape(((), width))?;
    let target = target.flatten_all()?;
    if let Some(losses) = fused(&hidden, head, &target, ignore_index)? {
        let counted: Vec<i64> = target.to_dtype(DType::I64)?.to_vec1()?;
        let n = counted.iter().filter(|&&t| t != ignore_index).count();
        // PyTorch's mean over the counted positions (NaN when there are none).
        return Ok((losses.sum_all()? / n as f64)?);
    }
    let logits = head.call(&hidden)?;
    let config = ClassLossConfig {
        reduction: LossReduction::Mean,
        ignore_index,
        ..Default::default()
    };
    CrossEntropyLoss::with_config(config, &Device::Cpu)?.call((&logits, &target))
}

/// The per-position losses by blocks of the vocabulary, or `None` where the head is not plain.
fn fused(hidden: &Tensor, head: &Linear, target: &Tensor, ignore: i64) -> Result<Option<Tensor>> {
    let plain = head.bias.is_none()
        && head.lora.is_none()
        && head.modules_to_save.is_none()
        && head.parametrizations.is_none()
        && head.reduce.is_none()
        && head.weight.device().is_cpu()
        && active_dtype(DeviceType::Cpu).is_none();
    if !plain {
        return Ok(None);
    }
    let (vocab, _) = head.weight.shape().dims2()?;
    let (weight, rows): (Option<Tensor>, module_kernels::WeightRows) = if head.weight.is_quantized()
    {
        let param = head.weight.clone();
        let rows = Arc::new(move |start: usize, len: usize| {
            let picked: Vec<usize> = (start..start + len).collect();
            let q = param.quantized_rows(&picked)?.ok_or_else(|| {
                candle_core::Error::Msg("the head's weight is no longer quantized".to_owned())
            })?;
            Ok(q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
        });
        (None, rows)
    } else {
        let weight = head.weight.tensor()?;
        if weight.dtype() != DType::F32 {
            return Ok(None);
        }
        let values = weight.detach();
        let rows = Arc::new(move |start: usize, len: usize| Ok(values.narrow(0, start, len)?));
        (Some(weight), rows)
    };
    module_kernels::linear_cross_entropy(hidden, weight.as_ref(), rows, vocab, target, ignore)
}
