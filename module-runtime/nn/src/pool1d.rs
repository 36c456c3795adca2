//! 1-D pooling (`MaxPool1d`, `AvgPool1d`) and power-average pooling (`LPPool1d`, `LPPool2d`),
//! computed by [`Pool2d`] over a unit height.

use std::marker::PhantomData;

use candle_core::Tensor;

use crate::common::input_shape_error;
use crate::error::{Error, Result};
use crate::pool::{Avg, AvgPool2d, Max, Pool2d, Pool2dConfig, Reduction};
use crate::{Forward, Module};
use module_core::{py_bool, py_float, ExtraRepr};

/// How a [`MaxPool1d`] or [`AvgPool1d`] is built: PyTorch's keyword arguments and defaults
/// (stride = window, no padding or dilation, floor mode, padding counted in averages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool1dConfig {
    /// Step between windows; `None` (the default) is the window size.
    pub stride: Option<usize>,
    /// Implicit padding on both sides (default 0), at most half the window.
    pub padding: usize,
    /// Spacing between a window's elements (default 1; `MaxPool1d` only).
    pub dilation: usize,
    /// Whether the output size rounds up (default `false`).
    pub ceil_mode: bool,
    /// `AvgPool1d` only: whether padding counts in a window's divisor (default `true`).
    pub count_include_pad: bool,
}

impl Default for Pool1dConfig {
    fn default() -> Self {
        Self {
            stride: None,
            padding: 0,
            dilation: 1,
            ceil_mode: false,
            count_include_pad: true,
        }
    }
}

/// A reduction `R` over windows of a `[N, C, L]` (or `[C, L]`) input: PyTorch's `nn.MaxPool1d`
/// ([`MaxPool1d`]) and `nn.AvgPool1d` ([`AvgPool1d`]), with their options ([`Pool1dConfig`]).
/// It runs as the [`Pool2d`] of the same reduction over a unit height, so the outputs, gradients
/// and options are those of `MaxPool2d`/`AvgPool2d`, and errors name the 1-D layer.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{MaxPool1d, Pool1dConfig};
/// let x = Tensor::new(&[[[1f32, 3., 2., 5., 4.]]], &Device::Cpu)?;
/// let pool = MaxPool1d::with_config(2, Pool1dConfig { stride: Some(1), ..Default::default() });
/// assert_eq!(pool.call(&x)?.flatten_all()?.to_vec1::<f32>()?, [3., 3., 5., 5.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(extra_repr)]
#[module(bound = "R: Reduction", class_name = R::LAYER_1D)]
pub struct Pool1d<R> {
    /// Window size.
    pub kernel_size: usize,
    /// Step between windows.
    pub stride: usize,
    /// Implicit padding on both sides.
    pub padding: usize,
    /// Spacing between a window's elements (`MaxPool1d` only).
    pub dilation: usize,
    /// Whether the output size rounds up.
    pub ceil_mode: bool,
    /// Whether padding counts in an average's divisor (`AvgPool1d` only).
    pub count_include_pad: bool,
    #[module(skip)]
    reduction: PhantomData<R>,
}

/// PyTorch's `nn.MaxPool1d`. See [`Pool1d`].
pub type MaxPool1d = Pool1d<Max>;
/// PyTorch's `nn.AvgPool1d`. See [`Pool1d`].
pub type AvgPool1d = Pool1d<Avg>;

impl<R: Reduction> Pool1d<R> {
    /// Windows of `kernel_size`, moved by their own size.
    pub fn new(kernel_size: usize) -> Self {
        Self::with_config(kernel_size, Pool1dConfig::default())
    }

    /// Windows of `kernel_size`, moved, padded and counted as `config` says (checked when the
    /// layer runs, as PyTorch checks at the call).
    pub fn with_config(kernel_size: usize, config: Pool1dConfig) -> Self {
        Self {
            kernel_size,
            stride: config.stride.unwrap_or(kernel_size),
            padding: config.padding,
            dilation: config.dilation,
            ceil_mode: config.ceil_mode,
            count_include_pad: config.count_include_pad,
            reduction: PhantomData,
        }
    }

    fn layer() -> &'static str {
        if R::AVERAGE {
            "AvgPool1d"
        } else {
            "MaxPool1d"
        }
    }
}

impl<R: Reduction> Forward<&Tensor> for Pool1d<R> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let pool = Pool2d::<R>::with_config(
            (1, self.kernel_size),
            Pool2dConfig {
                stride: Some((1, self.stride).into()),
                padding: (0, self.padding).into(),
                dilation: (1, self.dilation).into(),
                ceil_mode: self.ceil_mode,
                count_include_pad: self.count_include_pad,
                divisor_override: None,
            },
        );
        pool_over_unit_height(
            x,
            Self::layer(),
            |x| pool.forward(x),
            || {
                format!(
                "[N, C, L] or [C, L] large enough for kernel_size {} (dilation {}, padding {}) \
                 to give an output of at least 1",
                self.kernel_size, self.dilation, self.padding
            )
            },
        )
    }
}

/// `pool` (a 2-D pool) over `x` (`[N, C, L]` or `[C, L]`) given a unit height; its errors name
/// `layer` and the 1-D shapes it takes.
fn pool_over_unit_height(
    x: &Tensor,
    layer: &'static str,
    pool: impl Fn(&Tensor) -> Result<Tensor>,
    expected: impl Fn() -> String,
) -> Result<Tensor> {
    if x.rank() != 2 && x.rank() != 3 {
        return Err(input_shape_error(layer, expected(), x));
    }
    let at = x.rank() - 1;
    match pool(&x.unsqueeze(at)?) {
        Ok(y) => Ok(y.squeeze(at)?),
        Err(Error::InputShape { .. }) => Err(input_shape_error(layer, expected(), x)),
        Err(Error::InvalidConfig { message, .. }) => Err(Error::InvalidConfig { layer, message }),
        Err(e) => Err(e),
    }
}

/// Power-average pooling over `D` dimensions: PyTorch's `nn.LPPool1d` ([`LPPool1d`]) and
/// `nn.LPPool2d` ([`LPPool2d`]): `(Σ x^p)^(1/p)` over each window, computed as PyTorch does, the
/// window's average of `x^p` times its size, to the power `1/p` (so a window with a negative sum
/// of odd powers is NaN, as there). No padding.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::LPPool1d;
/// let x = Tensor::new(&[[[3f32, 4., 1., 1.]]], &Device::Cpu)?;
/// let y = LPPool1d::new(2.0, 2).call(&x)?; // the L2 norm of each window
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5., 2f32.sqrt()]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(extra_repr)]
#[module(class_name = format!("LPPool{D}d"))]
pub struct LpPool<const D: usize> {
    /// The power `p`.
    pub norm_type: f64,
    /// Window size per dimension.
    pub kernel_size: [usize; D],
    /// Step between windows per dimension; `None` (PyTorch's default) is the window size.
    pub stride: Option<[usize; D]>,
    /// Whether the output size rounds up.
    pub ceil_mode: bool,
}

/// PyTorch's `nn.LPPool1d`: `[N, C, L]` or `[C, L]`. See [`LpPool`].
pub type LPPool1d = LpPool<1>;
/// PyTorch's `nn.LPPool2d`: `[N, C, H, W]` or `[C, H, W]`. See [`LpPool`].
pub type LPPool2d = LpPool<2>;

impl<const D: usize> LpPool<D> {
    /// Windows of `kernel_size` in every dimension, moved by their own size, floor mode.
    pub fn new(norm_type: f64, kernel_size: usize) -> Self {
        Self {
            norm_type,
            kernel_size: [kernel_size; D],
            stride: None,
            ceil_mode: false,
        }
    }

    fn layer() -> &'static str {
        if D == 1 {
            "LPPool1d"
        } else {
            "LPPool2d"
        }
    }
}

impl<const D: usize> Forward<&Tensor> for LpPool<D> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let pair = |v: [usize; D]| if D == 1 { (1, v[0]) } else { (v[0], v[D - 1]) };
        let stride = self.stride.unwrap_or(self.kernel_size);
        let (kernel, stride) = (pair(self.kernel_size), pair(stride));
        let avg = AvgPool2d::with_config(
            kernel,
            Pool2dConfig {
                stride: Some(stride.into()),
                ceil_mode: self.ceil_mode,
                ..Default::default()
            },
        );
        let p = self.norm_type;
        let powered = x.powf(p)?;
        let mean = if D == 1 {
            let expected = || format!("[N, C, L] or [C, L] of at least kernel_size {kernel:?}");
            pool_over_unit_height(&powered, Self::layer(), |x| avg.forward(x), expected)?
        } else {
            avg.forward(&powered).map_err(|e| match e {
                Error::InputShape { expected, got, .. } => Error::InputShape {
                    layer: Self::layer(),
                    expected,
                    got,
                },
                e => e,
            })?
        };
        Ok(((mean * (kernel.0 * kernel.1) as f64)?.powf(1.0 / p))?)
    }
}

impl<R: Reduction> ExtraRepr for Pool1d<R> {
    /// PyTorch's text: `MaxPool1d` shows plain numbers, `AvgPool1d` one-element tuples.
    fn extra_repr(&self) -> String {
        if R::AVERAGE {
            format!(
                "kernel_size=({},), stride=({},), padding=({},)",
                self.kernel_size, self.stride, self.padding
            )
        } else {
            format!(
                "kernel_size={}, stride={}, padding={}, dilation={}, ceil_mode={}",
                self.kernel_size,
                self.stride,
                self.padding,
                self.dilation,
                py_bool(self.ceil_mode)
            )
        }
    }
}

impl<const D: usize> ExtraRepr for LpPool<D> {
    /// A whole `norm_type` shows as an integer, as PyTorch shows the `int` it is usually given.
    fn extra_repr(&self) -> String {
        let p = self.norm_type;
        let norm = if p.fract() == 0.0 && p.abs() < 1e15 {
            format!("{}", p as i64)
        } else {
            py_float(p)
        };
        let sizes = |v: &[usize; D]| {
            if v.iter().all(|&x| x == v[0]) {
                v[0].to_string()
            } else {
                let all: Vec<String> = v.iter().map(usize::to_string).collect();
                format!("({})", all.join(", "))
            }
        };
        let stride = self.stride.as_ref().map_or("None".to_owned(), sizes);
        format!(
            "norm_type={norm}, kernel_size={}, stride={stride}, ceil_mode={}",
            sizes(&self.kernel_size),
            py_bool(self.ceil_mode)
        )
    }
}
