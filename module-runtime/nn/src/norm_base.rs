//! What batch and instance norms share, as PyTorch's `_NormBase` holds it for both: the
//! per-channel state (affine parameters, running statistics) and the computation around the
//! statistics (running or from the input, blended into the running ones, applied).

use candle_core::{DType, Device, Tensor};

use crate::common::per_channel;
use crate::error::Result;
use crate::{Buffer, Init, Param};

/// A norm layer's per-channel state, as PyTorch's `_NormBase` keeps it for batch and instance
/// norms: `weight` (ones) and `bias` (zeros) when affine; `running_mean` (zeros), `running_var`
/// (ones) and `num_batches_tracked` (an `i64` 0 a checkpoint may lack) when tracking running
/// statistics.
pub(crate) struct NormState {
    pub(crate) weight: Option<Param>,
    pub(crate) bias: Option<Param>,
    pub(crate) running_mean: Option<Buffer>,
    pub(crate) running_var: Option<Buffer>,
    pub(crate) num_batches_tracked: Option<Buffer>,
}

impl NormState {
    /// The state, its per-channel tensors made by `param` and `buffer` from their init.
    pub(crate) fn new(
        affine: bool,
        track_running_stats: bool,
        device: &Device,
        param: impl Fn(Init) -> Result<Param>,
        buffer: impl Fn(Init) -> Result<Buffer>,
    ) -> Result<Self> {
        let affine = |init| affine.then(|| param(init)).transpose();
        let tracked = |init| track_running_stats.then(|| buffer(init)).transpose();
        Ok(Self {
            weight: affine(Init::Ones)?,
            bias: affine(Init::Zeros)?,
            running_mean: tracked(Init::Zeros)?,
            running_var: tracked(Init::Ones)?,
            num_batches_tracked: track_running_stats
                .then(|| Tensor::new(0i64, device).map(|t| Buffer::new(t).allow_missing()))
                .transpose()?,
        })
    }

    /// The state over `num_features` channels, built now, in `dtype`.
    pub(crate) fn eager(
        num_features: usize,
        affine: bool,
        track_running_stats: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::new(
            affine,
            track_running_stats,
            device,
            |init| Param::init(num_features, init, 0, dtype, device),
            |init| Buffer::init(num_features, init, dtype, device),
        )
    }
}

/// The per-channel mean and variance a norm normalizes `x` with: in evaluation mode the running
/// statistics as `[1, C, 1, …]` in `x`'s dtype, if the layer keeps them; otherwise what
/// `from_input` computes from `x` (and, in training, blends into the running statistics).
pub(crate) fn statistics(
    training: bool,
    (running_mean, running_var): (&Option<Buffer>, &Option<Buffer>),
    x: &Tensor,
    from_input: impl FnOnce() -> Result<(Tensor, Tensor)>,
) -> Result<(Tensor, Tensor)> {
    match (running_mean, running_var) {
        (Some(mean), Some(var)) if !training => {
            let stat = |b: &Buffer| per_channel(&b.tensor()?.to_dtype(x.dtype())?, x.rank());
            Ok((stat(mean)?, stat(var)?))
        }
        _ => from_input(),
    }
}

/// The mean and the biased variance of `x` over `dims`, kept as dimensions of size 1.
pub(crate) fn mean_and_var(x: &Tensor, dims: &[usize]) -> Result<(Tensor, Tensor)> {
    let mean = x.mean_keepdim(dims)?;
    let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(dims)?;
    Ok((mean, var))
}

/// The biased variance of `n` values made unbiased (what the running variance is fed), cut from
/// the graph.
pub(crate) fn unbiased(var: &Tensor, n: usize) -> Result<Tensor> {
    Ok((var.detach() * (n as f64 / (n - 1) as f64))?)
}

/// `r = (1 - factor) r + factor * stat` for the running mean and variance, from per-channel
/// `[C]` statistics (the variance already unbiased), in the buffers' dtype.
pub(crate) fn blend_running_stats(
    (running_mean, running_var): (&Buffer, &Buffer),
    mean: &Tensor,
    var: &Tensor,
    factor: f64,
) -> Result<()> {
    for (buffer, stat) in [(running_mean, mean), (running_var, var)] {
        let old = buffer.tensor()?;
        let stat = stat.to_dtype(old.dtype())?;
        buffer.set(&((old * (1.0 - factor))? + (stat * factor)?)?)?;
    }
    Ok(())
}

/// `(x - mean) / sqrt(var + eps)`, then the channels (dimension 1) scaled by `weight` and shifted
/// by `bias` where the layer has them; composed of differentiable ops.
pub(crate) fn normalize(
    x: &Tensor,
    (mean, var): (&Tensor, &Tensor),
    eps: f64,
    weight: &Option<Param>,
    bias: &Option<Param>,
) -> Result<Tensor> {
    let y = x
        .broadcast_sub(mean)?
        .broadcast_div(&(var + eps)?.sqrt()?)?;
    channel_affine(y, weight, bias)
}

/// `y` with its channels (dimension 1) scaled by `weight` and shifted by `bias`, each `[C]`,
/// where the layer has them: the affine step of every per-channel norm.
pub(crate) fn channel_affine(
    mut y: Tensor,
    weight: &Option<Param>,
    bias: &Option<Param>,
) -> Result<Tensor> {
    let rank = y.rank();
    // A half-precision input with float32 parameters (CPU autocast leaves the norms in their
    // input's dtype): the affine step in float32, the result in the input's dtype, as PyTorch's
    // mixed-dtype CPU kernels return it.
    let params_dtype = weight.as_ref().or(bias.as_ref()).map(|p| p.dtype());
    let half = matches!(y.dtype(), DType::BF16 | DType::F16);
    if half && params_dtype == Some(DType::F32) {
        let out = y.dtype();
        return Ok(channel_affine(y.to_dtype(DType::F32)?, weight, bias)?.to_dtype(out)?);
    }
    if let Some(w) = weight {
        y = y.broadcast_mul(&per_channel(&w.tensor()?, rank)?)?;
    }
    if let Some(b) = bias {
        y = y.broadcast_add(&per_channel(&b.tensor()?, rank)?)?;
    }
    Ok(y)
}
