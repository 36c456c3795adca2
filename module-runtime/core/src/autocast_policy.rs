//! Autocast's per-op policy: which ops run in the low-precision dtype, which in float32, and which
//! in their inputs' dtype, on each device type, after PyTorch's lists
//! (`aten/src/ATen/autocast_mode.cpp`), checked op by op against PyTorch 2.x's CPU autocast (the
//! table in `fixtures/autocast/`).
//!
//! The runtime's layers and kernels call [`autocast_cast`] on their inputs and parameters before
//! they compute, so a model made of them gets the policy without a line of its own; code that
//! calls candle's ops directly calls it too (and [`promote`] where it mixes dtypes, since candle
//! has no type promotion).

use candle_core::{DType, Tensor};

use crate::autocast::{active_dtype, cached_cast, DeviceType};
use crate::error::Result;

/// PyTorch's cast policies (`CastPolicy` in `autocast_mode.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CastPolicy {
    /// `lower_precision_fp`: floating inputs cast to the autocast dtype (bfloat16, float16); the
    /// op runs, and returns, in it.
    LowerPrecisionFp,
    /// `fp32` (and `fp32_set_opt_dtype`): floating inputs cast to float32; the op returns
    /// float32.
    Fp32,
}

/// The runtime's ops that autocast acts on, each with PyTorch's policy per device type
/// ([`policy`](Self::policy)). An op that is in neither of a device type's lists runs in its
/// inputs' dtype there (PyTorch's fall-through), which the runtime's layers extend to mixed
/// inputs as PyTorch's CPU kernels do: a `LayerNorm` given a bfloat16 input and float32
/// parameters computes in float32 and returns bfloat16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AutocastOp {
    /// `linear`, `addmm` (`Linear`, and the projections inside attention): low precision.
    Linear,
    /// `matmul`, `mm`, `bmm`, `baddbmm`: low precision.
    MatMul,
    /// `conv1d`, `conv2d`, `conv3d`: low precision.
    Conv,
    /// `conv_transpose1d/2d/3d`: low precision.
    ConvTranspose,
    /// `prelu`: low precision.
    Prelu,
    /// `scaled_dot_product_attention`: low precision (the mask too, when it is a float one).
    ScaledDotProductAttention,
    /// `layer_norm`: float32 on CUDA; the input's dtype on the CPU.
    LayerNorm,
    /// `group_norm`: float32 on CUDA; the input's dtype on the CPU.
    GroupNorm,
    /// `batch_norm`, `instance_norm`, `rms_norm`: the input's dtype on both (in neither list).
    BatchNorm,
    /// `softmax`, `log_softmax`: float32 on CUDA (`fp32_set_opt_dtype`); the input's dtype on
    /// the CPU.
    Softmax,
    /// `sum`, `cumsum`, `prod`: float32 on CUDA (`fp32_set_opt_dtype`); the input's dtype on the
    /// CPU (except `prod`, float32 on both; the runtime has no layer that calls it).
    Sum,
    /// The losses both lists put in float32: `cross_entropy`, `nll_loss`, `mse_loss`,
    /// `l1_loss`, `smooth_l1_loss`, `huber_loss`, `kl_div`, `binary_cross_entropy(_with_logits)`,
    /// `cosine_embedding_loss`, `hinge_embedding_loss`, `margin_ranking_loss`,
    /// `soft_margin_loss`, `multilabel_margin_loss`, `multi_margin_loss`,
    /// `triplet_margin_loss`, `poisson_nll_loss`, `ctc_loss`. (PyTorch refuses
    /// `binary_cross_entropy` under CUDA autocast; the runtime computes it in float32 there too.
    /// `gaussian_nll_loss` is in no list: PyTorch composes it of other ops.)
    Loss,
}

impl AutocastOp {
    /// PyTorch's policy for this op on `device_type`, or `None` where the op is in neither list
    /// (it runs in its inputs' dtype).
    ///
    /// ```
    /// use module_runtime::amp::{AutocastOp, CastPolicy, DeviceType};
    /// assert_eq!(AutocastOp::Linear.policy(DeviceType::Cpu), Some(CastPolicy::LowerPrecisionFp));
    /// assert_eq!(AutocastOp::LayerNorm.policy(DeviceType::Cpu), None);
    /// assert_eq!(AutocastOp::LayerNorm.policy(DeviceType::Cuda), Some(CastPolicy::Fp32));
    /// ```
    pub fn policy(self, device_type: DeviceType) -> Option<CastPolicy> {
        use AutocastOp::*;
        match (self, device_type) {
            (Linear | MatMul | Conv | ConvTranspose | Prelu | ScaledDotProductAttention, _) => {
                Some(CastPolicy::LowerPrecisionFp)
            }
            (Loss, _) => Some(CastPolicy::Fp32),
            (LayerNorm | GroupNorm | Softmax | Sum, DeviceType::Cuda) => Some(CastPolicy::Fp32),
            (LayerNorm | GroupNorm | Softmax | Sum | BatchNorm, _) => None,
        }
    }
}

/// Whether autocast casts `t`: a float32, float16 or bfloat16 tensor (PyTorch's `is_eligible`:
/// floating, not float64) on `device_type`.
fn eligible(t: &Tensor, device_type: DeviceType) -> bool {
    matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && DeviceType::of(t.device()) == Some(device_type)
}

/// The dtype `op` computes in when given tensors on `device`, on this thread: the autocast dtype
/// or float32 where autocast is on and the op is in one of its lists, else `None` (the inputs'
/// own dtypes).
pub fn autocast_target(op: AutocastOp, device: &candle_core::Device) -> Option<DType> {
    let device_type = DeviceType::of(device)?;
    let lower = active_dtype(device_type)?;
    Some(match op.policy(device_type)? {
        CastPolicy::LowerPrecisionFp => lower,
        CastPolicy::Fp32 => DType::F32,
    })
}

/// `tensors` as `op` takes them under autocast on this thread (PyTorch's casts before an op's
/// kernel): outside a scope, or for an op in neither of the device type's lists, the tensors
/// themselves; otherwise each floating tensor (float64 and integer ones are left alone) on the
/// first tensor's device type cast to the op's dtype, a float32 parameter's low-precision copy
/// taken from the scope's cache. Gradients flow back through the casts in each tensor's own dtype:
/// a float32 parameter gets a float32 gradient.
///
/// For code that calls candle's ops directly, as the runtime's layers do:
///
/// ```
/// use module_runtime::amp::{autocast, autocast_cast, AutocastOp};
/// use module_runtime::prelude::*;
///
/// let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu)?;
/// let w = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let y = autocast("cpu", DType::BF16, || {
///     let [x, w] = autocast_cast(AutocastOp::MatMul, [&x, &w])?;
///     x.matmul(&w) // in bfloat16, as torch.matmul under autocast
/// })?;
/// assert_eq!(y.dtype(), DType::BF16);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn autocast_cast<const N: usize>(op: AutocastOp, tensors: [&Tensor; N]) -> Result<[Tensor; N]> {
    let target = tensors
        .first()
        .and_then(|t| autocast_target(op, t.device()).map(|d| (d, t.device())));
    let Some((dtype, device)) = target else {
        return Ok(tensors.map(Tensor::clone));
    };
    let Some(device_type) = DeviceType::of(device) else {
        return Ok(tensors.map(Tensor::clone));
    };
    let lower = active_dtype(device_type).unwrap_or(dtype);
    let mut out = Vec::with_capacity(N);
    for t in tensors {
        out.push(if eligible(t, device_type) && t.dtype() != dtype {
            cached_cast(t, dtype, lower)?
        } else {
            t.clone()
        });
    }
    Ok(out
        .try_into()
        .unwrap_or_else(|_| unreachable!("N tensors in, N out")))
}

/// An optional tensor (a bias, a mask) cast as [`autocast_cast`] casts `op`'s inputs.
pub fn autocast_cast_opt(op: AutocastOp, t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(|t| autocast_cast(op, [t]).map(|[t]| t)).transpose()
}

/// PyTorch's type promotion between floating tensors, which candle lacks: every float tensor cast
/// to the widest float dtype among them (float16 with bfloat16 promotes to float32, as
/// `torch.promote_types` says); integer tensors are left alone. What `a + b` does in PyTorch when
/// `a` is a bfloat16 product and `b` a float32 residual; the runtime's layers call it where they
/// combine tensors (residual sums), and code mixing autocast outputs with float32 tensors calls
/// it before candle's binary ops.
///
/// ```
/// use module_runtime::amp::promote;
/// use module_runtime::prelude::*;
/// let a = Tensor::ones(3, DType::BF16, &Device::Cpu)?;
/// let b = Tensor::ones(3, DType::F32, &Device::Cpu)?;
/// let [a, b] = promote([&a, &b])?;
/// assert_eq!((a + b)?.dtype(), DType::F32);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn promote<const N: usize>(tensors: [&Tensor; N]) -> Result<[Tensor; N]> {
    let widest = tensors
        .iter()
        .map(|t| t.dtype())
        .filter(|d| d.is_float())
        .reduce(promote_types);
    let Some(widest) = widest else {
        return Ok(tensors.map(Tensor::clone));
    };
    let mut out = Vec::with_capacity(N);
    for t in tensors {
        out.push(if t.dtype().is_float() && t.dtype() != widest {
            t.to_dtype(widest)?
        } else {
            t.clone()
        });
    }
    Ok(out
        .try_into()
        .unwrap_or_else(|_| unreachable!("N tensors in, N out")))
}

/// The float dtype two float dtypes promote to (PyTorch's `torch.promote_types`): the wider,
/// float32 for float16 with bfloat16.
pub fn promote_types(a: DType, b: DType) -> DType {
    fn rank(d: DType) -> u8 {
        match d {
            DType::F64 => 3,
            DType::F32 => 2,
            _ => 1,
        }
    }
    if a == b {
        a
    } else if rank(a) == 1 && rank(b) == 1 {
        DType::F32
    } else if rank(a) >= rank(b) {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autocast::autocast;
    use crate::Error;
    use candle_core::Device;

    #[test]
    fn casts_follow_the_device_types_lists() -> Result<()> {
        let x = Tensor::ones(2, DType::F32, &Device::Cpu)?;
        let h = Tensor::ones(2, DType::BF16, &Device::Cpu)?;
        let d = Tensor::ones(2, DType::F64, &Device::Cpu)?;
        let [a] = autocast_cast(AutocastOp::Linear, [&x])?;
        assert_eq!(a.dtype(), DType::F32, "no scope, no cast");
        autocast("cpu", DType::F16, || {
            let [a, b] = autocast_cast(AutocastOp::Linear, [&x, &d])?;
            assert_eq!((a.dtype(), b.dtype()), (DType::F16, DType::F64));
            let [l] = autocast_cast(AutocastOp::Loss, [&h])?;
            assert_eq!(l.dtype(), DType::F32);
            let [n] = autocast_cast(AutocastOp::LayerNorm, [&h])?;
            assert_eq!(n.dtype(), DType::BF16, "the CPU's layer_norm is in no list");
            Ok::<_, Error>(())
        })?;
        // A CUDA scope leaves CPU tensors alone.
        autocast("cuda", DType::F16, || {
            let [a] = autocast_cast(AutocastOp::Linear, [&x])?;
            assert_eq!(a.dtype(), DType::F32);
            Ok::<_, Error>(())
        })
    }

    #[test]
    fn promotion_is_torchs() {
        assert_eq!(promote_types(DType::BF16, DType::F16), DType::F32);
        assert_eq!(promote_types(DType::BF16, DType::F32), DType::F32);
        assert_eq!(promote_types(DType::F64, DType::F16), DType::F64);
        assert_eq!(promote_types(DType::BF16, DType::BF16), DType::BF16);
    }
}
