//! The fused CPU float32 update: one pass over a parameter, its gradient and its state buffers,
//! written in place and split over rayon's thread pool (the pool candle's CPU kernels use).
//!
//! Each optimizer's element-wise rule is written so that it computes exactly what its composed
//! path (candle tensor ops, one per PyTorch op) computes, rounding for rounding: the same
//! operations on `f32` in the same order, with candle's `affine(a, 0)` spelled `x * a + 0.0`.
//! So the two paths give the same bits, and the choice between them is only one of speed.

use std::cell::RefCell;

use candle_core::{CpuStorage, DType, Layout, Tensor};

use crate::error::Result;

/// Elements per parallel task: big enough that scheduling costs nothing next to the pass, small
/// enough that a large parameter keeps every thread busy.
pub(crate) const CHUNK: usize = 1 << 14;

/// Whether `t` is a contiguous float32 tensor on the CPU, which the fused update works on.
pub(crate) fn is_cpu_f32(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.device().is_cpu() && t.is_contiguous()
}

/// Runs `f(param values, gradient values)` with the values of the parameter tensor `p` writable
/// in place. Both must be [`is_cpu_f32`] and of one element count.
pub(crate) fn update_in_place<F: FnOnce(&mut [f32], &[f32])>(
    p: &Tensor,
    g: &Tensor,
    f: F,
) -> Result<()> {
    Ok(p.inplace_op2(g, &InPlace(RefCell::new(Some(f))))?)
}

struct InPlace<F>(RefCell<Option<F>>);

impl<F: FnOnce(&mut [f32], &[f32])> candle_core::InplaceOp2 for InPlace<F> {
    fn name(&self) -> &'static str {
        "module-optim-fused-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let name = self.name();
        let (CpuStorage::F32(p), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("{name}: the parameter and its gradient must be float32")
        };
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            return Err(candle_core::Error::RequiresContiguous { op: name });
        };
        if p1 - p0 != g1 - g0 {
            candle_core::bail!(
                "{name}: the parameter has {} values, its gradient {}",
                p1 - p0,
                g1 - g0
            )
        }
        let Some(f) = self.0.borrow_mut().take() else {
            candle_core::bail!("{name}: ran twice")
        };
        f(&mut p[p0..p1], &g[g0..g1]);
        Ok(())
    }
}
