//! Margin and soft-margin losses as modules: `HingeEmbeddingLoss`, `SoftMarginLoss`,
//! `MultiLabelSoftMarginLoss` and `MultiMarginLoss`, PyTorch's `torch.nn` classes of those names
//! with their options. Class weights are buffers named `weight`, as in PyTorch's state dicts.

use candle_core::{DType, Tensor};

use crate::activation_smooth::softplus;
use crate::common::{batched, input_shape_error, layer_forward};
use crate::error::Result;
use crate::loss_reduction::{check_same_shape, weighted_loss_constructors, LossReduction};
use crate::{Buffer, Forward, Module};

/// `max(0, v)`, with the gradient of `v` where it is positive.
fn clamp_min_zero(v: &Tensor) -> Result<Tensor> {
    Ok(v.gt(0f64)?.where_cond(v, &v.zeros_like()?)?)
}

/// `x` for targets `1`, `max(0, margin - x)` for targets `-1`, reduced: PyTorch's
/// `nn.HingeEmbeddingLoss(margin=1.0, reduction='mean')`. Input and target (±1, floating point
/// or integer) have one shape.
///
/// Typed paths into it: [`HingeEmbeddingLossPath`], from [`HingeEmbeddingLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct HingeEmbeddingLoss {
    /// The margin for targets `-1` (PyTorch's default 1.0).
    pub margin: f64,
    /// How the per-element losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for HingeEmbeddingLoss {
    fn default() -> Self {
        Self::with_config(1.0, LossReduction::Mean)
    }
}

impl HingeEmbeddingLoss {
    /// PyTorch's defaults: margin 1, mean.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `margin` and `reduction`.
    pub fn with_config(margin: f64, reduction: LossReduction) -> Self {
        Self { margin, reduction }
    }
}

layer_forward!(HingeEmbeddingLoss, |layer, (input, target)| {
    check_same_shape(
        "HingeEmbeddingLoss",
        target,
        input,
        "the target (the input's shape)",
    )?;
    // ATen's formula: the margin term where target != 1, the input where target != -1.
    let zeros = input.zeros_like()?;
    let margin = clamp_min_zero(&input.affine(-1.0, layer.margin)?)?;
    let margin = target.ne(1f64)?.where_cond(&margin, &zeros)?;
    let own = target.ne(-1f64)?.where_cond(input, &zeros)?;
    layer.reduction.apply((margin + own)?)
});

/// `log(1 + exp(-y x))` of scores `x` and targets `y` of ±1 of one shape, reduced: PyTorch's
/// `nn.SoftMarginLoss(reduction='mean')`. Computed without overflow.
///
/// Typed paths into it: [`SoftMarginLossPath`], from [`SoftMarginLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct SoftMarginLoss {
    /// How the per-element losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl SoftMarginLoss {
    /// PyTorch's default: mean.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `reduction`.
    pub fn with_reduction(reduction: LossReduction) -> Self {
        Self { reduction }
    }
}

layer_forward!(SoftMarginLoss, |layer, (input, target)| {
    check_same_shape(
        "SoftMarginLoss",
        target,
        input,
        "the target (the input's shape)",
    )?;
    let margin = (input * target.to_dtype(input.dtype())?)?.neg()?;
    layer.reduction.apply(softplus(&margin, 1.0, 20.0)?)
});

/// One binary cross-entropy per class from logits, averaged over the classes of each sample:
/// `-(y log σ(x) + (1 - y) log σ(-x))`, times `weight`, mean over `C`, then reduced over the
/// samples. PyTorch's `nn.MultiLabelSoftMarginLoss(weight=None, reduction='mean')`. Input and
/// target (0 or 1 per class) are `[N, C]` or `[C]`.
///
/// Typed paths into it: [`MultiLabelSoftMarginLossPath`], from
/// [`MultiLabelSoftMarginLoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct MultiLabelSoftMarginLoss {
    /// A weight per class `[C]`, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// How the per-sample losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

weighted_loss_constructors!(MultiLabelSoftMarginLoss, "`[C]`");

layer_forward!(MultiLabelSoftMarginLoss, |layer, (input, target)| {
    const LAYER: &str = "MultiLabelSoftMarginLoss";
    check_same_shape(LAYER, target, input, "the target (the input's shape)")?;
    if !matches!(input.rank(), 1 | 2) {
        return Err(input_shape_error(LAYER, "[N, C] or [C]", input));
    }
    let target = target.to_dtype(input.dtype())?;
    // log σ(x) = -softplus(-x); log σ(-x) = -softplus(x).
    let log_sig = softplus(&input.neg()?, 1.0, 20.0)?;
    let log_sig_neg = softplus(input, 1.0, 20.0)?;
    let mut loss = ((&target * log_sig)? + (target.affine(-1.0, 1.0)? * log_sig_neg)?)?;
    if let Some(w) = &layer.weight {
        loss = loss.broadcast_mul(&w.tensor()?.to_dtype(input.dtype())?)?;
    }
    let class_dim = input.rank() - 1;
    let classes = input.dim(class_dim)? as f64;
    layer.reduction.apply((loss.sum(class_dim)? / classes)?)
});

/// The multi-class hinge loss of scores `[N, C]` (or `[C]`) and class ids `[N]` (or `[]`):
/// `Σ_{j ≠ y} max(0, margin - x_y + x_j)^p · weight_y / C` per sample, reduced. PyTorch's
/// `nn.MultiMarginLoss(p=1, margin=1.0, weight=None, reduction='mean')`; `p` is 1 or 2.
///
/// Typed paths into it: [`MultiMarginLossPath`], from [`MultiMarginLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct MultiMarginLoss {
    /// The hinge's power, 1 or 2 (PyTorch's default 1).
    pub p: u8,
    /// The margin (PyTorch's default 1.0).
    pub margin: f64,
    /// A weight per class `[C]`, if any (a buffer, as in PyTorch).
    pub weight: Option<Buffer>,
    /// How the per-sample losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for MultiMarginLoss {
    fn default() -> Self {
        Self {
            p: 1,
            margin: 1.0,
            weight: None,
            reduction: LossReduction::Mean,
        }
    }
}

impl MultiMarginLoss {
    /// PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `p` (1 or 2, else an [`Error::InvalidConfig`](crate::Error::InvalidConfig)),
    /// `margin`, class weights `[C]` and `reduction`.
    pub fn with_config(
        p: u8,
        margin: f64,
        weight: Option<Tensor>,
        reduction: LossReduction,
    ) -> Result<Self> {
        if !matches!(p, 1 | 2) {
            return Err(crate::Error::InvalidConfig {
                layer: "MultiMarginLoss",
                message: format!("only p = 1 and p = 2 are supported, got {p}"),
            });
        }
        Ok(Self {
            p,
            margin,
            weight: weight.map(Buffer::new),
            reduction,
        })
    }
}

impl Forward<(&Tensor, &Tensor)> for MultiMarginLoss {
    type Output = Tensor;

    fn forward(&self, (input, target): (&Tensor, &Tensor)) -> Result<Tensor> {
        const LAYER: &str = "MultiMarginLoss";
        let (x, unbatched) = batched(input, 1, 0)?;
        let (n, classes) = match x.dims() {
            &[n, c] => (n, c),
            _ => return Err(input_shape_error(LAYER, "[N, C] or [C]", input)),
        };
        let expected_target: &[usize] = if unbatched { &[] } else { &[n] };
        if target.dtype().is_float() || target.dims() != expected_target {
            let expected = format!(
                "{expected_target:?} integer class ids for the input {:?}",
                input.dims()
            );
            return Err(input_shape_error(LAYER, expected, target));
        }
        let ids = target.reshape(n)?.to_dtype(DType::U32)?;
        let own = x.contiguous()?.gather(&ids.unsqueeze(1)?, 1)?;
        let mut hinge = clamp_min_zero(&x.broadcast_sub(&own)?.affine(1.0, self.margin)?)?;
        if self.p == 2 {
            hinge = hinge.sqr()?;
        }
        if let Some(w) = &self.weight {
            let w = w
                .tensor()?
                .to_dtype(x.dtype())?
                .contiguous()?
                .index_select(&ids, 0)?;
            hinge = hinge.broadcast_mul(&w.unsqueeze(1)?)?;
        }
        // The target's own class adds nothing.
        let classes_row = Tensor::arange(0u32, classes as u32, x.device())?;
        let is_own = ids.unsqueeze(1)?.broadcast_eq(&classes_row.unsqueeze(0)?)?;
        let hinge = is_own.where_cond(&hinge.zeros_like()?, &hinge)?;
        let per_sample = (hinge.sum(1)? / classes as f64)?;
        let per_sample = if unbatched {
            per_sample.squeeze(0)?
        } else {
            per_sample
        };
        self.reduction.apply(per_sample)
    }
}

/// The multi-label hinge loss of scores `[N, C]` (or `[C]`) and target class lists of the same
/// shape (integer class ids, the list of each sample ending at its first `-1`):
/// `Σ_{j ∈ targets} Σ_{k ∉ targets} max(0, 1 - (x_j - x_k)) / C` per sample, reduced. PyTorch's
/// `nn.MultiLabelMarginLoss(reduction='mean')`.
///
/// The lists are read back to the host to find where each ends (PyTorch's CPU kernel reads them
/// too); the scores stay where they are and are differentiable.
///
/// Typed paths into it: [`MultiLabelMarginLossPath`], from [`MultiLabelMarginLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct MultiLabelMarginLoss {
    /// How the per-sample losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl MultiLabelMarginLoss {
    /// PyTorch's default: mean.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `reduction`.
    pub fn with_reduction(reduction: LossReduction) -> Self {
        Self { reduction }
    }
}

impl Forward<(&Tensor, &Tensor)> for MultiLabelMarginLoss {
    type Output = Tensor;

    fn forward(&self, (input, target): (&Tensor, &Tensor)) -> Result<Tensor> {
        const LAYER: &str = "MultiLabelMarginLoss";
        let (x, unbatched) = batched(input, 1, 0)?;
        if !matches!(x.rank(), 2) {
            return Err(input_shape_error(LAYER, "[N, C] or [C]", input));
        }
        if target.dtype().is_float() || target.dims() != input.dims() {
            let expected = format!("{:?} integer class lists (the input's shape)", input.dims());
            return Err(input_shape_error(LAYER, expected, target));
        }
        let (n, classes) = x.dims2()?;
        let lists = target
            .reshape((n, classes))?
            .to_dtype(DType::I64)?
            .to_vec2::<i64>()?;
        // How often each class is listed (PyTorch counts a repeated class again), and whether it is.
        let mut listed = vec![0f32; n * classes];
        for (row, list) in lists.iter().enumerate() {
            for &class in list.iter().take_while(|&&c| c >= 0) {
                let Some(slot) = usize::try_from(class).ok().filter(|&c| c < classes) else {
                    let expected = format!("class ids below {classes} (or -1 to end a list)");
                    return Err(input_shape_error(LAYER, expected, target));
                };
                listed[row * classes + slot] += 1.0;
            }
        }
        let listed = Tensor::from_vec(listed, (n, classes), x.device())?.to_dtype(x.dtype())?;
        let not_target = listed.eq(0f64)?.to_dtype(x.dtype())?;
        // pairs[i, j, k]: how often j is listed for sample i, where k is not listed.
        let pairs = listed
            .unsqueeze(2)?
            .broadcast_mul(&not_target.unsqueeze(1)?)?;
        let diff = x.unsqueeze(2)?.broadcast_sub(&x.unsqueeze(1)?)?;
        let hinge = clamp_min_zero(&diff.affine(-1.0, 1.0)?)?;
        let per_sample = ((hinge * pairs)?.sum((1, 2))? / classes as f64)?;
        let per_sample = if unbatched {
            per_sample.squeeze(0)?
        } else {
            per_sample
        };
        self.reduction.apply(per_sample)
    }
}
