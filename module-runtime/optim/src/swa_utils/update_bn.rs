//! `update_bn`: a `BatchNorm`'s running statistics recomputed in one pass over data.

use candle_core::Tensor;
use module_core::{Buffer, ChildMut, Forward, Module};
use module_hooks::{ModuleExt, TensorTree};
use module_nn::{BatchNorm, LazyBatchNorm};

use crate::error::Result;

/// Recomputes the running statistics of every `BatchNorm` layer of `model` from one pass over
/// `loader`: PyTorch's `torch.optim.swa_utils.update_bn(loader, model)`, run after training an
/// [`AveragedModel`](super::AveragedModel), whose averaged weights the running statistics of the
/// trained model do not fit.
///
/// As PyTorch does it: each `BatchNorm` (`BatchNorm1d`, `2d`, `3d` and their lazy forms) has its
/// running statistics reset (`running_mean` zeros, `running_var` ones, `num_batches_tracked`
/// 0) and its momentum set to `None`, so the running statistics become the cumulative average
/// over the batches; the model is put in training mode and called on each item of `loader`
/// without recording gradients; then the momenta and the model's training mode are put back. A
/// model without `BatchNorm` is left as it is and `loader` is not read.
///
/// Each item of `loader` is the model's input: where PyTorch takes the first element of a
/// `(input, target)` pair, map the loader to its inputs (`loader.iter().map(|(x, _)| x)`). On an
/// error of the model, the running statistics are put back as they were, with the momenta and
/// the training mode.
///
/// A `BatchNorm` inside a module shared through an `Arc` cannot be changed here (it is shared) and
/// keeps its momentum.
///
/// ```
/// use module_runtime::nn::BatchNorm1d;
/// use module_runtime::optim::swa_utils::update_bn;
/// use module_runtime::prelude::*;
///
/// let mut bn = BatchNorm1d::new(3, &Device::Cpu)?;
/// bn.eval();
/// let batches = [
///     Tensor::new(&[[1f32, 2., 3.], [3., 4., 5.]], &Device::Cpu)?,
///     Tensor::new(&[[5f32, 6., 7.], [7., 8., 9.]], &Device::Cpu)?,
/// ];
/// update_bn(&batches, &mut bn)?;
/// // The mean of the two batches' means; the momentum and eval mode are back.
/// let mean = bn.running_mean.as_ref().unwrap().tensor()?.to_vec1::<f32>()?;
/// assert_eq!(mean, [4.0, 5.0, 6.0]);
/// assert_eq!(bn.momentum, Some(0.1));
/// assert!(!bn.is_training());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn update_bn<M, In>(loader: impl IntoIterator<Item = In>, model: &mut M) -> Result<()>
where
    M: Module + Forward<In>,
    In: TensorTree,
    M::Output: TensorTree + 'static,
{
    // Each norm's momentum and running statistics as they were, in walk order.
    let mut saved: Vec<Saved> = Vec::new();
    let mut failed = None;
    visit_batch_norms(model, &mut |bn| {
        if failed.is_none() {
            match reset(bn) {
                Ok(s) => saved.push(s),
                Err(e) => failed = Some(e),
            }
        }
    });
    if let Some(e) = failed {
        // The norms reset before the one that failed get their statistics and momenta back.
        restore_stats(&saved)?;
        restore(model, &saved);
        return Err(e);
    }
    if saved.is_empty() {
        return Ok(());
    }
    let was_training = model.is_training();
    model.train();
    let run = || -> Result<()> {
        let _no_grad = module_core::no_grad();
        for input in loader {
            model.call(input)?;
        }
        Ok(())
    };
    let result = run();
    if result.is_err() {
        // Put the statistics back as they were.
        restore_stats(&saved)?;
    }
    restore(model, &saved);
    model.set_training(was_training);
    result
}

/// One norm's momentum and the values of its running statistics before the reset.
struct Saved {
    momentum: Option<f64>,
    stats: Vec<(Buffer, Tensor)>,
}

/// A `BatchNorm` of any dimension, as `update_bn` changes it.
struct BatchNormMut<'a> {
    momentum: &'a mut Option<f64>,
    /// `running_mean`, `running_var`, `num_batches_tracked`.
    stats: [&'a Option<Buffer>; 3],
}

/// PyTorch's `reset_running_stats()` and `momentum = None`; returns what they replaced.
fn reset(bn: BatchNormMut<'_>) -> Result<Saved> {
    let mut stats = Vec::new();
    let [mean, var, count] = bn.stats;
    let buffers = [(mean, 0.0), (var, 1.0), (count, 0.0)];
    // Read every value first, so a failure changes nothing.
    for (b, _) in &buffers {
        if let Some(b) = b.as_ref().filter(|b| b.is_built()) {
            stats.push((b.clone(), b.tensor()?.copy()?));
        }
    }
    for (b, fill) in buffers {
        if let Some(b) = b.as_ref().filter(|b| b.is_built()) {
            let t = b.tensor()?;
            b.set(&(t.zeros_like()? + fill)?)?;
        }
    }
    let momentum = bn.momentum.take();
    Ok(Saved { momentum, stats })
}

fn restore_stats(saved: &[Saved]) -> Result<()> {
    for s in saved {
        for (b, t) in &s.stats {
            b.set(t)?;
        }
    }
    Ok(())
}

/// Puts the momenta back, in the order [`visit_batch_norms`] found the norms.
fn restore(model: &mut dyn Module, saved: &[Saved]) {
    let mut momenta = saved.iter().map(|s| s.momentum);
    visit_batch_norms(model, &mut |bn| {
        if let Some(m) = momenta.next() {
            *bn.momentum = m;
        }
    });
}

/// Calls `f` on every `BatchNorm` in `module`, in the walk's order, through the `BatchNorm` view
/// of each dimension.
fn visit_batch_norms(module: &mut dyn Module, f: &mut dyn FnMut(BatchNormMut<'_>)) {
    if let Some(bn) = batch_norm(module) {
        f(bn);
        return;
    }
    module.visit_children_mut(&mut |_, child| {
        if let ChildMut::Module(m) = child {
            visit_batch_norms(m, f);
        }
    });
}

/// `module` as a `BatchNorm`, if it is one (`BatchNorm<1>`, `<2>`, `<3>`, or their lazy forms).
fn batch_norm(module: &mut dyn Module) -> Option<BatchNormMut<'_>> {
    macro_rules! as_batch_norm {
        ($($ty:ty => $norm:expr),*) => {$(
            if module.downcast_ref::<$ty>().is_some() {
                return module.downcast_mut::<$ty>().map($norm);
            }
        )*};
    }
    as_batch_norm!(
        BatchNorm<1> => view,
        BatchNorm<2> => view,
        BatchNorm<3> => view,
        LazyBatchNorm<1> => |lazy| view::<1>(lazy),
        LazyBatchNorm<2> => |lazy| view::<2>(lazy),
        LazyBatchNorm<3> => |lazy| view::<3>(lazy)
    );
    None
}

fn view<const D: usize>(bn: &mut BatchNorm<D>) -> BatchNormMut<'_> {
    BatchNormMut {
        momentum: &mut bn.momentum,
        stats: [&bn.running_mean, &bn.running_var, &bn.num_batches_tracked],
    }
}
