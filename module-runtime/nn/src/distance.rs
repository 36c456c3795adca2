//! Distances and the losses built on them: `CosineSimilarity`, `PairwiseDistance`,
//! `CosineEmbeddingLoss`, `TripletMarginLoss`, `TripletMarginWithDistanceLoss` and
//! `MarginRankingLoss`, PyTorch's `torch.nn`
//! classes of those names with their options. All are differentiable with respect to their
//! floating-point inputs, which must have one shape (else an
//! [`Error::InputShape`](crate::Error::InputShape) naming both).

use std::fmt;
use std::sync::Arc;

use candle_core::{Tensor, D};

use crate::common::{config_layer, default_new, input_shape_error, layer_forward, resolve_dim};
use crate::error::Result;
use crate::loss_reduction::{check_same_shape, LossReduction};
use crate::Module;

/// The `p`-norm of `x` along `dim` (`p = ∞` is the largest magnitude), as `torch.norm` computes it.
fn p_norm(x: &Tensor, p: f64, dim: usize, keepdim: bool) -> Result<Tensor> {
    let n = if p == 2.0 {
        x.sqr()?.sum_keepdim(dim)?.sqrt()?
    } else if p == 1.0 {
        x.abs()?.sum_keepdim(dim)?
    } else if p.is_infinite() {
        x.abs()?.max_keepdim(dim)?
    } else {
        x.abs()?.powf(p)?.sum_keepdim(dim)?.powf(1.0 / p)?
    };
    Ok(if keepdim { n } else { n.squeeze(dim)? })
}

/// `‖x1 - x2 + eps‖_p` along the last dimension (PyTorch's `F.pairwise_distance`).
fn pairwise(x1: &Tensor, x2: &Tensor, p: f64, eps: f64, keepdim: bool) -> Result<Tensor> {
    let dim = x1.rank().saturating_sub(1);
    p_norm(&((x1 - x2)? + eps)?, p, dim, keepdim)
}

config_layer! {
    /// The cosine of the angle between `x1` and `x2` along `dim`, each norm clamped below at `eps`:
    /// PyTorch's `nn.CosineSimilarity(dim=1, eps=1e-8)`. The output drops `dim`.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::CosineSimilarity;
    /// let a = Tensor::new(&[[1f32, 0.], [1., 1.]], &Device::Cpu)?;
    /// let b = Tensor::new(&[[0f32, 2.], [2., 2.]], &Device::Cpu)?;
    /// let cos = CosineSimilarity::new().call((&a, &b))?.to_vec1::<f32>()?;
    /// assert!(cos[0].abs() < 1e-6 && (cos[1] - 1.).abs() < 1e-6);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`CosineSimilarityPath`], from [`CosineSimilarity::path`]
    /// (`#[module(paths)]`).
    pub struct CosineSimilarity {
        /// The dimension the vectors lie along (PyTorch's default 1; negative counts from the end).
        pub dim: isize = 1,
        /// The smallest norm divided by (PyTorch's default 1e-8).
        pub eps: f64 = 1e-8,
    }
    /// Along `dim`, with `eps`.
    with_config
}

layer_forward!(CosineSimilarity, |layer, (x1, x2)| {
    check_same_shape("CosineSimilarity", x2, x1, "x2 (x1's shape)")?;
    let dim = resolve_dim(x1, layer.dim, "cosine_similarity")?;
    let unit = |x: &Tensor| -> Result<Tensor> {
        let norm = p_norm(x, 2.0, dim, true)?.maximum(layer.eps)?;
        Ok(x.broadcast_div(&norm)?)
    };
    Ok((unit(x1)? * unit(x2)?)?.sum(dim)?)
});

/// `‖x1 - x2 + eps‖_p` along the last dimension: PyTorch's `nn.PairwiseDistance(p=2.0,
/// eps=1e-6, keepdim=False)`. `p` (the field `norm`) may be any positive number or
/// `f64::INFINITY`; `nn.PairwiseDistance(p=1.0, keepdim=True)` is
/// `PairwiseDistance { keepdim: true, ..PairwiseDistance::with_norm(1.0) }`.
///
/// Typed paths into it: [`PairwiseDistancePath`], from [`PairwiseDistance::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct PairwiseDistance {
    /// The norm's degree (PyTorch's default 2.0).
    pub norm: f64,
    /// Added to the difference, to avoid a zero norm's undefined gradient (PyTorch's default
    /// 1e-6).
    pub eps: f64,
    /// Whether the output keeps the last dimension, of size 1 (PyTorch's default `false`).
    pub keepdim: bool,
}

impl Default for PairwiseDistance {
    fn default() -> Self {
        Self {
            norm: 2.0,
            eps: 1e-6,
            keepdim: false,
        }
    }
}

impl PairwiseDistance {
    /// PyTorch's defaults: the Euclidean distance, `eps = 1e-6`, last dimension dropped.
    pub fn new() -> Self {
        Self::default()
    }

    /// The `p`-norm distance, with PyTorch's other defaults.
    pub fn with_norm(p: f64) -> Self {
        Self {
            norm: p,
            ..Self::default()
        }
    }
}

layer_forward!(PairwiseDistance, |layer, (x1, x2)| {
    check_same_shape("PairwiseDistance", x2, x1, "x2 (x1's shape)")?;
    if x1.rank() == 0 {
        return Err(input_shape_error("PairwiseDistance", "[N, D] or [D]", x1));
    }
    pairwise(x1, x2, layer.norm, layer.eps, layer.keepdim)
});

/// `max(0, v)`, with the gradient of `v` where it is positive.
fn clamp_min_zero(v: &Tensor) -> Result<Tensor> {
    Ok(v.gt(0f64)?.where_cond(v, &v.zeros_like()?)?)
}

/// `1 - cos(x1, x2)` for targets `1`, `max(0, cos(x1, x2) - margin)` for targets `-1`, reduced:
/// PyTorch's `nn.CosineEmbeddingLoss(margin=0.0, reduction='mean')`. The inputs are `[N, D]` (or
/// `[D]`), the target `[N]` (or `[]`) of ±1, floating point or integer.
///
/// Typed paths into it: [`CosineEmbeddingLossPath`], from [`CosineEmbeddingLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct CosineEmbeddingLoss {
    /// The cosine above which dissimilar pairs are penalized (PyTorch's default 0.0).
    pub margin: f64,
    /// How the per-pair losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl CosineEmbeddingLoss {
    /// PyTorch's defaults: margin 0, mean.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `margin` and `reduction`.
    pub fn with_config(margin: f64, reduction: LossReduction) -> Self {
        Self { margin, reduction }
    }
}

layer_forward!(CosineEmbeddingLoss, |layer, (x1, x2, target)| {
    const LAYER: &str = "CosineEmbeddingLoss";
    check_same_shape(LAYER, x2, x1, "input2 (input1's shape)")?;
    let batch = match x1.dims() {
        [_] => vec![],
        [n, _] => vec![*n],
        _ => return Err(input_shape_error(LAYER, "[N, D] or [D] inputs", x1)),
    };
    if target.dims() != batch.as_slice() {
        let expected = format!("{batch:?} targets for the inputs {:?}", x1.dims());
        return Err(input_shape_error(LAYER, expected, target));
    }
    // ATen's formula: EPSILON = 1e-12 added to each squared norm.
    let prod = (x1 * x2)?.sum(D::Minus1)?;
    let sq1 = (x1.sqr()?.sum(D::Minus1)? + 1e-12)?;
    let sq2 = (x2.sqr()?.sum(D::Minus1)? + 1e-12)?;
    let cos = (prod / (sq1 * sq2)?.sqrt()?)?;
    let zeros = cos.zeros_like()?;
    let pos = target
        .eq(1f64)?
        .where_cond(&cos.affine(-1.0, 1.0)?, &zeros)?;
    let neg = clamp_min_zero(&(&cos - layer.margin)?)?;
    let neg = target.eq(-1f64)?.where_cond(&neg, &zeros)?;
    layer.reduction.apply((pos + neg)?)
});

/// `max(0, margin + d(a, p) - d(a, n))` of anchors, positives and negatives `[N, D]` (or `[D]`),
/// with `d` the [`PairwiseDistance`] of degree `p`, reduced: PyTorch's
/// `nn.TripletMarginLoss(margin=1.0, p=2.0, eps=1e-6, swap=False, reduction='mean')`. With `swap`,
/// `d(a, n)` is replaced by `d(p, n)` where that is smaller.
///
/// Typed paths into it: [`TripletMarginLossPath`], from [`TripletMarginLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct TripletMarginLoss {
    /// The margin between positive and negative distances (PyTorch's default 1.0).
    pub margin: f64,
    /// The norm's degree (PyTorch's default 2.0).
    pub norm: f64,
    /// Added to differences, as [`PairwiseDistance`] does (PyTorch's default 1e-6).
    pub eps: f64,
    /// Whether to use the distance swap of Balntas et al. (PyTorch's default `false`).
    pub swap: bool,
    /// How the per-triplet losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for TripletMarginLoss {
    fn default() -> Self {
        Self {
            margin: 1.0,
            norm: 2.0,
            eps: 1e-6,
            swap: false,
            reduction: LossReduction::Mean,
        }
    }
}

default_new! {
    /// PyTorch's defaults.
    TripletMarginLoss
}

layer_forward!(TripletMarginLoss, |layer, (a, p, n)| {
    const LAYER: &str = "TripletMarginLoss";
    check_same_shape(LAYER, p, a, "the positives (the anchors' shape)")?;
    check_same_shape(LAYER, n, a, "the negatives (the anchors' shape)")?;
    if !matches!(a.rank(), 1 | 2) {
        return Err(input_shape_error(LAYER, "[N, D] or [D]", a));
    }
    let distance = |x: &Tensor, y: &Tensor| pairwise(x, y, layer.norm, layer.eps, false);
    triplet_hinge(
        (a, p, n),
        &distance,
        layer.margin,
        layer.swap,
        layer.reduction,
    )
});

/// `max(0, margin + d(a, p) - d(a, n))` reduced, `d(a, n)` swapped for a smaller `d(p, n)` when
/// `swap` (ATen's `triplet_margin_loss`, and `F.triplet_margin_with_distance_loss`).
fn triplet_hinge(
    (a, p, n): (&Tensor, &Tensor, &Tensor),
    distance: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    margin: f64,
    swap: bool,
    reduction: LossReduction,
) -> Result<Tensor> {
    let d_pos = distance(a, p)?;
    let mut d_neg = distance(a, n)?;
    if swap {
        let d_swap = distance(p, n)?;
        d_neg = d_swap.lt(&d_neg)?.where_cond(&d_swap, &d_neg)?;
    }
    let hinge = clamp_min_zero(&((d_pos - d_neg)? + margin)?)?;
    reduction.apply(hinge)
}

/// A distance between two batches of vectors, for [`TripletMarginWithDistanceLoss`]: one
/// non-negative value per pair.
pub type DistanceFn = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;

/// [`TripletMarginLoss`] with any distance: `max(0, margin + d(a, p) - d(a, n))`, reduced.
/// PyTorch's `nn.TripletMarginWithDistanceLoss(distance_function=None, margin=1.0, swap=False,
/// reduction='mean')`; no distance function is the Euclidean [`PairwiseDistance`].
///
/// ```
/// use std::sync::Arc;
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{CosineSimilarity, TripletMarginWithDistanceLoss};
/// // 1 - cosine similarity as the distance.
/// let cosine = CosineSimilarity::new();
/// let loss = TripletMarginWithDistanceLoss {
///     distance_function: Some(Arc::new(move |x: &Tensor, y: &Tensor| {
///         Ok(cosine.call((x, y))?.affine(-1.0, 1.0)?)
///     })),
///     ..Default::default()
/// };
/// let a = Tensor::new(&[[1f32, 0.]], &Device::Cpu)?;
/// let p = Tensor::new(&[[2f32, 0.]], &Device::Cpu)?;
/// let n = Tensor::new(&[[0f32, 1.]], &Device::Cpu)?;
/// assert_eq!(loss.call((&a, &p, &n))?.to_scalar::<f32>()?, 0.); // d(a, n) - d(a, p) = 1 >= margin
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`TripletMarginWithDistanceLossPath`], from
/// [`TripletMarginWithDistanceLoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone)]
#[module(crate = module_core)]
#[module(paths)]
pub struct TripletMarginWithDistanceLoss {
    /// The distance; `None` (the default) is [`PairwiseDistance::new`]'s.
    #[module(skip)]
    pub distance_function: Option<DistanceFn>,
    /// The margin between positive and negative distances (PyTorch's default 1.0).
    pub margin: f64,
    /// Whether to use the distance swap (PyTorch's default `false`).
    pub swap: bool,
    /// How the per-triplet losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for TripletMarginWithDistanceLoss {
    fn default() -> Self {
        Self {
            distance_function: None,
            margin: 1.0,
            swap: false,
            reduction: LossReduction::Mean,
        }
    }
}

impl fmt::Debug for TripletMarginWithDistanceLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let distance = if self.distance_function.is_some() {
            "custom"
        } else {
            "PairwiseDistance"
        };
        f.debug_struct("TripletMarginWithDistanceLoss")
            .field("distance_function", &distance)
            .field("margin", &self.margin)
            .field("swap", &self.swap)
            .field("reduction", &self.reduction)
            .finish()
    }
}

default_new! {
    /// PyTorch's defaults: the Euclidean distance, margin 1, no swap, mean.
    TripletMarginWithDistanceLoss
}

layer_forward!(TripletMarginWithDistanceLoss, |layer, (a, p, n)| {
    const LAYER: &str = "TripletMarginWithDistanceLoss";
    check_same_shape(LAYER, p, a, "the positives (the anchors' shape)")?;
    check_same_shape(LAYER, n, a, "the negatives (the anchors' shape)")?;
    let euclidean = |x: &Tensor, y: &Tensor| pairwise(x, y, 2.0, 1e-6, false);
    let distance: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor> = match &layer.distance_function {
        Some(f) => f.as_ref(),
        None => &euclidean,
    };
    triplet_hinge(
        (a, p, n),
        distance,
        layer.margin,
        layer.swap,
        layer.reduction,
    )
});

/// `max(0, -y (x1 - x2) + margin)` of scores `x1`, `x2` and targets `y` of ±1, all of one shape,
/// reduced: PyTorch's `nn.MarginRankingLoss(margin=0.0, reduction='mean')`.
///
/// Typed paths into it: [`MarginRankingLossPath`], from [`MarginRankingLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct MarginRankingLoss {
    /// How far the better score must lead (PyTorch's default 0.0).
    pub margin: f64,
    /// How the per-pair losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl MarginRankingLoss {
    /// PyTorch's defaults: margin 0, mean.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `margin` and `reduction`.
    pub fn with_config(margin: f64, reduction: LossReduction) -> Self {
        Self { margin, reduction }
    }
}

layer_forward!(MarginRankingLoss, |layer, (x1, x2, target)| {
    const LAYER: &str = "MarginRankingLoss";
    check_same_shape(LAYER, x2, x1, "input2 (input1's shape)")?;
    check_same_shape(LAYER, target, x1, "the target (input1's shape)")?;
    let target = target.to_dtype(x1.dtype())?;
    let hinge = ((target.neg()? * (x1 - x2)?)? + layer.margin)?;
    layer.reduction.apply(clamp_min_zero(&hinge)?)
});
