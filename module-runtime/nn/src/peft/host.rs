//! The layers that hold adapters ([`Host`]: PEFT's `lora.Linear`, `lora.Embedding`,
//! `lora.Conv1d`, `lora.Conv2d`, `lora.Conv3d`), their adapter slots, and [`LoraFactor`], the layer type of an
//! adapter's `lora_A` and `lora_B` (a `Linear` or a convolution of the host's kind).

use candle_core::Tensor;

use crate::conv::{Conv, Conv1d, Conv2d, Conv3d};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::linear::Linear;
use crate::peft::layer::LoraLayer;
use crate::{Forward, Module, Param};

/// A layer that holds adapters: PEFT's `lora.Linear`, `lora.Embedding`, `lora.Conv1d`,
/// `lora.Conv2d`, `lora.Conv3d`.
#[derive(Clone, Copy)]
pub(crate) enum Host<'a> {
    Linear(&'a Linear),
    Embedding(&'a Embedding),
    Conv1d(&'a Conv1d),
    Conv2d(&'a Conv2d),
    Conv3d(&'a Conv3d),
}

impl<'a> Host<'a> {
    /// `m` as a layer that takes adapters, if it is one.
    pub(crate) fn of(m: &'a dyn Module) -> Option<Self> {
        if let Some(l) = m.downcast_ref::<Linear>() {
            return Some(Host::Linear(l));
        }
        if let Some(e) = m.downcast_ref::<Embedding>() {
            return Some(Host::Embedding(e));
        }
        if let Some(c) = m.downcast_ref::<Conv1d>() {
            return Some(Host::Conv1d(c));
        }
        if let Some(c) = m.downcast_ref::<Conv2d>() {
            return Some(Host::Conv2d(c));
        }
        m.downcast_ref::<Conv3d>().map(Host::Conv3d)
    }

    pub(crate) fn lora(self) -> Option<&'a LoraLayer> {
        match self {
            Host::Linear(l) => l.lora.as_deref(),
            Host::Embedding(e) => e.lora.as_deref(),
            Host::Conv1d(c) => c.lora.as_deref(),
            Host::Conv2d(c) => c.lora.as_deref(),
            Host::Conv3d(c) => c.lora.as_deref(),
        }
    }

    pub(crate) fn weight(self) -> &'a Param {
        match self {
            Host::Linear(l) => &l.weight,
            Host::Embedding(e) => &e.weight,
            Host::Conv1d(c) => &c.weight,
            Host::Conv2d(c) => &c.weight,
            Host::Conv3d(c) => &c.weight,
        }
    }

    /// The convolution's groups (1 for the other layers).
    pub(crate) fn groups(self) -> usize {
        match self {
            Host::Conv1d(c) => c.config.groups,
            Host::Conv2d(c) => c.config.groups,
            Host::Conv3d(c) => c.config.groups,
            _ => 1,
        }
    }

    /// How DoRA's magnitude lies along the weight.
    pub(crate) fn kind(self) -> Kind {
        match self {
            Host::Linear(_) => Kind::Linear,
            Host::Embedding(_) => Kind::Embedding,
            Host::Conv1d(_) => Kind::Conv(1),
            Host::Conv2d(_) => Kind::Conv(2),
            Host::Conv3d(_) => Kind::Conv(3),
        }
    }
}

/// The adapter slot of `m`, mutably, if `m` takes adapters.
pub(crate) fn slot_mut(m: &mut dyn Module) -> Option<&mut Option<Box<LoraLayer>>> {
    if m.is::<Linear>() {
        return m.downcast_mut::<Linear>().map(|l| &mut l.lora);
    }
    if m.is::<Embedding>() {
        return m.downcast_mut::<Embedding>().map(|e| &mut e.lora);
    }
    if m.is::<Conv1d>() {
        return m.downcast_mut::<Conv1d>().map(|c| &mut c.lora);
    }
    if m.is::<Conv2d>() {
        return m.downcast_mut::<Conv2d>().map(|c| &mut c.lora);
    }
    m.downcast_mut::<Conv3d>().map(|c| &mut c.lora)
}

/// Where DoRA's magnitude lies: one value per output row of a `Linear`'s or convolution's
/// weight (every dimension after the first flattened), one per column of an `Embedding`'s table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Linear,
    Embedding,
    /// A convolution over this many spatial dimensions.
    Conv(usize),
}

impl Kind {
    /// The norms DoRA's magnitude divides by: each output row's (PEFT's
    /// `torch.linalg.norm(w, dim=1)`, a convolution's over all but the first dimension), or each
    /// column's for an `Embedding` (PEFT's `fan_in_fan_out=True`).
    pub(crate) fn norm(self, w: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Kind::Embedding => w.sqr()?.sum(0)?.sqrt()?,
            _ => w.flatten_from(1)?.sqr()?.sum(1)?.sqrt()?,
        })
    }

    /// The magnitude's shape as PEFT keeps (and saves) it, for `n` norms: `[n]`, or a
    /// convolution's `[1, out, 1, …]`.
    pub(crate) fn magnitude_dims(self, n: usize) -> Vec<usize> {
        match self {
            Kind::Conv(d) => [vec![1, n], vec![1; d]].concat(),
            _ => vec![n],
        }
    }

    /// `f` (one value per norm) shaped to scale the weight: `[out, 1, …]` or an embedding's
    /// `[1, dim]`.
    pub(crate) fn weight_view(self, f: &Tensor, rank: usize) -> Result<Tensor> {
        let n = f.elem_count();
        let mut dims = vec![1; rank];
        match self {
            Kind::Embedding => dims[1] = n,
            _ => dims[0] = n,
        }
        Ok(f.reshape(dims)?)
    }

    /// `f` shaped to scale the layer's output: the last dimension of a `Linear`'s or an
    /// `Embedding`'s, the channels (`[out, 1, …]`) of a convolution's, batched or not.
    pub(crate) fn output_view(self, f: &Tensor) -> Result<Tensor> {
        let n = f.elem_count();
        Ok(match self {
            Kind::Conv(d) => f.reshape([vec![n], vec![1; d]].concat())?,
            _ => f.reshape(n)?,
        })
    }
}

/// An adapter's `lora_A` or `lora_B`: a `Linear` for a `Linear` host, a convolution of the
/// host's dimension for a convolution (PEFT's `type(base_layer)(...)`). Transparent: paths,
/// `print(model)` and hooks see the layer inside.
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub(crate) enum LoraFactor {
    Linear(Linear),
    Conv1d(Conv1d),
    Conv2d(Conv2d),
    Conv3d(Conv3d),
}

impl LoraFactor {
    /// The factor's weight: `[r, in]` / `[out, r]`, or a convolution's.
    pub(crate) fn weight(&self) -> &Param {
        match self {
            Self::Linear(l) => &l.weight,
            Self::Conv1d(c) => &c.weight,
            Self::Conv2d(c) => &c.weight,
            Self::Conv3d(c) => &c.weight,
        }
    }

    /// Applies the factor through the inner layer's `call`, so hooks on its path see it.
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        use crate::ModuleExt;
        match self {
            Self::Linear(l) => l.call(x),
            Self::Conv1d(c) => c.call(x),
            Self::Conv2d(c) => c.call(x),
            Self::Conv3d(c) => c.call(x),
        }
    }
}

impl Forward<&Tensor> for LoraFactor {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x)
    }
}

/// A convolution's `lora_A` and `lora_B` as PEFT's `_ConvNd.update_layer` builds them: `lora_A`
/// the base's kernel size, stride and padding into `r` channels (no dilation, one group);
/// `lora_B` a 1-wide kernel from `r` to the output channels, in the base's groups. Both start as
/// PyTorch initializes a convolution.
pub(crate) fn conv_factors<const D: usize>(base: &Conv<D>, r: usize) -> Result<(Conv<D>, Conv<D>)> {
    let w = base.weight.shape().dims().to_vec();
    let device = base.weight.device();
    let c = &base.config;
    let (out_channels, in_channels) = (w[0], w[1] * c.groups);
    let mut kernel = [1; D];
    kernel.copy_from_slice(&w[2..]);
    let a_config = crate::ConvConfig {
        stride: c.stride,
        padding: c.padding,
        dilation: 1.into(),
        groups: 1,
        bias: false,
        dtype: base.weight.dtype(),
    };
    let b_config = crate::ConvConfig {
        groups: c.groups,
        bias: false,
        dtype: base.weight.dtype(),
        ..Default::default()
    };
    let a = Conv::<D>::with_config(in_channels, r, kernel, a_config, &device)?;
    let b = Conv::<D>::with_config(r, out_channels, [1; D], b_config, &device)?;
    Ok((a, b))
}
