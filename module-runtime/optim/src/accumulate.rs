//! Gradient accumulation over micro-batches.

use std::borrow::Borrow;

use candle_core::backprop::GradStore;
use module_core::Param;

use crate::error::Result;

/// Sums the gradients of several backward passes for a set of parameters, so an optimizer can
/// step once per several micro-batches (PyTorch's habit of calling `backward()` several times
/// before `step()`, gradients adding up in `.grad`).
///
/// Only the parameters' gradients are kept: a `GradStore` from `backward()` also holds the
/// gradient of every intermediate tensor, which would be wasteful to carry across micro-batches.
/// [`zero_grad`](Self::zero_grad) clears the sums, as PyTorch's `optimizer.zero_grad()` does.
///
/// ```
/// use module_runtime::optim::{GradAccumulator, Optimizer, SgdOptions, SGD};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let mut opt = SGD::new(&model, SgdOptions::new(0.1))?;
/// let mut acc = GradAccumulator::new(opt.params());
/// for k in 0..4 {
///     let x = Tensor::full(k as f32, (3, 4), &Device::Cpu)?;
///     // Divide by the number of micro-batches to step on the mean gradient.
///     let loss = (model.call(&x)?.sqr()?.mean_all()? / 4.0)?;
///     acc.add(&loss.backward()?)?;
/// }
/// opt.step(acc.grads())?;
/// acc.zero_grad();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GradAccumulator {
    params: Vec<Param>,
    sums: GradStore,
    count: usize,
}

impl GradAccumulator {
    /// An accumulator for the gradients of `params` (usually `optimizer.params()`).
    pub fn new<P: Borrow<Param>>(params: impl IntoIterator<Item = P>) -> Self {
        Self {
            params: params.into_iter().map(|p| p.borrow().clone()).collect(),
            sums: GradStore::default(),
            count: 0,
        }
    }

    /// Adds the parameters' gradients in `grads` (a `loss.backward()`) to the sums. A parameter
    /// without a gradient there is left as it is.
    pub fn add(&mut self, grads: &GradStore) -> Result<()> {
        for p in &self.params {
            let var = p.var()?;
            let t = var.as_tensor();
            let Some(g) = grads.get(t) else { continue };
            let sum = match self.sums.get(t) {
                Some(s) => (s + g)?,
                None => g.detach(),
            };
            self.sums.insert(t, sum);
        }
        self.count += 1;
        Ok(())
    }

    /// The summed gradients, to pass to [`Optimizer::step`](crate::Optimizer::step) or to clip.
    pub fn grads(&self) -> &GradStore {
        &self.sums
    }

    /// The summed gradients, writable (for [`clip_grad_norm`](crate::clip_grad_norm)).
    pub fn grads_mut(&mut self) -> &mut GradStore {
        &mut self.sums
    }

    /// How many backward passes were added since the last [`zero_grad`](Self::zero_grad).
    pub fn micro_batches(&self) -> usize {
        self.count
    }

    /// Forgets the sums (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        self.sums = GradStore::default();
        self.count = 0;
    }
}
