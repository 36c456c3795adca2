//! The per-thread switch of the fused passes: [`without_fusion`] turns every fused kernel off, so
//! each operation takes its path composed of candle ops.

use std::cell::Cell;

thread_local! {
    static FUSION_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether the runtime's layers may fuse passes on this thread (`true` unless inside
/// [`without_fusion`]).
pub fn is_fusion_enabled() -> bool {
    FUSION_ENABLED.with(Cell::get)
}

/// Runs `f` with fusion off on this thread: every layer takes its unfused path, composed of candle
/// ops, both the fused inference passes and the fused training passes (single ops with a
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
