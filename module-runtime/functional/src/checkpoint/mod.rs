//! Activation checkpointing: PyTorch's `torch.utils.checkpoint.checkpoint(function, *args,
//! use_reentrant=False)`, with `preserve_rng_state=True`.
//!
//! [`checkpoint`] runs a function and keeps none of the tensors inside it for the backward pass:
//! only its inputs, the generator's state and the function itself. When the backward reaches its
//! outputs, the function runs again (its activations recomputed) and its gradients are computed
//! from there; they are the gradients of the plain run bit for bit, dropout included. How: see
//! `ops.rs`.

mod ops;
mod wrapper;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, TensorId};

use crate::error::{CheckpointError, Result};
use ops::{leaf_inputs, Function, Gate, Link, Out, Saved, State};
pub use wrapper::{
    apply_activation_checkpointing, remove_activation_checkpointing, CheckpointWrapper,
};

/// Runs `function` on `inputs` without keeping its activations for the backward pass; the
/// backward runs it again to compute them: PyTorch's
/// `torch.utils.checkpoint.checkpoint(function, *inputs, use_reentrant=False)`.
///
/// The outputs are those of `function(inputs)`, and the gradients that flow back through them to
/// the inputs and to every trainable tensor the function reads (the parameters of the modules it
/// calls, found in the graph of its outputs) are exactly those of calling `function` directly:
///
/// - the recomputation runs from the random generator's state of the forward (PyTorch's
///   `preserve_rng_state=True`), so dropout draws the same masks; the generator is put back
///   afterwards, so the run's later draws are unchanged;
/// - it runs with gradients recorded (whatever the grad mode of the backward) and with the
///   fusion setting of the forward ([`without_fusion`](../module_runtime/nn/fn.without_fusion.html)),
///   so every kernel takes the path it took, and with the forward's autocast settings
///   (`module_runtime::amp::autocast`: PyTorch recomputes under the forward's autocast state), so
///   every op computes in the dtype it did;
/// - a parameter used inside the function and elsewhere too gets the sum of both parts, as
///   without checkpointing; when it is read more than once inside the function, its parts from
///   the inside are summed first, so the last bits can differ from the plain run's order of sums.
///
/// What it keeps: the inputs (which the caller's graph holds anyway), the generator state, the
/// function and a copy of the outputs; the function's intermediate tensors are freed when it
/// returns. The cost is a second forward of `function` during the backward.
///
/// `function` must compute the same thing when run again: modules called by it run their
/// forward (and their forward hooks fire) a second time during the backward, as with PyTorch's
/// non-reentrant checkpoint, reading the parameters and train/eval mode they have then (change
/// neither between the forward and the backward). A recomputation with other output shapes or
/// dtypes, or that reads a trainable tensor the forward did not, fails the backward with
/// [`CheckpointError`]. Parameters substituted by a
/// [`functional_call`](crate::FunctionalExt::functional_call) are read in the forward only: do
/// not checkpoint inside one.
///
/// With gradients off ([`no_grad`](module_core::no_grad)), or when neither an input nor a
/// parameter records a gradient, it is `function(inputs)`. The recording ops run on the CPU, and
/// on CUDA devices in a build with the `cuda` feature, all of a checkpoint's tensors on one
/// device; a tensor elsewhere is [`CheckpointError::Device`]. No output
/// ([`CheckpointError::NoOutput`]) is an error.
///
/// ```
/// use std::sync::Arc;
/// use module_runtime::candle_core::Var;
/// use module_runtime::nn::{Dropout, Sequential, GELU};
/// use module_runtime::prelude::*;
/// use module_runtime::checkpoint;
///
/// let dev = Device::Cpu;
/// let block = Arc::new(Sequential::new().add(Linear::new(4, 16, &dev)?).add(GELU::default())
///     .add(Dropout::new(0.1)).add(Linear::new(16, 4, &dev)?));
/// let x = Var::randn(0f32, 1., (2, 4), &dev)?;
///
/// // Checkpointed: the block's activations are recomputed in the backward.
/// manual_seed(0);
/// let b = block.clone();
/// let y = checkpoint(move |xs| Ok(vec![b.call(&xs[0])?]), &[x.as_tensor().clone()])?;
/// let grads = y[0].sqr()?.sum_all()?.backward()?;
/// let weight = block.get_parameter("0.weight")?.tensor()?;
/// let checkpointed = grads.get(&weight).unwrap().to_vec2::<f32>()?;
///
/// // Plain: the same gradients, bit for bit, dropout included.
/// manual_seed(0);
/// let grads = block.call(x.as_tensor())?.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&weight).unwrap().to_vec2::<f32>()?, checkpointed);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn checkpoint<F>(function: F, inputs: &[Tensor]) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    if !module_core::is_grad_enabled() {
        return function(inputs);
    }
    let tracked: Vec<bool> = inputs
        .iter()
        .map(|t| t.track_op() && t.dtype().is_float())
        .collect();
    let rng = module_core::get_rng_state()?;
    let fusion = module_kernels::is_fusion_enabled();
    let autocast = module_core::autocast::AutocastState::current();
    let (run_inputs, copies) = leaf_inputs(inputs, &tracked)?;
    let outputs = function(&run_inputs)?;
    if outputs.is_empty() {
        return Err(CheckpointError::NoOutput.into());
    }
    // The trainable tensors the outputs were computed from, other than the input copies.
    let copy_ids: HashSet<TensorId> = copies.iter().map(|v| v.id()).collect();
    let mut seen = HashSet::new();
    let mut params = Vec::new();
    for output in &outputs {
        for node in output.sorted_nodes() {
            if node.is_variable() && !copy_ids.contains(&node.id()) && seen.insert(node.id()) {
                params.push(node.clone());
            }
        }
    }
    drop(copies);
    if params.is_empty() && !tracked.contains(&true) {
        return Ok(outputs);
    }
    let leaves: Vec<Tensor> = inputs
        .iter()
        .zip(&tracked)
        .filter(|(_, t)| **t)
        .map(|(input, _)| input.clone())
        .chain(params.iter().cloned())
        .collect();
    // The chain of ops lives on the leaves' device (`leaves` is not empty: see above).
    let device = leaves[0].device().clone();
    on_device(&leaves, &device, "an input or parameter")?;
    on_device(&outputs, &device, "an output")?;
    // Detached: the function's inside is freed with `outputs`' graph.
    let values: Vec<Tensor> = outputs.iter().map(Tensor::detach).collect();
    drop(outputs);
    let saved = Arc::new(Saved {
        function: Arc::new(function) as Arc<Function>,
        inputs: inputs.iter().map(Tensor::detach).collect(),
        tracked,
        rng,
        fusion,
        autocast,
        params,
        metadata: values
            .iter()
            .map(|v| (v.shape().clone(), v.dtype()))
            .collect(),
        state: Mutex::new(State {
            outputs: values.iter().cloned().map(Some).collect(),
            grad_outputs: vec![None; values.len()],
            ..State::default()
        }),
    });
    let mut anchor = Tensor::zeros((), DType::F32, &device)?;
    for (k, leaf) in leaves.iter().enumerate() {
        let link = Link {
            saved: saved.clone(),
            k,
        };
        anchor = anchor.apply_op2(leaf, link)?;
    }
    let gate = anchor.apply_op1(Gate {
        saved: saved.clone(),
    })?;
    let mut result = Vec::with_capacity(values.len());
    for (i, value) in values.into_iter().enumerate() {
        if value.dtype().is_float() {
            // `Out` takes its value from `saved`: drop this reference first.
            drop(value);
            result.push(gate.apply_op1(Out {
                saved: saved.clone(),
                i,
            })?);
        } else {
            saved.state().outputs[i] = None;
            result.push(value);
        }
    }
    Ok(result)
}

/// Whether the checkpoint's ops run on `device`: the CPU, and CUDA devices when built with the
/// `cuda` feature.
fn ops_run_on(device: &Device) -> bool {
    device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda())
}

/// [`CheckpointError::Device`] for the first of `tensors` not on `device`, or for the first
/// tensor when the ops do not run there.
fn on_device(tensors: &[Tensor], device: &Device, what: &str) -> Result<()> {
    let misplaced = |t: &&Tensor| !ops_run_on(device) || !t.device().same_device(device);
    match tensors.iter().find(misplaced) {
        None => Ok(()),
        Some(t) => Err(CheckpointError::Device {
            what: format!("{what} of shape {:?}", t.dims()),
            device: format!("{:?}", t.device().location()),
        }
        .into()),
    }
}
