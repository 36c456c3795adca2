//! The forward pass.

use crate::error::Result;

/// A module's computation on an input of type `In`: PyTorch's `forward`.
///
/// Implement `forward`; run a module with [`call`](../module_runtime/trait.ModuleExt.html#method.call), which is where hooks
/// are dispatched. A module may implement `Forward` for several input types (a tensor, a tuple of
/// tensors and a mask, a user struct).
///
/// ```
/// use module_runtime::prelude::*;
///
/// #[derive(Module)]
/// struct Affine {
///     scale: Param,
/// }
///
/// impl Forward<&Tensor> for Affine {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         Ok(x.broadcast_mul(&self.scale.tensor()?)?)
///     }
/// }
///
/// let m = Affine { scale: Param::new(Tensor::new(&[2f32], &Device::Cpu)?)? };
/// let y = m.call(&Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [2., 4., 6.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub trait Forward<In> {
    /// What the module returns.
    type Output;

    /// Computes the output. Call submodules with `call`, so their hooks fire.
    fn forward(&self, input: In) -> Result<Self::Output>;
}

/// A boxed module runs the module inside (and is the same node for hooks).
impl<In, M: Forward<In>> Forward<In> for Box<M> {
    type Output = M::Output;

    fn forward(&self, input: In) -> Result<M::Output> {
        (**self).forward(input)
    }
}

/// A module shared through `Arc` runs the module inside. Called through the `Arc` field
/// (`self.shared.call(x)`), hooks see the path of that field, so a module reached by two paths
/// reports the one it was called through.
impl<In, M: Forward<In>> Forward<In> for std::sync::Arc<M> {
    type Output = M::Output;

    fn forward(&self, input: In) -> Result<M::Output> {
        (**self).forward(input)
    }
}
