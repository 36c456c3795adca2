//! Classification losses as modules: `CrossEntropyLoss`, `NLLLoss`, `BCELoss` and
//! `BCEWithLogitsLoss`, PyTorch's `torch.nn` classes of those names with their options (`weight`,
//! `ignore_index`, `label_smoothing`, `pos_weight`, `reduction`).
//!
//! Class weights and `pos_weight` are buffers named as in PyTorch's state dicts (`weight`,
//! `pos_weight`), so a loss saved with a model loads back with it. The means over samples with
//! class weights divide by the sum of the weights used, as PyTorch does.

use candle_core::{DType, Device, Tensor};

use module_core::autocast_policy::{autocast_cast, AutocastOp};

use crate::activation::log_softmax;
use crate::activation_smooth::softplus;
use crate::common::{input_shape_error, layer_forward};
use crate::error::Result;
use crate::loss_reduction::{check_same_shape, weighted_loss_constructors, LossReduction};
use crate::{Buffer, Module};

/// The options [`CrossEntropyLoss`] and [`NLLLoss`] share: PyTorch's keyword arguments, with
/// PyTorch's defaults.
#[derive(Clone, Debug)]
pub struct ClassLossConfig {
    /// A weight per class `[C]` (default `None`: all 1). Becomes the buffer `weight`.
    pub weight: Option<Tensor>,
    /// Targets with this class id add nothing to the loss or its mean (default -100). Class-id
    /// targets only.
    pub ignore_index: i64,
    /// How the per-sample losses are reduced (default: mean, weighted by the target's class
    /// weights).
    pub reduction: LossReduction,
    /// `CrossEntropyLoss` only: the share `ε` of the target moved to a uniform distribution over
    /// the classes (default 0.0).
    pub label_smoothing: f64,
}

impl Default for ClassLossConfig {
    fn default() -> Self {
        Self {
            weight: None,
            ignore_index: -100,
            reduction: LossReduction::Mean,
            label_smoothing: 0.0,
        }
    }
}

/// Log-probabilities `[N, C, d…]` (or `[C]`) as `[M, C]` rows, and the shape of one loss per row
/// (`[N, d…]`, or `[]`).
fn rows(layer: &'static str, log_p: &Tensor) -> Result<(Tensor, Vec<usize>)> {
    let dims = log_p.dims();
    match dims.len() {
        0 => Err(input_shape_error(
            layer,
            "[N, C], [N, C, d1, ...] or [C]",
            log_p,
        )),
        1 => Ok((log_p.unsqueeze(0)?, vec![])),
        2 => Ok((log_p.clone(), vec![dims[0]])),
        rank => {
            // Classes last, so each row is one position's class scores.
            let order: Vec<usize> = (0..rank).filter(|&d| d != 1).chain([1]).collect();
            let moved = log_p.permute(order)?.contiguous()?;
            let per_row: Vec<usize> = [&dims[..1], &dims[2..]].concat();
            Ok((moved.reshape(((), dims[1]))?, per_row))
        }
    }
}

/// A config's class weights as a buffer on `device`.
fn weight_buffer(weight: Option<Tensor>, device: &Device) -> Result<Option<Buffer>> {
    weight
        .map(|w| Ok(Buffer::new(w.to_device(device)?)))
        .transpose()
}

/// The class weights as a `[C]` tensor of `like`'s dtype, checked against the class count.
fn class_weights(
    layer: &'static str,
    weight: &Option<Buffer>,
    classes: usize,
    input: &Tensor,
) -> Result<Option<Tensor>> {
    let Some(w) = weight else { return Ok(None) };
    let w = w.tensor()?;
    if w.dims() != [classes] {
        let expected = format!(
            "[*, {}, *] (one class per entry of weight {:?})",
            w.elem_count(),
            w.dims()
        );
        return Err(input_shape_error(layer, expected, input));
    }
    Ok(Some(w.to_dtype(input.dtype())?))
}

/// The negative log-likelihood of class-id targets, with PyTorch's weights, `ignore_index`,
/// label smoothing and reduction (ATen's `cross_entropy_loss_label_smoothing` and `nll_loss_nd`).
fn nll(
    layer: &'static str,
    log_p: &Tensor,
    target: &Tensor,
    weight: Option<Tensor>,
    config: (i64, LossReduction, f64),
) -> Result<Tensor> {
    let (ignore_index, reduction, smoothing) = config;
    let (rows, per_row) = rows(layer, log_p)?;
    let classes = rows.dim(1)?;
    if target.dtype().is_float() || target.dims() != per_row.as_slice() {
        let expected = format!(
            "{per_row:?} integer class ids (u8, u32 or i64) for the input {:?}",
            log_p.dims()
        );
        return Err(input_shape_error(layer, expected, target));
    }
    let ids = target.flatten_all()?.to_dtype(DType::I64)?;
    let valid = ids.ne(ignore_index)?;
    let safe_ids = valid.where_cond(&ids, &ids.zeros_like()?)?;
    let valid = valid.to_dtype(rows.dtype())?;
    let picked = rows
        .contiguous()?
        .gather(&safe_ids.unsqueeze(1)?, 1)?
        .squeeze(1)?;
    let used = match &weight {
        Some(w) => (w.contiguous()?.index_select(&safe_ids, 0)? * &valid)?,
        None => valid.clone(),
    };
    let mut loss = (picked * &used)?.neg()?;
    if smoothing > 0.0 {
        let weighted = match &weight {
            Some(w) => rows.broadcast_mul(&w.unsqueeze(0)?)?,
            None => rows.clone(),
        };
        let smooth = (weighted.sum(1)?.neg()? * &valid)?;
        loss = (loss.affine(1.0 - smoothing, 0.0)?
            + smooth.affine(smoothing / classes as f64, 0.0)?)?;
    }
    Ok(match reduction {
        LossReduction::None => loss.reshape(per_row)?,
        LossReduction::Sum => loss.sum_all()?,
        LossReduction::Mean => (loss.sum_all()? / used.sum_all()?)?,
    })
}

/// The cross-entropy between logits and targets: PyTorch's `nn.CrossEntropyLoss(weight=None,
/// ignore_index=-100, reduction='mean', label_smoothing=0.0)`.
///
/// The input is logits `[N, C]`, `[N, C, d1, …]` or `[C]`. The target is either class ids of the
/// input's shape without `C` (`u8`, `u32` or `i64`), or class probabilities of the input's shape
/// (floating point; `ignore_index` does not apply, and the mean is over samples). Another shape is
/// an [`Error::InputShape`](crate::Error::InputShape) naming both. Differentiable with respect to
/// the logits (and to probability targets).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{ClassLossConfig, CrossEntropyLoss};
/// let logits = Tensor::new(&[[0f32, 0.], [0., 0.]], &Device::Cpu)?;
/// let target = Tensor::new(&[0i64, 1], &Device::Cpu)?;
/// let loss = CrossEntropyLoss::new().call((&logits, &target))?.to_scalar::<f32>()?;
/// assert!((loss - 2f32.ln()).abs() < 1e-6);
/// let ignoring = CrossEntropyLoss::with_config(
///     ClassLossConfig { ignore_index: 1, label_smoothing: 0.1, ..Default::default() },
///     &Device::Cpu,
/// )?;
/// assert!(ignoring.call((&logits, &target))?.to_scalar::<f32>()? > 0.);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`CrossEntropyLossPath`], from [`CrossEntropyLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct CrossEntropyLoss {
    /// The class weights `[C]`, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// The class id whose targets are ignored.
    pub ignore_index: i64,
    /// How the per-sample losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
    /// The share of the target spread uniformly over the classes.
    pub label_smoothing: f64,
}

impl Default for CrossEntropyLoss {
    fn default() -> Self {
        Self::with_config(ClassLossConfig::default(), &Device::Cpu)
            .expect("no class weights to move")
    }
}

impl CrossEntropyLoss {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Built as `config` says; the weights are moved to `device`.
    pub fn with_config(config: ClassLossConfig, device: &Device) -> Result<Self> {
        Ok(Self {
            weight: weight_buffer(config.weight, device)?,
            ignore_index: config.ignore_index,
            reduction: config.reduction,
            label_smoothing: config.label_smoothing,
        })
    }
}

layer_forward!(CrossEntropyLoss, |layer, (input, target)| {
    let options = (layer.ignore_index, layer.reduction, layer.label_smoothing);
    cross_entropy("CrossEntropyLoss", input, target, &layer.weight, options)
});

/// [`CrossEntropyLoss`]'s computation, for `layer`: class-id or probability targets, with the
/// class weights and `(ignore_index, reduction, label_smoothing)`.
pub(crate) fn cross_entropy(
    layer: &'static str,
    input: &Tensor,
    target: &Tensor,
    weight: &Option<Buffer>,
    (ignore_index, reduction, smoothing): (i64, LossReduction, f64),
) -> Result<Tensor> {
    // A float32 op under autocast, both lists.
    let [input, target] = autocast_cast(AutocastOp::Loss, [input, target])?;
    let (input, target) = (&input, &target);
    let class_dim = usize::from(input.rank() > 1);
    let classes = input.dims().get(class_dim).copied().unwrap_or(0);
    let weight = class_weights(layer, weight, classes, input)?;
    if let Some(loss) =
        fused_cross_entropy(input, target, &weight, (ignore_index, reduction, smoothing))?
    {
        return Ok(loss);
    }
    let log_p = log_softmax(input, class_dim)?;
    if !target.dtype().is_float() {
        return nll(
            layer,
            &log_p,
            target,
            weight,
            (ignore_index, reduction, smoothing),
        );
    }
    // Probabilities (ATen's `cross_entropy_loss_prob_target`).
    check_same_shape(
        layer,
        target,
        input,
        "probability targets (the input's shape)",
    )?;
    let target = if smoothing > 0.0 {
        target.affine(1.0 - smoothing, smoothing / classes as f64)?
    } else {
        target.clone()
    };
    let mut terms = (log_p * target)?;
    if let Some(w) = weight {
        let mut dims = vec![1; input.rank()];
        dims[class_dim] = classes;
        terms = terms.broadcast_mul(&w.reshape(dims)?)?;
    }
    reduction.apply(terms.sum(class_dim)?.neg()?)
}

/// The cross-entropy of logits `[N, C]` against `N` class ids without class weights or label
/// smoothing as one fused op ([`module_kernels::cross_entropy_rows`]: a one-pass backward, no
/// log-probabilities kept), where it applies (float32 CPU logits, fusion on); `None` elsewhere,
/// for the composed path. The same reductions as [`nll`]: the mean is over the targets that are
/// not `ignore_index` (NaN when there is none, as in PyTorch).
fn fused_cross_entropy(
    input: &Tensor,
    target: &Tensor,
    weight: &Option<Tensor>,
    (ignore_index, reduction, smoothing): (i64, LossReduction, f64),
) -> Result<Option<Tensor>> {
    let plain = weight.is_none()
        && smoothing == 0.0
        && input.rank() == 2
        && !target.dtype().is_float()
        && target.dims() == [input.dim(0)?];
    if !plain {
        return Ok(None);
    }
    let Some(losses) = module_kernels::cross_entropy_rows(input, target, ignore_index)? else {
        return Ok(None);
    };
    Ok(Some(match reduction {
        LossReduction::None => losses,
        LossReduction::Sum => losses.sum_all()?,
        LossReduction::Mean => {
            let used = target
                .to_dtype(DType::I64)?
                .ne(ignore_index)?
                .to_dtype(DType::F32)?
                .sum_all()?;
            (losses.sum_all()? / used)?
        }
    }))
}

/// The negative log-likelihood of class ids under log-probabilities: PyTorch's
/// `nn.NLLLoss(weight=None, ignore_index=-100, reduction='mean')`. The input is log-probabilities
/// `[N, C]`, `[N, C, d1, …]` or `[C]`; the target class ids (`u8`, `u32` or `i64`) of its shape
/// without `C`. [`CrossEntropyLoss`] is this after a log-softmax.
///
/// Typed paths into it: [`NLLLossPath`], from [`NLLLoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct NLLLoss {
    /// The class weights `[C]`, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// The class id whose targets are ignored.
    pub ignore_index: i64,
    /// How the per-sample losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for NLLLoss {
    fn default() -> Self {
        Self {
            weight: None,
            ignore_index: -100,
            reduction: LossReduction::Mean,
        }
    }
}

impl NLLLoss {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Built as `config` says (its `label_smoothing` must be 0, which NLLLoss does not take);
    /// the weights are moved to `device`.
    pub fn with_config(config: ClassLossConfig, device: &Device) -> Result<Self> {
        if config.label_smoothing != 0.0 {
            return Err(crate::Error::InvalidConfig {
                layer: "NLLLoss",
                message: format!(
                    "label_smoothing is a CrossEntropyLoss option, got {}",
                    config.label_smoothing
                ),
            });
        }
        Ok(Self {
            weight: weight_buffer(config.weight, device)?,
            ignore_index: config.ignore_index,
            reduction: config.reduction,
        })
    }
}

layer_forward!(NLLLoss, |layer, (input, target)| {
    let [input, target] = autocast_cast(AutocastOp::Loss, [input, target])?;
    let (input, target) = (&input, &target);
    let class_dim = usize::from(input.rank() > 1);
    let classes = input.dims().get(class_dim).copied().unwrap_or(0);
    let weight = class_weights("NLLLoss", &layer.weight, classes, input)?;
    nll(
        "NLLLoss",
        input,
        target,
        weight,
        (layer.ignore_index, layer.reduction, 0.0),
    )
});

/// An optional buffer's value, broadcast to `like`'s shape and dtype (PyTorch broadcasts the
/// `weight` of the binary losses and `pos_weight` along the last dimensions).
fn broadcast_buffer(
    layer: &'static str,
    b: &Option<Buffer>,
    like: &Tensor,
) -> Result<Option<Tensor>> {
    let Some(b) = b else { return Ok(None) };
    let value = b.tensor()?.to_dtype(like.dtype())?;
    match value.broadcast_as(like.shape()) {
        Ok(v) => Ok(Some(v)),
        Err(_) => {
            let expected = format!("a shape the weight {:?} broadcasts to", value.dims());
            Err(input_shape_error(layer, expected, like))
        }
    }
}

/// `-weight · (t log x + (1 - t) log(1 - x))` of probabilities `x` and targets `t` of one shape,
/// with the logs clamped at -100 as PyTorch does: PyTorch's `nn.BCELoss(weight=None,
/// reduction='mean')`. The input must hold probabilities in `[0, 1]` (PyTorch checks; this does
/// not read the values back); prefer [`BCEWithLogitsLoss`], which is stable.
///
/// Typed paths into it: [`BCELossPath`], from [`BCELoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct BCELoss {
    /// A weight broadcast over the elements, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// How the per-element losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

weighted_loss_constructors!(BCELoss, "broadcast to the input");

layer_forward!(BCELoss, |layer, (input, target)| {
    let [input, target] = autocast_cast(AutocastOp::Loss, [input, target])?;
    let (input, target) = (&input, &target);
    check_same_shape("BCELoss", target, input, "the target (the input's shape)")?;
    let log_x = input.log()?.maximum(-100f64)?;
    let log_1mx = input.affine(-1.0, 1.0)?.log()?.maximum(-100f64)?;
    let one_minus_t = target.affine(-1.0, 1.0)?;
    let mut loss = ((target * log_x)? + (one_minus_t * log_1mx)?)?.neg()?;
    if let Some(w) = broadcast_buffer("BCELoss", &layer.weight, input)? {
        loss = (loss * w)?;
    }
    layer.reduction.apply(loss)
});

/// `BCELoss(σ(x), t)` computed stably from logits, with an optional weight of the positive class:
/// `(1 - t) x - (1 + (pos_weight - 1) t) log σ(x)`, times `weight`. PyTorch's
/// `nn.BCEWithLogitsLoss(weight=None, reduction='mean', pos_weight=None)`. Differentiable with
/// respect to the logits and the target.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{BCEWithLogitsLoss, LossReduction};
/// let logits = Tensor::new(&[0f32, 100.], &Device::Cpu)?;
/// let target = Tensor::new(&[1f32, 1.], &Device::Cpu)?;
/// let loss = BCEWithLogitsLoss::with_config(None, None, LossReduction::None)
///     .call((&logits, &target))?
///     .to_vec1::<f32>()?;
/// assert!((loss[0] - 2f32.ln()).abs() < 1e-6 && loss[1] == 0.);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`BCEWithLogitsLossPath`], from [`BCEWithLogitsLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct BCEWithLogitsLoss {
    /// A weight broadcast over the elements, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// The weight of positive targets, broadcast along the last dimensions (one per class,
    /// `[C]`), if any (a buffer, as in PyTorch).
    pub pos_weight: Option<Buffer>,
    /// How the per-element losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl BCEWithLogitsLoss {
    /// PyTorch's defaults: no weights, mean.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `weight`, `pos_weight` and `reduction`.
    pub fn with_config(
        weight: Option<Tensor>,
        pos_weight: Option<Tensor>,
        reduction: LossReduction,
    ) -> Self {
        Self {
            weight: weight.map(Buffer::new),
            pos_weight: pos_weight.map(Buffer::new),
            reduction,
        }
    }
}

layer_forward!(BCEWithLogitsLoss, |layer, (input, target)| {
    let [input, target] = autocast_cast(AutocastOp::Loss, [input, target])?;
    let (input, target) = (&input, &target);
    const LAYER: &str = "BCEWithLogitsLoss";
    check_same_shape(LAYER, target, input, "the target (the input's shape)")?;
    // log σ(x) = -softplus(-x), stable for any x.
    let mut log_sigmoid = softplus(&input.neg()?, 1.0, 20.0)?.neg()?;
    if let Some(pw) = broadcast_buffer(LAYER, &layer.pos_weight, input)? {
        let log_weight = ((pw - 1.0)? * target)?.affine(1.0, 1.0)?;
        log_sigmoid = (log_sigmoid * log_weight)?;
    }
    let mut loss = ((target.affine(-1.0, 1.0)? * input)? - log_sigmoid)?;
    if let Some(w) = broadcast_buffer(LAYER, &layer.weight, input)? {
        loss = (loss * w)?;
    }
    layer.reduction.apply(loss)
});
