//! Layers that only rearrange their input: `Identity`, `Flatten`, `Unflatten`, `PixelShuffle`,
//! `PixelUnshuffle` and `ChannelShuffle`, PyTorch's `torch.nn` layers of those names. Each is differentiable (the
//! gradient is rearranged back), and an input they cannot rearrange is an
//! [`Error::InputShape`](crate::Error::InputShape) naming its shape.

use candle_core::Tensor;
use module_core::py_tuple;

use crate::common::{
    config_layer, default_new, forward_by_value, input_shape_error, layer_forward, layer_repr,
    resolve_dim,
};
use crate::{Mode, Module};

/// Returns its input: PyTorch's `nn.Identity`, a placeholder where a model's structure wants a
/// layer (a disabled projection, a removed head) without changing its state-dict keys elsewhere.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Identity;
/// let x = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// assert_eq!(Identity::new().call(&x)?.to_vec1::<f32>()?, [1., 2.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`IdentityPath`], from [`Identity::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct Identity {
    /// Keeps the layer from being zero-sized (see [`ReLU`](crate::ReLU)); no effect on the
    /// output.
    pub mode: Mode,
}

default_new! {
    /// The layer. PyTorch's `Identity(*args, **kwargs)` ignores its arguments; there are none here.
    Identity
}

layer_forward!(Identity, |_, x| Ok(x.clone()));

config_layer! {
    /// Merges dimensions `start_dim..=end_dim` into one: PyTorch's `nn.Flatten(start_dim=1,
    /// end_dim=-1)`, by default `[N, *]` to `[N, prod(*)]`. Negative dimensions count from the end.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::Flatten;
    /// let x = Tensor::zeros((2, 3, 4, 5), DType::F32, &Device::Cpu)?;
    /// assert_eq!(Flatten::new().call(&x)?.dims(), [2, 60]);
    /// assert_eq!(Flatten::with_dims(0, 2).call(&x)?.dims(), [24, 5]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`FlattenPath`], from [`Flatten::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Flatten {
        /// The first dimension merged (PyTorch's default 1).
        pub start_dim: isize = 1,
        /// The last dimension merged (PyTorch's default -1).
        pub end_dim: isize = -1,
    }
    /// Merges `start_dim..=end_dim`.
    with_dims
}

layer_forward!(Flatten, |layer, x| {
    let start = resolve_dim(x, layer.start_dim, "flatten")?;
    let end = resolve_dim(x, layer.end_dim, "flatten")?;
    if start > end {
        let expected = format!(
            "a rank where start_dim {} is not after end_dim {}",
            layer.start_dim, layer.end_dim
        );
        return Err(input_shape_error("Flatten", expected, x));
    }
    Ok(x.flatten(start, end)?)
});

layer_repr!(Flatten: start_dim, end_dim);

/// Splits dimension `dim` into `unflattened_size`: PyTorch's `nn.Unflatten(dim,
/// unflattened_size)`, the inverse of [`Flatten`]. One size may be `-1`, inferred from the others;
/// sizes whose product is not the dimension's size are an
/// [`Error::InputShape`](crate::Error::InputShape).
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Unflatten;
/// let x = Tensor::zeros((2, 12), DType::F32, &Device::Cpu)?;
/// assert_eq!(Unflatten::new(1, [3, -1]).call(&x)?.dims(), [2, 3, 4]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`UnflattenPath`], from [`Unflatten::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Unflatten {
    /// The dimension split (negative counts from the end).
    pub dim: isize,
    /// The sizes it is split into; at most one `-1`.
    #[module(skip)]
    pub unflattened_size: Vec<isize>,
}

impl Unflatten {
    /// Splits `dim` into `unflattened_size`.
    pub fn new(dim: isize, unflattened_size: impl Into<Vec<isize>>) -> Self {
        Self {
            dim,
            unflattened_size: unflattened_size.into(),
        }
    }

    /// The sizes for a dimension of size `size`, if they fit it.
    fn sizes(&self, size: usize) -> Option<Vec<usize>> {
        let inferred = self.unflattened_size.iter().filter(|&&s| s == -1).count();
        if inferred > 1 || self.unflattened_size.iter().any(|&s| s < -1) {
            return None;
        }
        let known: usize = self
            .unflattened_size
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .product();
        let missing = match (inferred, known) {
            (0, _) => 1,
            (_, 0) => return None,
            _ => size / known,
        };
        let sizes: Vec<usize> = self
            .unflattened_size
            .iter()
            .map(|&s| if s == -1 { missing } else { s as usize })
            .collect();
        (sizes.iter().product::<usize>() == size).then_some(sizes)
    }
}

layer_forward!(Unflatten, |layer, x| {
    let dim = resolve_dim(x, layer.dim, "unflatten")?;
    let Some(sizes) = layer.sizes(x.dim(dim)?) else {
        let expected = format!(
            "a size along dimension {} that {:?} splits",
            layer.dim, layer.unflattened_size
        );
        return Err(input_shape_error("Unflatten", expected, x));
    };
    let dims = x.dims();
    let shape: Vec<usize> = [&dims[..dim], &sizes, &dims[dim + 1..]].concat();
    Ok(x.reshape(shape)?)
});

layer_repr!(Unflatten, |layer| format!(
    "dim={}, unflattened_size={}",
    layer.dim,
    py_tuple(&layer.unflattened_size)
));

config_layer! {
    /// Moves channels into space: `[*, C·r², H, W]` to `[*, C, H·r, W·r]` with `r =
    /// upscale_factor`, PyTorch's `nn.PixelShuffle(upscale_factor)` (sub-pixel convolution). Output
    /// pixel `(h·r + i, w·r + j)` of channel `c` is input channel `c·r² + i·r + j` at `(h, w)`.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::{PixelShuffle, PixelUnshuffle};
    /// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 4, 2, 2))?;
    /// let y = PixelShuffle::new(2).call(&x)?;
    /// assert_eq!(y.dims(), [1, 1, 4, 4]);
    /// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?[..4], [0., 4., 1., 5.]);
    /// let back = PixelUnshuffle::new(2).call(&y)?;
    /// assert_eq!(back.flatten_all()?.to_vec1::<f32>()?, x.flatten_all()?.to_vec1::<f32>()?);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`PixelShufflePath`], from [`PixelShuffle::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct PixelShuffle {
        /// `r`: the factor by which height and width grow.
        pub upscale_factor: usize,
    }
    /// Upscales by `upscale_factor`.
    new
}

/// The leading (batch) dimensions of `x` and its last three, if it has at least three.
fn split_chw(x: &Tensor) -> Option<(&[usize], [usize; 3])> {
    let dims = x.dims();
    let lead = dims.len().checked_sub(3)?;
    Some((&dims[..lead], [dims[lead], dims[lead + 1], dims[lead + 2]]))
}

layer_forward!(PixelShuffle, |layer, x| {
    let r = layer.upscale_factor;
    let fits = split_chw(x).filter(|(_, [c, _, _])| r > 0 && c % (r * r) == 0);
    let Some((lead, [c, h, w])) = fits else {
        let expected = format!("[*, C·{r}², H, W] (channels divisible by upscale_factor²)");
        return Err(input_shape_error("PixelShuffle", expected, x));
    };
    let batch: usize = lead.iter().product();
    let c_out = c / (r * r);
    let y = x
        .reshape(vec![batch, c_out, r, r, h, w])?
        .permute([0, 1, 4, 2, 5, 3])?;
    let out: Vec<usize> = [lead, &[c_out, h * r, w * r]].concat();
    Ok(y.reshape(out)?)
});

layer_repr!(PixelShuffle: upscale_factor);

config_layer! {
    /// Moves space into channels: `[*, C, H·r, W·r]` to `[*, C·r², H, W]` with `r =
    /// downscale_factor`, PyTorch's `nn.PixelUnshuffle(downscale_factor)`, the inverse of
    /// [`PixelShuffle`].
    ///
    /// Typed paths into it: [`PixelUnshufflePath`], from [`PixelUnshuffle::path`]
    /// (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct PixelUnshuffle {
        /// `r`: the factor by which height and width shrink.
        pub downscale_factor: usize,
    }
    /// Downscales by `downscale_factor`.
    new
}

layer_repr!(PixelUnshuffle: downscale_factor);

layer_forward!(PixelUnshuffle, |layer, x| {
    let r = layer.downscale_factor;
    let fits = split_chw(x).filter(|(_, [_, h, w])| r > 0 && h % r == 0 && w % r == 0);
    let Some((lead, [c, h, w])) = fits else {
        let expected = format!("[*, C, H, W] with H and W divisible by {r}");
        return Err(input_shape_error("PixelUnshuffle", expected, x));
    };
    let batch: usize = lead.iter().product();
    let (h_out, w_out) = (h / r, w / r);
    let y = x
        .reshape(vec![batch, c, h_out, r, w_out, r])?
        .permute([0, 1, 3, 5, 2, 4])?;
    let out: Vec<usize> = [lead, &[c * r * r, h_out, w_out]].concat();
    Ok(y.reshape(out)?)
});

config_layer! {
    /// Interleaves the channels of `groups` groups: `[N, C, *]` viewed as `[N, groups, C / groups, *]`,
    /// transposed to `[N, C / groups, groups, *]`, and flattened back (ShuffleNet's shuffle):
    /// PyTorch's `nn.ChannelShuffle(groups)`. The channels must divide into the groups.
    ///
    /// Typed paths into it: [`ChannelShufflePath`], from [`ChannelShuffle::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct ChannelShuffle {
        /// The number of groups the channels are split into.
        pub groups: usize,
    }
    /// Shuffles `groups` groups of channels.
    new
}

layer_repr!(ChannelShuffle: groups);

layer_forward!(ChannelShuffle, |layer, x| {
    let g = layer.groups;
    let dims = x.dims();
    if dims.len() < 3 || g == 0 || !dims[1].is_multiple_of(g) {
        let expected = format!("[N, C, *] with C divisible by groups = {g}");
        return Err(input_shape_error("ChannelShuffle", expected, x));
    }
    let grouped: Vec<usize> = [&dims[..1], &[g, dims[1] / g], &dims[2..]].concat();
    Ok(x.reshape(grouped)?.transpose(1, 2)?.reshape(dims)?)
});

forward_by_value!(
    Identity,
    Flatten,
    Unflatten,
    PixelShuffle,
    PixelUnshuffle,
    ChannelShuffle
);
