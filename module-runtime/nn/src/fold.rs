//! Sliding blocks: `Unfold` (im2col: every block of a `[N, C, H, W]` input as a column) and
//! `Fold` (col2im: the columns summed back into an image), PyTorch's `torch.nn` classes of those
//! names with their options (`dilation`, `padding`, `stride`).
//!
//! Both gather or scatter with computed positions (`index_select`, `index_add`), one kernel
//! position at a time, so they are differentiable on any device, and `Fold` is `Unfold`'s adjoint
//! as in PyTorch (overlapping blocks add up).

use candle_core::Tensor;

use crate::common::{
    batched, forward_by_value, input_shape_error, layer_forward, layer_repr, PerDim, PyValue, Size,
};
use crate::error::{Error, Result};
use crate::{Forward, Module};

/// How [`Unfold`] and [`Fold`] slide their blocks: PyTorch's keyword arguments, with PyTorch's
/// defaults (no dilation or padding, stride 1), each one value or `(height, width)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoldConfig {
    /// Spacing between the elements of a block (default 1).
    pub dilation: PerDim,
    /// Implicit zero padding on both sides of each spatial dimension (default 0).
    pub padding: PerDim,
    /// Step between blocks (default 1).
    pub stride: PerDim,
}

impl Default for FoldConfig {
    fn default() -> Self {
        Self {
            dilation: PerDim::All(1),
            padding: PerDim::All(0),
            stride: PerDim::All(1),
        }
    }
}

impl FoldConfig {
    /// PyTorch's `extra_repr` of a fold layer: `sizes` then `dilation=1, padding=0, stride=1`.
    fn repr_after(&self, sizes: String) -> String {
        format!(
            "{sizes}, dilation={}, padding={}, stride={}",
            self.dilation.py(),
            self.padding.py(),
            self.stride.py()
        )
    }
}

/// The block geometry along one spatial dimension.
#[derive(Clone, Copy)]
struct Axis {
    kernel: usize,
    dilation: usize,
    padding: usize,
    stride: usize,
}

impl Axis {
    /// The number of blocks along a dimension of `size`, if at least one fits.
    fn blocks(self, size: usize) -> Option<usize> {
        let span = self.dilation * (self.kernel - 1) + 1;
        let padded = size + 2 * self.padding;
        (padded >= span).then(|| (padded - span) / self.stride + 1)
    }

    /// The padded positions that kernel element `k` reads in each of `blocks` blocks.
    fn positions(self, k: usize, blocks: usize) -> impl Iterator<Item = usize> {
        (0..blocks).map(move |b| k * self.dilation + b * self.stride)
    }
}

/// The geometry of both spatial dimensions, checked to be PyTorch-valid (all positive).
fn axes(layer: &'static str, kernel: (usize, usize), config: &FoldConfig) -> Result<[Axis; 2]> {
    let (kh, kw) = kernel;
    let (dh, dw) = config.dilation.hw();
    let (ph, pw) = config.padding.hw();
    let (sh, sw) = config.stride.hw();
    if [kh, kw, dh, dw, sh, sw].contains(&0) {
        return Err(Error::InvalidConfig {
            layer,
            message: format!(
                "kernel_size {kernel:?}, dilation {:?} and stride {:?} must be positive",
                (dh, dw),
                (sh, sw)
            ),
        });
    }
    let axis = |kernel, dilation, padding, stride| Axis {
        kernel,
        dilation,
        padding,
        stride,
    };
    Ok([axis(kh, dh, ph, sh), axis(kw, dw, pw, sw)])
}

/// Extracts every sliding block of `[N, C, H, W]` (or `[C, H, W]`) as a column:
/// `[N, C · kH · kW, L]` with `L` blocks, PyTorch's `nn.Unfold(kernel_size, dilation=1, padding=0,
/// stride=1)` (im2col). Row `c · kH · kW + i · kW + j` holds element `(i, j)` of channel `c`'s
/// blocks.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Fold, Unfold};
/// let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let cols = Unfold::new(2).call(&x)?;
/// assert_eq!(cols.dims(), [1, 4, 9]);
/// // Fold sums overlapping blocks back: interior pixels are counted four times.
/// let back = Fold::new((4, 4), 2).call(&cols)?;
/// assert_eq!(back.flatten_all()?.to_vec1::<f32>()?[5], 4. * 5.);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`UnfoldPath`], from [`Unfold::path`] (`#[module(paths)]`).
///
/// Printed as PyTorch prints it, except that a size with equal sides shows as one number
/// (`kernel_size=2`) whether it was given as `2` or `(2, 2)` (PyTorch shows what it was given).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Unfold {
    /// The block size `(kH, kW)`.
    pub kernel_size: (usize, usize),
    /// Dilation, padding and stride.
    #[module(skip)]
    pub config: FoldConfig,
}

impl Unfold {
    /// Blocks of `kernel_size` with PyTorch's defaults.
    pub fn new(kernel_size: impl Size<2>) -> Self {
        Self::with_config(kernel_size, FoldConfig::default())
    }

    /// Blocks of `kernel_size` slid as `config` says.
    pub fn with_config(kernel_size: impl Size<2>, config: FoldConfig) -> Self {
        let [kh, kw] = kernel_size.dims();
        Self {
            kernel_size: (kh, kw),
            config,
        }
    }
}

layer_repr!(Unfold, |layer| {
    let size = format!("kernel_size={}", layer.kernel_size.py());
    layer.config.repr_after(size)
});

layer_forward!(Unfold, |layer, x| {
    let [ah, aw] = axes("Unfold", layer.kernel_size, &layer.config)?;
    let (x4, unbatched) = batched(x, 3, 0)?;
    let (n, c, h, w) = match *x4.dims() {
        [n, c, h, w] => (n, c, h, w),
        _ => return Err(input_shape_error("Unfold", "[N, C, H, W] or [C, H, W]", x)),
    };
    let (Some(oh), Some(ow)) = (ah.blocks(h), aw.blocks(w)) else {
        let expected = format!(
            "[N, C, H, W] with room for one {:?} block (padding {:?}, dilation {:?})",
            layer.kernel_size,
            layer.config.padding.hw(),
            layer.config.dilation.hw()
        );
        return Err(input_shape_error("Unfold", expected, x));
    };
    let padded = x4
        .pad_with_zeros(2, ah.padding, ah.padding)?
        .pad_with_zeros(3, aw.padding, aw.padding)?
        .contiguous()?;
    let ids = |positions: Vec<u32>| Tensor::new(positions, x.device());
    let mut blocks = Vec::with_capacity(ah.kernel * aw.kernel);
    for i in 0..ah.kernel {
        let rows =
            padded.index_select(&ids(ah.positions(i, oh).map(|p| p as u32).collect())?, 2)?;
        for j in 0..aw.kernel {
            blocks.push(
                rows.index_select(&ids(aw.positions(j, ow).map(|p| p as u32).collect())?, 3)?,
            );
        }
    }
    let cols = Tensor::stack(&blocks, 2)?.reshape((n, c * ah.kernel * aw.kernel, oh * ow))?;
    Ok(if unbatched { cols.squeeze(0)? } else { cols })
});

/// Sums columns of sliding blocks back into an image: `[N, C · kH · kW, L]` (or
/// `[C · kH · kW, L]`) to `[N, C, H, W]` with `(H, W) = output_size`, PyTorch's
/// `nn.Fold(output_size, kernel_size, dilation=1, padding=0, stride=1)` (col2im). Overlapping
/// blocks add up; `L` must be the number of blocks that fit `output_size`.
///
/// Typed paths into it: [`FoldPath`], from [`Fold::path`] (`#[module(paths)]`).
///
/// Printed as PyTorch prints it, except that a size with equal sides shows as one number
/// (`kernel_size=2`) whether it was given as `2` or `(2, 2)` (PyTorch shows what it was given).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Fold {
    /// The image size `(H, W)`.
    pub output_size: (usize, usize),
    /// The block size `(kH, kW)`.
    pub kernel_size: (usize, usize),
    /// Dilation, padding and stride.
    #[module(skip)]
    pub config: FoldConfig,
}

impl Fold {
    /// An `output_size` image from blocks of `kernel_size`, with PyTorch's defaults.
    pub fn new(output_size: impl Size<2>, kernel_size: impl Size<2>) -> Self {
        Self::with_config(output_size, kernel_size, FoldConfig::default())
    }

    /// An `output_size` image from blocks of `kernel_size` slid as `config` says.
    pub fn with_config(
        output_size: impl Size<2>,
        kernel_size: impl Size<2>,
        config: FoldConfig,
    ) -> Self {
        let ([h, w], [kh, kw]) = (output_size.dims(), kernel_size.dims());
        Self {
            output_size: (h, w),
            kernel_size: (kh, kw),
            config,
        }
    }
}

layer_repr!(Fold, |layer| {
    let sizes = format!(
        "output_size={}, kernel_size={}",
        layer.output_size.py(),
        layer.kernel_size.py()
    );
    layer.config.repr_after(sizes)
});

impl Forward<&Tensor> for Fold {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [ah, aw] = axes("Fold", self.kernel_size, &self.config)?;
        let (h, w) = self.output_size;
        let per_channel = ah.kernel * aw.kernel;
        let (x3, unbatched) = batched(x, 2, 0)?;
        let blocks = ah.blocks(h).zip(aw.blocks(w));
        let (n, rows, len, (oh, ow)) = match (x3.dims(), blocks) {
            (&[n, rows, len], Some(b)) if rows % per_channel == 0 && len == b.0 * b.1 => {
                (n, rows, len, b)
            }
            _ => {
                let expected = format!(
                    "[N, C·{per_channel}, L] with L = {} blocks of {:?} in {:?}",
                    blocks.map_or(0, |(a, b)| a * b),
                    self.kernel_size,
                    self.output_size
                );
                return Err(input_shape_error("Fold", expected, x));
            }
        };
        let c = rows / per_channel;
        let (hp, wp) = (h + 2 * ah.padding, w + 2 * aw.padding);
        let cols = x3.reshape((n, c, per_channel, len))?;
        let mut image = Tensor::zeros((n, c, hp * wp), x.dtype(), x.device())?;
        for i in 0..ah.kernel {
            let rows: Vec<usize> = ah.positions(i, oh).collect();
            for j in 0..aw.kernel {
                let cols_at: Vec<usize> = aw.positions(j, ow).collect();
                let flat: Vec<u32> = rows
                    .iter()
                    .flat_map(|&r| cols_at.iter().map(move |&q| (r * wp + q) as u32))
                    .collect();
                let block = cols
                    .narrow(2, i * aw.kernel + j, 1)?
                    .squeeze(2)?
                    .contiguous()?;
                image = image.index_add(&Tensor::new(flat, x.device())?, &block, 2)?;
            }
        }
        let image = image
            .reshape((n, c, hp, wp))?
            .narrow(2, ah.padding, h)?
            .narrow(3, aw.padding, w)?;
        Ok(if unbatched { image.squeeze(0)? } else { image })
    }
}

forward_by_value!(Unfold, Fold);
