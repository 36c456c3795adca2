//! `LinearCrossEntropyLoss`: a classifier head and its cross-entropy in one module, PyTorch's
//! `torch.nn` class of that name.

use candle_core::{Device, Tensor};

use crate::common::layer_forward;
use crate::error::{Error, Result};
use crate::linear_cross_entropy_fn::linear_cross_entropy;
use crate::loss_classification::cross_entropy;
use crate::loss_reduction::LossReduction;
use crate::{Buffer, Module, ModuleExt};
use crate::{Linear, LinearConfig};

/// How a [`LinearCrossEntropyLoss`] is built: PyTorch's keyword arguments, with PyTorch's
/// defaults. PyTorch's `options` (its chunked, memory-saving implementation) is not a setting
/// here: with class ids, the mean reduction and no class weights or smoothing, the loss always
/// takes the logits by blocks of the classes ([`linear_cross_entropy`](crate::loss::linear_cross_entropy)); otherwise they are
/// computed whole.
#[derive(Clone, Debug)]
pub struct LinearCrossEntropyConfig {
    /// Extra output dimensions `(d1, …, dK)` for a K-dimensional loss (default none).
    pub out_features: Vec<usize>,
    /// Whether the linear layer has a bias (PyTorch's default `false`).
    pub bias: bool,
    /// How the per-sample losses are reduced (default: mean).
    pub reduction: LossReduction,
    /// A weight per class `[C]` (default `None`). Becomes the buffer `weight`.
    pub weight: Option<Tensor>,
    /// Targets with this class id add nothing (default `None`: none is ignored).
    pub ignore_index: Option<i64>,
    /// The share of the target spread uniformly over the classes, in `[0, 1]` (default 0.0).
    pub label_smoothing: f64,
}

impl Default for LinearCrossEntropyConfig {
    fn default() -> Self {
        Self {
            out_features: Vec::new(),
            bias: false,
            reduction: LossReduction::Mean,
            weight: None,
            ignore_index: None,
            label_smoothing: 0.0,
        }
    }
}

/// The cross-entropy of `linear(input)` and the target: PyTorch's
/// `nn.LinearCrossEntropyLoss(in_features, num_classes, *, out_features=(), bias=False,
/// reduction='mean', weight=None, ignore_index=None, label_smoothing=0.0)`.
///
/// Its state is PyTorch's: the parameter `linear.weight` `[C · d1 ⋯ dK, in_features]` (and
/// `linear.bias`), and the buffer `weight` when class weights are given. The input is
/// `[N, in_features]`; the target `[N, d1, …, dK]` class ids or `[N, C, d1, …, dK]`
/// probabilities, as for [`CrossEntropyLoss`](crate::CrossEntropyLoss).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LinearCrossEntropyLoss;
/// let head = LinearCrossEntropyLoss::new(4, 3, &Device::Cpu)?;
/// assert_eq!(head.named_parameters()[0].0, "linear.weight");
/// let x = Tensor::randn(0f32, 1., (2, 4), &Device::Cpu)?;
/// let loss = head.call((&x, &Tensor::new(&[0i64, 2], &Device::Cpu)?))?;
/// assert_eq!(loss.dims(), [0usize; 0]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`LinearCrossEntropyLossPath`], from [`LinearCrossEntropyLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct LinearCrossEntropyLoss {
    /// The class weights `[C]`, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// The classifier: `in_features` to `C · d1 ⋯ dK` logits.
    pub linear: Linear,
    /// `C`.
    pub num_classes: usize,
    /// `(d1, …, dK)`.
    #[module(skip)]
    pub out_features: Vec<usize>,
    /// The class id whose targets are ignored, if any.
    #[module(skip)]
    pub ignore_index: Option<i64>,
    /// The share of the target spread uniformly over the classes.
    pub label_smoothing: f64,
    /// How the per-sample losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl LinearCrossEntropyLoss {
    /// PyTorch's defaults, with a float32 linear layer initialized as `nn.Linear` is.
    pub fn new(in_features: usize, num_classes: usize, device: &Device) -> Result<Self> {
        Self::with_config(
            in_features,
            num_classes,
            LinearCrossEntropyConfig::default(),
            device,
        )
    }

    /// Built as `config` says. Class weights of another shape than `[num_classes]`, or a
    /// `label_smoothing` outside `[0, 1]`, are an [`Error::InvalidConfig`], as PyTorch raises.
    pub fn with_config(
        in_features: usize,
        num_classes: usize,
        config: LinearCrossEntropyConfig,
        device: &Device,
    ) -> Result<Self> {
        let invalid = |message: String| Error::InvalidConfig {
            layer: "LinearCrossEntropyLoss",
            message,
        };
        if let Some(w) = &config.weight
            && w.dims() != [num_classes]
        {
            return Err(invalid(format!(
                "expected weight shape to be [{num_classes}], got {:?}",
                w.dims()
            )));
        }
        if !(0.0..=1.0).contains(&config.label_smoothing) {
            return Err(invalid(format!(
                "expected label_smoothing to be in range [0, 1], got {}",
                config.label_smoothing
            )));
        }
        let outputs = num_classes * config.out_features.iter().product::<usize>();
        let linear_config = LinearConfig {
            bias: config.bias,
            ..Default::default()
        };
        let weight = match config.weight {
            Some(w) => Some(Buffer::new(w.to_device(device)?)),
            None => None,
        };
        Ok(Self {
            weight,
            linear: Linear::with_config(in_features, outputs, linear_config, device)?,
            num_classes,
            out_features: config.out_features,
            ignore_index: config.ignore_index,
            label_smoothing: config.label_smoothing,
            reduction: config.reduction,
        })
    }
}

layer_forward!(LinearCrossEntropyLoss, |layer, (input, target)| {
    // No ignore_index: no class id is below zero, so i64::MIN never matches one.
    let ignore = layer.ignore_index.unwrap_or(i64::MIN);
    // Class ids, mean reduction, no class weights or smoothing: the logits by blocks.
    let blockwise = layer.out_features.is_empty()
        && layer.weight.is_none()
        && layer.label_smoothing == 0.0
        && layer.reduction == LossReduction::Mean
        && target.dtype().is_int()
        && input.rank() >= 1
        && target.dims() == &input.dims()[..input.rank() - 1];
    if blockwise {
        return linear_cross_entropy(input, &layer.linear, target, ignore);
    }
    let logits = layer.linear.call(input)?;
    // Rows of the weight are (class, d1, …, dK) flattened: unflatten the logits the same way.
    let logits = if layer.out_features.is_empty() {
        logits
    } else {
        let lead = &logits.dims()[..logits.rank() - 1];
        let dims: Vec<usize> = [lead, &[layer.num_classes], &layer.out_features].concat();
        logits.reshape(dims)?
    };
    let options = (ignore, layer.reduction, layer.label_smoothing);
    cross_entropy(
        "LinearCrossEntropyLoss",
        &logits,
        target,
        &layer.weight,
        options,
    )
});
