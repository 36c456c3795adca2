//! Fused inference passes: the activation after a layer applied in place in the layer's output,
//! or a residual sum and the norm after it in one pass, instead of one pass (and one fresh output)
//! per operation.
//!
//! They run only during CPU float32 inference ([`no_grad`](crate::no_grad) or frozen parameters,
//! so nothing records a gradient), with no hooks attached (hooks must see each module's own output)
//! and with fusion enabled ([`without_fusion`] turns it off, to compare or to measure). Everywhere
//! else the layers take their unfused path, which the fused one matches within float32 rounding:
//! the activation applied in place after a `Linear` ([`Linear::call_then`](crate::Linear::call_then):
//! the layer's output is the same, the bias already added inside its product), and the residual
//! sum and norm ([`LayerNorm::call_residual`](crate::LayerNorm::call_residual)).

use std::cell::Cell;

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use crate::common::{f32_slice, f32_slice_mut, is_plain_cpu_f32};
use crate::error::Result;
use crate::fused_grad::{block_len, par_map};
use crate::{Forward, Module};

thread_local! {
    static FUSION_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether the runtime's layers may fuse passes on this thread (`true` unless inside
/// [`without_fusion`]).
pub fn is_fusion_enabled() -> bool {
    FUSION_ENABLED.with(Cell::get)
}

/// Runs `f` with fusion off on this thread: every layer takes its unfused path, composed of candle
/// ops, both the fused inference passes here and the fused training passes (single ops with a
/// one-pass backward, which Linear, LayerNorm, GELU, Softmax and Dropout take when a gradient is
/// recorded). For comparing numerics and measuring what fusion gains; the previous mode is restored
/// when `f` returns or panics.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{without_fusion, Linear, GELU};
///
/// let fc = Linear::new(4, 8, &Device::Cpu)?;
/// let x = Tensor::randn(0f32, 1., (3, 4), &Device::Cpu)?;
/// let _inference = module_runtime::no_grad();
/// let fused = fc.call_then(&x, &GELU::new())?;
/// let unfused = without_fusion(|| fc.call_then(&x, &GELU::new()))?;
/// assert_eq!(fused.to_vec2::<f32>()?, unfused.to_vec2::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn without_fusion<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            FUSION_ENABLED.with(|e| e.set(self.0));
        }
    }
    let _restore = Restore(FUSION_ENABLED.with(|e| e.replace(false)));
    f()
}

/// Whether a fused pass may replace a layer's calls now: fusion is on and no hook is attached.
pub(crate) fn fusion_applies() -> bool {
    is_fusion_enabled() && !crate::hooks::dispatch::active()
}

/// An elementwise activation function that a fused pass can apply, computed exactly as the
/// runtime's activation layer computes it during CPU float32 inference.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elementwise {
    /// [`ReLU`](crate::ReLU): `max(x, 0)`.
    Relu,
    /// The exact [`GELU`](crate::GELU), with its vectorized `erf`.
    GeluErf,
    /// The tanh-approximated [`GELU`](crate::GELU).
    GeluTanh,
    /// [`SiLU`](crate::SiLU): `x / (1 + e⁻ˣ)`, with its vectorized `exp`.
    Silu,
    /// [`Sigmoid`](crate::Sigmoid): `1 / (e⁻ˣ + 1)`.
    Sigmoid,
    /// [`Tanh`](crate::Tanh).
    Tanh,
}

// The tanh GELU's constant, as candle writes it (`SQRT_TWO_OVER_PI_F32`), so the result is candle's
// bit for bit.
#[allow(clippy::excessive_precision)]
const SQRT_TWO_OVER_PI: f32 = 0.79788456080286535587989211986876373;

impl Elementwise {
    /// `f(x)` in float32: the same formula, operation for operation, as the layer's CPU float32
    /// inference path (candle's scalar kernels, or the runtime's vectorized exact GELU and
    /// SiLU), so a fused pass gives the unfused pass's bits.
    ///
    /// ```
    /// use module_runtime::nn::Elementwise;
    /// assert_eq!(Elementwise::Relu.apply_f32(-2.0), 0.0);
    /// assert_eq!(Elementwise::Sigmoid.apply_f32(0.0), 0.5);
    /// ```
    #[inline(always)]
    pub fn apply_f32(self, x: f32) -> f32 {
        match self {
            Self::Relu => x.max(0.0),
            Self::GeluErf => crate::activation::gelu_erf_vectorized(x),
            Self::GeluTanh => {
                0.5 * x * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x * x)))
            }
            Self::Silu => crate::vector_exp::silu_vectorized(x),
            Self::Sigmoid => ((-x).exp() + 1.0).recip(),
            Self::Tanh => x.tanh(),
        }
    }
}

mod sealed {
    /// Keeps [`ElementwiseActivation`](super::ElementwiseActivation) to the runtime's activations,
    /// whose forward the fused pass is known to reproduce.
    pub trait Sealed {}
}

/// An activation layer that [`Linear::call_then`](crate::Linear::call_then) can apply in place in
/// the layer's output: [`ReLU`](crate::ReLU), [`GELU`](crate::GELU) (exact or tanh),
/// [`SiLU`](crate::SiLU), [`Sigmoid`](crate::Sigmoid), [`Tanh`](crate::Tanh), and
/// [`Activation`](crate::Activation) holding one of those (holding a softmax, it runs unfused).
pub trait ElementwiseActivation:
    sealed::Sealed + Module + for<'a> Forward<&'a Tensor, Output = Tensor>
{
    /// The layer's function, if it is elementwise.
    fn elementwise(&self) -> Option<Elementwise>;
}

macro_rules! elementwise_activation {
    ($($ty:ty => |$s:ident| $f:expr),* $(,)?) => {$(
        impl sealed::Sealed for $ty {}

        impl ElementwiseActivation for $ty {
            fn elementwise(&self) -> Option<Elementwise> {
                let $s = self;
                $f
            }
        }
    )*};
}

use crate::{Activation, GeluApproximation, ReLU, SiLU, Sigmoid, Tanh, GELU};

elementwise_activation! {
    ReLU => |_s| Some(Elementwise::Relu),
    GELU => |s| Some(match s.approximate {
        GeluApproximation::None => Elementwise::GeluErf,
        GeluApproximation::Tanh => Elementwise::GeluTanh,
    }),
    SiLU => |_s| Some(Elementwise::Silu),
    Sigmoid => |_s| Some(Elementwise::Sigmoid),
    Tanh => |_s| Some(Elementwise::Tanh),
    Activation => |s| match s {
        Activation::Relu(m) => m.elementwise(),
        Activation::Gelu(m) => m.elementwise(),
        Activation::Silu(m) => m.elementwise(),
        Activation::Sigmoid(m) => m.elementwise(),
        Activation::Tanh(m) => m.elementwise(),
        Activation::Softmax(_) | Activation::LogSoftmax(_) => None,
    },
}

/// Whether [`activation_in_place`] can run on a layer's fresh output `y`: nothing records a
/// gradient, float32 on the CPU, contiguous. The caller guarantees that no one else holds `y`.
pub(crate) fn can_activate_in_place(y: &Tensor) -> bool {
    y.rank() > 0 && is_plain_cpu_f32(y)
}

/// `y = f(y)` in place, in one pass split over the threads (see [`can_activate_in_place`]).
pub(crate) fn activation_in_place(y: &Tensor, f: Elementwise) -> Result<()> {
    Ok(y.inplace_op1(&ActivationInPlace(f))?)
}

/// `y = f(y)` over a contiguous float32 `y`.
struct ActivationInPlace(Elementwise);

impl ActivationInPlace {
    fn run(&self, y: &mut [f32]) {
        apply_in_place(y, self.0);
    }
}

/// `y = f(y)` in place: in blocks over the threads of [`par_map`] (one block, on the calling
/// thread, below its threshold), each block in a loop built for the CPU's widest vectors
/// ([`map_in_place`](crate::vector_exp::map_in_place)). The layers' own inference passes
/// ([`GELU`](crate::GELU), [`SiLU`](crate::SiLU)) run this too, so fused and unfused passes
/// give the same bits.
pub(crate) fn apply_in_place(y: &mut [f32], f: Elementwise) {
    // One monomorphized loop per function, so each inlines (and ReLU, the exact GELU and the
    // SiLU vectorize) instead of dispatching per element.
    match f {
        Elementwise::Relu => apply(y, |v| Elementwise::Relu.apply_f32(v)),
        Elementwise::GeluErf => apply(y, |v| Elementwise::GeluErf.apply_f32(v)),
        Elementwise::GeluTanh => apply(y, |v| Elementwise::GeluTanh.apply_f32(v)),
        Elementwise::Silu => apply(y, |v| Elementwise::Silu.apply_f32(v)),
        Elementwise::Sigmoid => apply(y, |v| Elementwise::Sigmoid.apply_f32(v)),
        Elementwise::Tanh => apply(y, |v| Elementwise::Tanh.apply_f32(v)),
    }
}

fn apply(y: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Copy) {
    let block = block_len(y.len(), 1);
    par_map(y.chunks_mut(block).collect(), |block: &mut [f32]| {
        crate::vector_exp::map_in_place(block, f)
    });
}

impl candle_core::InplaceOp1 for ActivationInPlace {
    fn name(&self) -> &'static str {
        "activation-in-place"
    }

    fn cpu_fwd(&self, y: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let name = candle_core::InplaceOp1::name(self);
        self.run(f32_slice_mut(y, layout, name)?);
        Ok(())
    }
}

/// Whether [`residual_layer_norm`] can run: `x` and `residual` of one shape, with a non-empty last
/// dimension that `weight` and `bias` (if any) have one value for each element of, all float32
/// contiguous CPU tensors that record no gradient.
pub(crate) fn can_fuse_residual_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> bool {
    let width = x.dims().last().copied().unwrap_or(0);
    let per_feature = |p: Option<&Tensor>| {
        p.is_none_or(|p| is_plain_cpu_f32(p) && p.rank() == 1 && p.elem_count() == width)
    };
    width > 0
        && x.shape() == residual.shape()
        && is_plain_cpu_f32(x)
        && is_plain_cpu_f32(residual)
        && per_feature(weight)
        && per_feature(bias)
}

/// `LayerNorm(x + residual)` over the last dimension, in one pass and one fresh output (see
/// [`can_fuse_residual_norm`]): each row's sum is written to the output, its mean and biased
/// variance taken from there (two passes over a row that is in cache, as PyTorch's CPU kernel
/// does, rather than candle's `E[x²] - E[x]²`), and the row normalized and scaled in place.
pub(crate) fn residual_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let values = |p: Option<&Tensor>| p.map(Tensor::to_vec1::<f32>).transpose();
    let op = ResidualLayerNorm {
        weight: values(weight)?,
        bias: values(bias)?,
        eps: eps as f32,
    };
    Ok(x.apply_op2_no_bwd(residual, &op)?)
}

/// The forward-only candle op of [`residual_layer_norm`], holding the affine parameters' values.
struct ResidualLayerNorm {
    weight: Option<Vec<f32>>,
    bias: Option<Vec<f32>>,
    eps: f32,
}

impl ResidualLayerNorm {
    fn row(&self, x: &[f32], residual: &[f32], out: &mut [f32]) {
        for ((o, a), b) in out.iter_mut().zip(x).zip(residual) {
            *o = a + b;
        }
        let n = out.len() as f32;
        let mean = lane_sum(out, |v| v) / n;
        let var = lane_sum(out, |v| (v - mean) * (v - mean)) / n;
        let inv_std = (var + self.eps).sqrt().recip();
        match (&self.weight, &self.bias) {
            (Some(w), Some(b)) => {
                for ((o, w), b) in out.iter_mut().zip(w).zip(b) {
                    *o = (*o - mean) * inv_std * w + b;
                }
            }
            (Some(w), None) => {
                for (o, w) in out.iter_mut().zip(w) {
                    *o = (*o - mean) * inv_std * w;
                }
            }
            (None, Some(b)) => {
                for (o, b) in out.iter_mut().zip(b) {
                    *o = (*o - mean) * inv_std + b;
                }
            }
            (None, None) => out.iter_mut().for_each(|o| *o = (*o - mean) * inv_std),
        }
    }
}

/// `Σ f(v)` with eight running sums, which the compiler keeps in one vector register (a single
/// float sum must be added in order and does not vectorize). Always inlined, so it vectorizes
/// for the instruction set of its caller (the attention's AVX2 build included).
#[inline(always)]
pub(crate) fn lane_sum(values: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f(v);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

impl candle_core::CustomOp2 for ResidualLayerNorm {
    fn name(&self) -> &'static str {
        "residual-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        residual: &CpuStorage,
        residual_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = candle_core::CustomOp2::name(self);
        let x = f32_slice(x, x_layout, name)?;
        let residual = f32_slice(residual, residual_layout, name)?;
        let shape = x_layout.shape();
        let width = shape.dims().last().copied().unwrap_or(0);
        if width == 0 || residual.len() != x.len() {
            return Err(candle_core::Error::Msg(format!(
                "{name}: expects two inputs of one shape with a non-empty last dimension"
            )));
        }
        let mut out = vec![0f32; x.len()];
        let rows = |x: &[f32], r: &[f32], o: &mut [f32]| {
            for ((x, r), o) in x
                .chunks_exact(width)
                .zip(r.chunks_exact(width))
                .zip(o.chunks_exact_mut(width))
            {
                self.row(x, r, o);
            }
        };
        let block = block_len(x.len(), width);
        let jobs = out
            .chunks_mut(block)
            .zip(x.chunks(block))
            .zip(residual.chunks(block))
            .collect();
        par_map(jobs, |((o, x), r)| rows(x, r, o));
        Ok((CpuStorage::F32(out), shape.clone()))
    }
}
