//! Adaptive pooling: `AdaptiveAvgPool1d`, `AdaptiveAvgPool2d`, `AdaptiveMaxPool1d`,
//! `AdaptiveMaxPool2d` (one type, [`AdaptivePool`], over `D` spatial dimensions, with the
//! reduction as its parameter): the window sizes follow from the output size asked for.

use std::marker::PhantomData;

use candle_core::Tensor;

use crate::common::input_shape_error;
use crate::error::Result;
use crate::pool::{Avg, Max};
use crate::{Forward, Module};
use module_core::ExtraRepr;

/// How [`AdaptivePool`] reduces a window: the mean ([`Avg`]) or the maximum ([`Max`]).
pub trait AdaptiveReduction: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// PyTorch's class names for one and two spatial dimensions.
    const LAYERS: [&'static str; 2];
    /// The reduction of `x` along `dim`, keeping it.
    fn reduce(x: &Tensor, dim: usize) -> Result<Tensor>;
}

impl AdaptiveReduction for Avg {
    const LAYERS: [&'static str; 2] = ["AdaptiveAvgPool1d", "AdaptiveAvgPool2d"];
    fn reduce(x: &Tensor, dim: usize) -> Result<Tensor> {
        Ok(x.mean_keepdim(dim)?)
    }
}

impl AdaptiveReduction for Max {
    const LAYERS: [&'static str; 2] = ["AdaptiveMaxPool1d", "AdaptiveMaxPool2d"];
    fn reduce(x: &Tensor, dim: usize) -> Result<Tensor> {
        Ok(x.max_keepdim(dim)?)
    }
}

/// Pooling to a given output size over the last `D` dimensions: PyTorch's
/// `nn.AdaptiveAvgPool1d/2d` ([`AdaptiveAvgPool1d`], [`AdaptiveAvgPool2d`]) and
/// `nn.AdaptiveMaxPool1d/2d` ([`AdaptiveMaxPool1d`], [`AdaptiveMaxPool2d`]).
///
/// Output index `i` of a dimension of input size `I` and output size `O` reduces the window
/// `[floor(i I / O), ceil((i + 1) I / O))`, as PyTorch's kernels do (windows overlap when `O`
/// does not divide `I`). An output size of `None` keeps the input's size in that dimension. The
/// input is `[N, C, *D]` or `[C, *D]`. The two dimensions of a 2-D pool are reduced one after
/// the other (a window is a rectangle, so its mean is the mean of its rows' means and its maximum
/// the maximum of theirs), composed of differentiable ops. No parameters. `return_indices` is not
/// supported.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{AdaptiveAvgPool2d, AdaptiveMaxPool1d};
/// let x = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((1, 2, 3, 4))?;
/// // Global average pooling, as torchvision's classifiers end.
/// let y = AdaptiveAvgPool2d::new(1).call(&x)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5.5, 17.5]);
/// let m = AdaptiveMaxPool1d::new(2).call(&Tensor::new(&[[1f32, 5., 2., 4., 3.]], &Device::Cpu)?)?;
/// assert_eq!(m.to_vec2::<f32>()?, [[5., 4.]]); // windows [0, 3) and [2, 5)
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(extra_repr)]
#[module(bound = "R: AdaptiveReduction", class_name = R::LAYERS[D.clamp(1, 2) - 1])]
pub struct AdaptivePool<const D: usize, R> {
    /// The output size per spatial dimension; `None` keeps the input's.
    pub output_size: [Option<usize>; D],
    #[module(skip)]
    reduction: PhantomData<R>,
}

/// PyTorch's `nn.AdaptiveAvgPool1d`. See [`AdaptivePool`].
pub type AdaptiveAvgPool1d = AdaptivePool<1, Avg>;
/// PyTorch's `nn.AdaptiveAvgPool2d`. See [`AdaptivePool`].
pub type AdaptiveAvgPool2d = AdaptivePool<2, Avg>;
/// PyTorch's `nn.AdaptiveMaxPool1d`. See [`AdaptivePool`].
pub type AdaptiveMaxPool1d = AdaptivePool<1, Max>;
/// PyTorch's `nn.AdaptiveMaxPool2d`. See [`AdaptivePool`].
pub type AdaptiveMaxPool2d = AdaptivePool<2, Max>;

/// An adaptive pool's output size: one size for every dimension, one per dimension, or one
/// optional size per dimension (`None` keeps the input's).
pub trait OutputSize<const D: usize> {
    /// The size per dimension.
    fn sizes(self) -> [Option<usize>; D];
}

impl<const D: usize> OutputSize<D> for usize {
    fn sizes(self) -> [Option<usize>; D] {
        [Some(self); D]
    }
}

impl<const D: usize> OutputSize<D> for [Option<usize>; D] {
    fn sizes(self) -> [Option<usize>; D] {
        self
    }
}

impl OutputSize<2> for (usize, usize) {
    fn sizes(self) -> [Option<usize>; 2] {
        [Some(self.0), Some(self.1)]
    }
}

impl OutputSize<2> for (Option<usize>, Option<usize>) {
    fn sizes(self) -> [Option<usize>; 2] {
        [self.0, self.1]
    }
}

impl<const D: usize, R: AdaptiveReduction> AdaptivePool<D, R> {
    /// A pool to `output_size`: `7`, `(7, 7)`, or `(None, 7)` as PyTorch takes it.
    pub fn new(output_size: impl OutputSize<D>) -> Self {
        Self {
            output_size: output_size.sizes(),
            reduction: PhantomData,
        }
    }

    /// Reduces dimension `dim` of `x` (input size `n`) to `out` windows.
    fn pool_dim(x: &Tensor, dim: usize, out: usize) -> Result<Tensor> {
        let n = x.dim(dim)?;
        if out == n {
            return Ok(x.clone());
        }
        let windows = (0..out)
            .map(|i| {
                let (start, end) = (i * n / out, ((i + 1) * n).div_ceil(out));
                R::reduce(&x.narrow(dim, start, end - start)?, dim)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&windows, dim)?)
    }
}

impl<const D: usize, R: AdaptiveReduction> Forward<&Tensor> for AdaptivePool<D, R> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rank = x.rank();
        let fits = (rank == D + 1 || rank == D + 2)
            && x.dims()[rank - D..].iter().all(|&s| s > 0)
            && self.output_size.iter().all(|o| *o != Some(0));
        if !fits {
            let spatial = if D == 1 { "L" } else { "H, W" };
            let expected = format!(
                "[N, C, {spatial}] or [C, {spatial}] with non-empty spatial dimensions, for an \
                 output size of {:?}",
                self.output_size
            );
            return Err(input_shape_error(R::LAYERS[D.clamp(1, 2) - 1], expected, x));
        }
        let mut y = x.clone();
        for (k, out) in self.output_size.iter().enumerate() {
            let dim = rank - D + k;
            y = Self::pool_dim(&y, dim, out.unwrap_or(x.dim(dim)?))?;
        }
        Ok(y)
    }
}

impl<const D: usize, R> ExtraRepr for AdaptivePool<D, R> {
    /// `output_size=(3, 4)`, one number when every dimension has the same size (as PyTorch shows
    /// an `int`), `None` for a kept dimension.
    fn extra_repr(&self) -> String {
        let show = |o: &Option<usize>| o.map_or("None".to_owned(), |n| n.to_string());
        let first = &self.output_size[0];
        let size = if self.output_size.iter().all(|o| o == first) && first.is_some() {
            show(first)
        } else {
            let all: Vec<String> = self.output_size.iter().map(show).collect();
            format!("({})", all.join(", "))
        };
        format!("output_size={size}")
    }
}
