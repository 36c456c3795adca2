//! Resampling: PyTorch's `nn.Upsample` (`nearest`, `nearest-exact`, `linear`, `bilinear`,
//! `bicubic` and `trilinear`, to a `size` or by a `scale_factor`, with or without
//! `align_corners`), and the
//! older `UpsamplingNearest2d` / `UpsamplingBilinear2d` as constructors of it.
//!
//! # How it runs
//!
//! Every mode is separable, so the layer resamples one spatial dimension at a time. Nearest
//! neighbours are a gather of input positions (`index_select`); linear and cubic interpolation are
//! a product with a `[in, out]` matrix holding each output's two (or four) weights. Both are
//! ordinary differentiable
//! candle ops on any device, so the gradient is PyTorch's (the sum of each input position's shares).
//! Source positions and weights are computed as PyTorch's CPU kernels compute them
//! (`aten/src/ATen/native/UpSample.h`: `nearest_idx`, `area_pixel_compute_scale`,
//! `area_pixel_compute_source_index`, `guard_index_and_lambda`), in float32, so even the rounding
//! of a fractional `scale_factor` matches.

use candle_core::{DType, Tensor};
use module_core::{py_float, py_tuple, ExtraRepr};

use crate::common::{forward_by_value, input_shape_error};
use crate::error::Result;
use crate::{Forward, Module};

/// How [`Upsample`] computes each output value (PyTorch's `mode` and `align_corners`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UpsampleMode {
    /// The input value at `floor(out_index · scale)` (PyTorch's `'nearest'`, the default).
    #[default]
    Nearest,
    /// The input value at `floor((out_index + 0.5) · scale)` (PyTorch's `'nearest-exact'`).
    NearestExact,
    /// Linear interpolation of a `[N, C, L]` input (PyTorch's `'linear'`).
    Linear {
        /// Whether the corner pixels of input and output are aligned (PyTorch's `align_corners`).
        align_corners: bool,
    },
    /// Bilinear interpolation of a `[N, C, H, W]` input (PyTorch's `'bilinear'`).
    Bilinear {
        /// Whether the corner pixels of input and output are aligned (PyTorch's `align_corners`).
        align_corners: bool,
    },
    /// Trilinear interpolation of a `[N, C, D, H, W]` input (PyTorch's `'trilinear'`).
    Trilinear {
        /// Whether the corner pixels of input and output are aligned (PyTorch's `align_corners`).
        align_corners: bool,
    },
    /// Bicubic interpolation of a `[N, C, H, W]` input (PyTorch's `'bicubic'`: Keys' cubic
    /// convolution with `A = -0.75`, edge pixels repeated). Values may overshoot the input's range,
    /// as in PyTorch.
    Bicubic {
        /// Whether the corner pixels of input and output are aligned (PyTorch's `align_corners`).
        align_corners: bool,
    },
}

impl UpsampleMode {
    /// PyTorch's name of the mode (`'bilinear'`).
    fn py_name(self) -> &'static str {
        match self {
            Self::Nearest => "nearest",
            Self::NearestExact => "nearest-exact",
            Self::Linear { .. } => "linear",
            Self::Bilinear { .. } => "bilinear",
            Self::Trilinear { .. } => "trilinear",
            Self::Bicubic { .. } => "bicubic",
        }
    }

    /// The input rank an interpolating mode takes (`None` for the nearest modes, which take 3 to
    /// 5), and its `align_corners`.
    fn linear(self) -> Option<(usize, bool)> {
        match self {
            Self::Nearest | Self::NearestExact => None,
            Self::Linear { align_corners } => Some((3, align_corners)),
            Self::Bilinear { align_corners } | Self::Bicubic { align_corners } => {
                Some((4, align_corners))
            }
            Self::Trilinear { align_corners } => Some((5, align_corners)),
        }
    }
}

/// The output size of an [`Upsample`]: PyTorch's `size` or `scale_factor` (exactly one of them,
/// which this enum makes sure of). One value applies to every spatial dimension; otherwise give one
/// per spatial dimension.
#[derive(Clone, Debug, PartialEq)]
pub enum UpsampleTarget {
    /// The output's spatial size.
    Size(Vec<usize>),
    /// The factor each spatial size is multiplied by; the output size is rounded down, and the
    /// factor itself (not the ratio of the sizes) places the samples, as in PyTorch.
    ScaleFactor(Vec<f64>),
}

/// Upsamples (or downsamples) the spatial dimensions of `[N, C, *]`: PyTorch's
/// `nn.Upsample(size=None, scale_factor=None, mode='nearest', align_corners=None)`.
///
/// The input is `[N, C, L]`, `[N, C, H, W]` or `[N, C, D, H, W]` (the linear modes take the one
/// rank their name says); another rank, a target with another number of sizes, or an empty output
/// is an [`Error::InputShape`](crate::Error::InputShape). See the module docs for how it runs.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Upsample, UpsampleMode};
/// let x = Tensor::new(&[[[[1f32, 2.], [3., 4.]]]], &Device::Cpu)?; // [1, 1, 2, 2]
/// let nearest = Upsample::scale_factor(2.0, UpsampleMode::Nearest).call(&x)?;
/// assert_eq!(nearest.dims(), [1, 1, 4, 4]);
/// assert_eq!(nearest.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?[0], [1., 1., 2., 2.]);
/// let bilinear = UpsampleMode::Bilinear { align_corners: true };
/// let smooth = Upsample::size([3, 3], bilinear).call(&x)?;
/// assert_eq!(smooth.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?[1], [2., 2.5, 3.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Printed as PyTorch prints it, `Upsample(scale_factor=2.0, mode='nearest')` or
/// `Upsample(size=(4, 5), mode='bilinear')`; the layers built by
/// [`upsampling_nearest2d`](Self::upsampling_nearest2d) and
/// [`upsampling_bilinear2d`](Self::upsampling_bilinear2d) print as `Upsample` too.
///
/// Typed paths into it: [`UpsamplePath`], from [`Upsample::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Upsample {
    /// The output size, or the factor it is computed from.
    #[module(skip)]
    pub target: UpsampleTarget,
    /// How output values are computed.
    #[module(skip)]
    pub mode: UpsampleMode,
}

impl Upsample {
    /// Resamples to `target` as `mode` says.
    pub fn new(target: UpsampleTarget, mode: UpsampleMode) -> Self {
        Self { target, mode }
    }

    /// Multiplies every spatial size by `factor` (PyTorch's `scale_factor=factor`).
    pub fn scale_factor(factor: f64, mode: UpsampleMode) -> Self {
        Self::new(UpsampleTarget::ScaleFactor(vec![factor]), mode)
    }

    /// Resamples to the spatial size `size` (PyTorch's `size=...`; one value for all dimensions or
    /// one per dimension).
    pub fn size(size: impl Into<Vec<usize>>, mode: UpsampleMode) -> Self {
        Self::new(UpsampleTarget::Size(size.into()), mode)
    }

    /// PyTorch's `nn.UpsamplingNearest2d(size, scale_factor)`: nearest neighbours.
    pub fn upsampling_nearest2d(target: UpsampleTarget) -> Self {
        Self::new(target, UpsampleMode::Nearest)
    }

    /// PyTorch's `nn.UpsamplingBilinear2d(size, scale_factor)`: bilinear with aligned corners.
    pub fn upsampling_bilinear2d(target: UpsampleTarget) -> Self {
        let mode = UpsampleMode::Bilinear {
            align_corners: true,
        };
        Self::new(target, mode)
    }

    /// The output size and the scale factor (if given) of each spatial dimension of `in_sizes`.
    fn plan(&self, in_sizes: &[usize]) -> Option<Vec<(usize, Option<f64>)>> {
        let pick = |n: usize, i: usize| {
            if n == 1 {
                Some(0)
            } else {
                (n == in_sizes.len()).then_some(i)
            }
        };
        in_sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| match &self.target {
                UpsampleTarget::Size(s) => Some((s[pick(s.len(), i)?], None)),
                UpsampleTarget::ScaleFactor(f) => {
                    let f = f[pick(f.len(), i)?];
                    let out = (size as f64 * f).floor();
                    // Finite and addressable; NaN fails the comparison.
                    (f > 0.0 && out < u32::MAX as f64).then_some((out as usize, Some(f)))
                }
            })
            .collect()
    }
}

/// PyTorch's `compute_scales_value<float>`: `1 / scale_factor` if given, else `in / out`.
fn scale_value(scale: Option<f64>, input: usize, output: usize) -> f32 {
    match scale {
        Some(s) if s > 0.0 => (1.0 / s) as f32,
        _ => input as f32 / output as f32,
    }
}

/// How far apart in the input two neighbouring output positions read, for the interpolating
/// modes: with `align_corners` the corner pixels align; otherwise as [`scale_value`].
fn source_ratio(input: usize, output: usize, scale: Option<f64>, align_corners: bool) -> f32 {
    match (align_corners, output > 1) {
        (false, _) => scale_value(scale, input, output),
        (true, true) => (input - 1) as f32 / (output - 1) as f32,
        (true, false) => 0.0,
    }
}

/// The input position each output position reads (PyTorch's `nearest_idx` and its `-exact` twin).
fn nearest_sources(input: usize, output: usize, scale: Option<f64>, exact: bool) -> Vec<u32> {
    let s = scale_value(scale, input, output);
    (0..output)
        .map(|dst| {
            let src = if exact {
                ((dst as f32 + 0.5) * s).floor() as usize
            } else if output == input {
                dst
            } else if output == 2 * input {
                dst >> 1
            } else {
                (dst as f32 * s).floor() as usize
            };
            src.min(input - 1) as u32
        })
        .collect()
}

/// The `[input, output]` matrix of bicubic interpolation weights (ATen's
/// `upsample_bicubic2d`: `area_pixel_compute_source_index` without the clamp at 0, then
/// `get_cubic_upsample_coefficients` with `A = -0.75` over four taps, clamped to the input).
fn cubic_weights(input: usize, output: usize, scale: Option<f64>, align_corners: bool) -> Vec<f32> {
    const A: f32 = -0.75;
    let near = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let far = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    let ratio = source_ratio(input, output, scale, align_corners);
    let mut m = vec![0f32; input * output];
    for dst in 0..output {
        let real = if align_corners {
            ratio * dst as f32
        } else {
            ratio * (dst as f32 + 0.5) - 0.5
        };
        let start = real.floor();
        let t = real - start;
        let coefficients = [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)];
        for (k, c) in coefficients.into_iter().enumerate() {
            let src = (start as isize - 1 + k as isize).clamp(0, input as isize - 1) as usize;
            m[src * output + dst] += c;
        }
    }
    m
}

/// The `[input, output]` matrix of linear interpolation weights (PyTorch's
/// `compute_source_index_and_lambda`).
fn linear_weights(
    input: usize,
    output: usize,
    scale: Option<f64>,
    align_corners: bool,
) -> Vec<f32> {
    let mut m = vec![0f32; input * output];
    let ratio = source_ratio(input, output, scale, align_corners);
    for dst in 0..output {
        let (i0, i1, l0, l1) = if input == output {
            (dst, dst, 1.0, 0.0)
        } else {
            let real = if align_corners {
                ratio * dst as f32
            } else {
                (ratio * (dst as f32 + 0.5) - 0.5).max(0.0)
            };
            let i0 = (real.floor() as usize).min(input - 1);
            let l1 = (real - i0 as f32).clamp(0.0, 1.0);
            let i1 = i0 + usize::from(i0 < input - 1);
            (i0, i1, 1.0 - l1, l1)
        };
        m[i0 * output + dst] += l0;
        m[i1 * output + dst] += l1;
    }
    m
}

impl Forward<&Tensor> for Upsample {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rank = x.rank();
        let rank_ok = match self.mode.linear() {
            Some((r, _)) => rank == r,
            None => (3..=5).contains(&rank),
        };
        let in_sizes = x.dims().get(2..).unwrap_or_default();
        let non_empty = in_sizes.iter().all(|&size| size > 0);
        let plan = self
            .plan(in_sizes)
            .filter(|p| non_empty && p.iter().all(|&(out, _)| out > 0));
        let (true, Some(plan)) = (rank_ok, plan) else {
            let expected = match self.mode.linear() {
                Some((r, _)) => format!("rank {r} ([N, C, *] with {} spatial dimensions)", r - 2),
                None => "[N, C, L], [N, C, H, W] or [N, C, D, H, W]".to_owned(),
            };
            let expected = format!(
                "{expected}, for {:?} (non-empty input and output)",
                self.target
            );
            return Err(input_shape_error("Upsample", expected, x));
        };
        let mut y = x.clone();
        for (i, (&input, (output, scale))) in in_sizes.iter().zip(plan).enumerate() {
            let dim = 2 + i;
            y = match self.mode.linear() {
                None => {
                    let exact = self.mode == UpsampleMode::NearestExact;
                    let ids = nearest_sources(input, output, scale, exact);
                    y.contiguous()?
                        .index_select(&Tensor::new(ids, y.device())?, dim)?
                }
                Some((_, align_corners)) => {
                    let w = if matches!(self.mode, UpsampleMode::Bicubic { .. }) {
                        cubic_weights(input, output, scale, align_corners)
                    } else {
                        linear_weights(input, output, scale, align_corners)
                    };
                    let w = Tensor::from_vec(w, (input, output), y.device())?;
                    let w = if y.dtype() == DType::F32 {
                        w
                    } else {
                        w.to_dtype(y.dtype())?
                    };
                    let last = rank - 1;
                    let moved = y.transpose(dim, last)?.contiguous()?;
                    moved.broadcast_matmul(&w)?.transpose(dim, last)?
                }
            };
        }
        Ok(y)
    }
}

/// One value as Python's scalar, several as a tuple (`2.0`, `(2.0, 3.0)`).
fn scalar_or_tuple<T: ToString>(values: &[T]) -> String {
    match values {
        [one] => one.to_string(),
        many => py_tuple(&many.iter().map(T::to_string).collect::<Vec<_>>()),
    }
}

impl ExtraRepr for Upsample {
    fn extra_repr(&self) -> String {
        let target = match &self.target {
            UpsampleTarget::Size(size) => format!("size={}", scalar_or_tuple(size)),
            UpsampleTarget::ScaleFactor(factors) => {
                let factors: Vec<String> = factors.iter().map(|&f| py_float(f)).collect();
                format!("scale_factor={}", scalar_or_tuple(&factors))
            }
        };
        format!("{target}, mode='{}'", self.mode.py_name())
    }
}

forward_by_value!(Upsample);
