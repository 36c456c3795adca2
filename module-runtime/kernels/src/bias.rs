//! A bias added to a kernel's fresh output: in place during CPU float32 inference, instead of a
//! second output of the same size.

use candle_core::Tensor;

use crate::cpu::{f32_slice, f32_slice_mut, is_plain_cpu_f32};
use crate::error::Result;

/// `y + b` with `b` `[y.dim(dim)]` added along dimension `dim` of `y`, for the fresh output `y`
/// of a product or a convolution, which nothing else holds: in place when both are
/// [plain CPU float32](is_plain_cpu_f32) (no second output allocated and page-faulted in), else
/// candle's differentiable `broadcast_add`.
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor};
/// let y = Tensor::zeros((2, 3), module_runtime::candle_core::DType::F32, &Device::Cpu)?;
/// let b = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
/// let y = module_kernels::add_bias(y, &b, 1)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[1., 2., 3.], [1., 2., 3.]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn add_bias(y: Tensor, b: &Tensor, dim: usize) -> Result<Tensor> {
    if can_add_bias_in_place(&y, b, dim) {
        let inner = y.dims()[dim + 1..].iter().product();
        y.inplace_op2(b, &AddBiasInPlace { inner })?;
        return Ok(y);
    }
    let mut shape = vec![1; y.rank()];
    if let Some(d) = shape.get_mut(dim) {
        *d = b.elem_count();
    }
    Ok(y.broadcast_add(&b.reshape(shape)?)?)
}

/// Whether `b` can be added to `y` along dimension `dim` in place: both plain CPU float32, `b`
/// one non-empty value per index of `dim`.
fn can_add_bias_in_place(y: &Tensor, b: &Tensor, dim: usize) -> bool {
    is_plain_cpu_f32(y)
        && is_plain_cpu_f32(b)
        && b.rank() == 1
        && b.elem_count() > 0
        && y.dims().get(dim) == Some(&b.elem_count())
}

/// `y += b` over a contiguous float32 `y` viewed as `[outer, b.len(), inner]`.
struct AddBiasInPlace {
    inner: usize,
}

impl candle_core::InplaceOp2 for AddBiasInPlace {
    fn name(&self) -> &'static str {
        "add-bias-in-place"
    }

    fn cpu_fwd(
        &self,
        y: &mut candle_core::CpuStorage,
        y_layout: &candle_core::Layout,
        b: &candle_core::CpuStorage,
        b_layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let b = f32_slice(b, b_layout, self.name())?;
        let y = f32_slice_mut(y, y_layout, self.name())?;
        if self.inner == 0 || y.is_empty() {
            return Ok(());
        }
        for block in y.chunks_exact_mut(b.len() * self.inner) {
            for (run, c) in block.chunks_exact_mut(self.inner).zip(b) {
                for v in run {
                    *v += c;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    /// The in-place bias add gives `broadcast_add`'s values bit for bit, along any dimension.
    #[test]
    fn in_place_bias_add_matches_broadcast_add() -> Result<()> {
        let dev = Device::Cpu;
        let y = Tensor::randn(0f32, 1., (2, 3, 4, 5), &dev)?;
        for dim in 0..4 {
            let b = Tensor::randn(0f32, 1., y.dim(dim)?, &dev)?;
            let mut shape = vec![1; 4];
            shape[dim] = y.dim(dim)?;
            let expected = y.broadcast_add(&b.reshape(shape)?)?;
            let fresh = y.copy()?;
            assert!(can_add_bias_in_place(&fresh, &b, dim));
            let added = add_bias(fresh, &b, dim)?;
            assert_eq!(
                added.flatten_all()?.to_vec1::<f32>()?,
                expected.flatten_all()?.to_vec1::<f32>()?,
                "dim {dim}"
            );
        }
        // Not for a tensor that records a gradient, another dtype, or an empty bias; those take
        // `broadcast_add`, with the same values.
        let var = candle_core::Var::from_tensor(&y)?;
        let b = Tensor::ones(3, DType::F32, &dev)?;
        assert!(!can_add_bias_in_place(var.as_tensor(), &b, 1));
        let tracked = add_bias(var.as_tensor().clone(), &b, 1)?;
        assert!(tracked.track_op());
        assert!(!can_add_bias_in_place(
            &y.to_dtype(DType::F64)?,
            &b.to_dtype(DType::F64)?,
            1
        ));
        let empty = Tensor::zeros((2, 0), DType::F32, &dev)?;
        assert!(!can_add_bias_in_place(
            &empty,
            &Tensor::zeros(0, DType::F32, &dev)?,
            1
        ));
        Ok(())
    }
}
