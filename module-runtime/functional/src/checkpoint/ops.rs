//! The custom ops that tie a checkpointed function's outputs to its inputs and trainable tensors,
//! and the recomputation their backward runs.
//!
//! The forward leaves this graph behind, and nothing of the function's inside:
//!
//! ```text
//! zero ─ Link(leaf 0) ─ Link(leaf 1) ─ … ─ Link(leaf n-1) ─ Gate ─┬─ Out(0) = output 0
//!          │              │                   │                   └─ Out(1) = output 1
//!        leaf 0         leaf 1             leaf n-1      (leaves: tracked inputs, then parameters)
//! ```
//!
//! `Link` and `Gate` compute a scalar zero and `Out(i)` a copy of output `i` (on the CPU, or on
//! the CUDA device of the leaves with the `cuda` feature), so the graph holds
//! the inputs (which the caller's graph holds anyway), the parameters, scalars and the outputs.
//! Candle's backward visits a node after every node that consumes it, so for this chain:
//!
//! 1. each `Out(i)` reached by the loss keeps the gradient of output `i` (its `grad_output`);
//! 2. `Gate` is visited after all of them: it restores the generator state of the forward, runs
//!    the function again with gradients recorded on fresh leaf copies of the inputs, and runs a
//!    backward of `Σ (output_i · grad_output_i)` from there, which gives every input and
//!    parameter its gradient; it keeps them;
//! 3. each `Link(k)` hands leaf `k` its kept gradient.
//!
//! The gradient of output `i` in the nested backward is `1 · grad_output_i`, exactly the gradient
//! the plain graph gives it, and the function's ops run on the same values in the same order, so
//! the gradients are the plain graph's bit for bit.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor, TensorId, Var};

use crate::error::{CheckpointError, Result};

/// What a checkpointed function is: tensors in, tensors out.
pub(super) type Function = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

/// Everything one checkpointed call keeps for its backward: the function, its inputs (detached:
/// the caller's graph holds them), the generator state it started from, and what its outputs
/// were. Shared by the call's ops.
pub(super) struct Saved {
    pub(super) function: Arc<Function>,
    pub(super) inputs: Vec<Tensor>,
    /// Which inputs are given a gradient (they recorded one: `track_op`).
    pub(super) tracked: Vec<bool>,
    /// The generator state before the forward (`get_rng_state`), replayed by the recomputation.
    pub(super) rng: Tensor,
    /// Whether the kernels' fused passes were on for the forward (`is_fusion_enabled`).
    pub(super) fusion: bool,
    /// The forward's autocast settings, replayed by the recomputation (PyTorch's checkpoint
    /// recomputes under the forward's autocast state).
    pub(super) autocast: module_core::autocast::AutocastState,
    /// The trainable tensors the forward read (leaves after the tracked inputs).
    pub(super) params: Vec<Tensor>,
    /// The outputs' shapes and dtypes, which the recomputation must reproduce.
    pub(super) metadata: Vec<(Shape, DType)>,
    pub(super) state: Mutex<State>,
}

/// What changes during the forward and the backward.
#[derive(Default)]
pub(super) struct State {
    /// The forward's outputs, until `Out` copies them.
    pub(super) outputs: Vec<Option<Tensor>>,
    /// The gradients of the outputs the loss reached, as `Out` receives them.
    pub(super) grad_outputs: Vec<Option<Tensor>>,
    /// Per leaf (tracked inputs, then parameters): its gradient from the recomputation, until
    /// its `Link` hands it on.
    pub(super) grads: Vec<Option<Tensor>>,
}

impl Saved {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many tracked inputs come before the parameters among the leaves.
    fn tracked_count(&self) -> usize {
        self.tracked.iter().filter(|t| **t).count()
    }

    /// Runs the function again, with gradients recorded on leaf copies of the tracked inputs,
    /// from the generator state and fusion setting of the forward, and keeps every leaf's
    /// gradient. The generator is put back as it was afterwards, on failure too.
    fn recompute(&self) -> Result<()> {
        // Emptied for the next backward through the same graph (candle allows several).
        let n = self.metadata.len();
        let grad_outputs = std::mem::replace(&mut self.state().grad_outputs, vec![None; n]);
        let _grad = module_core::enable_grad();
        let now = module_core::get_rng_state()?;
        module_core::set_rng_state(&self.rng)?;
        let result = self.autocast.run(|| {
            if self.fusion {
                self.gradients(&grad_outputs)
            } else {
                module_kernels::without_fusion(|| self.gradients(&grad_outputs))
            }
        });
        module_core::set_rng_state(&now)?;
        self.state().grads = result?;
        Ok(())
    }

    /// The recomputation and its nested backward: each leaf's gradient.
    fn gradients(&self, grad_outputs: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let (inputs, copies) = leaf_inputs(&self.inputs, &self.tracked)?;
        let outputs = (self.function)(&inputs)?;
        let metadata: Vec<_> = outputs
            .iter()
            .map(|o| (o.shape().clone(), o.dtype()))
            .collect();
        if metadata != self.metadata {
            return Err(CheckpointError::Recomputed {
                forward: describe(&self.metadata),
                recomputed: describe(&metadata),
            }
            .into());
        }
        let mut root: Option<Tensor> = None;
        for (output, grad) in outputs.iter().zip(grad_outputs) {
            let Some(grad) = grad else { continue };
            let term = output.mul(grad)?.sum_all()?.to_dtype(DType::F32)?;
            root = Some(match root {
                None => term,
                Some(r) => r.add(&term)?,
            });
        }
        let leaves = copies.iter().map(Var::as_tensor).chain(&self.params);
        let Some(root) = root else {
            return Ok(leaves.map(|_| None).collect());
        };
        let known: HashSet<TensorId> = leaves.clone().map(Tensor::id).collect();
        if let Some(new) = root
            .sorted_nodes()
            .into_iter()
            .find(|n| n.is_variable() && !known.contains(&n.id()))
        {
            return Err(CheckpointError::NewParameter {
                shape: new.dims().to_vec(),
            }
            .into());
        }
        let grads = root.backward()?;
        Ok(leaves.map(|leaf| grads.get(leaf).cloned()).collect())
    }
}

/// The tensors a run of the function is given: a fresh leaf (`Var`) copy of each tracked input,
/// so that its gradient is recorded and the graph stops there, and the others as they are.
pub(super) fn leaf_inputs(inputs: &[Tensor], tracked: &[bool]) -> Result<(Vec<Tensor>, Vec<Var>)> {
    let mut run = Vec::with_capacity(inputs.len());
    let mut copies = Vec::new();
    for (input, &tracked) in inputs.iter().zip(tracked) {
        if tracked {
            let var = Var::from_tensor(&input.detach())?;
            run.push(var.as_tensor().clone());
            copies.push(var);
        } else {
            run.push(input.clone());
        }
    }
    Ok((run, copies))
}

/// `[8, 25, 384] F32, [8] U32`: outputs as the errors show them.
fn describe(metadata: &[(Shape, DType)]) -> String {
    let parts: Vec<String> = metadata
        .iter()
        .map(|(shape, dtype)| format!("{:?} {dtype:?}", shape.dims()))
        .collect();
    format!("({})", parts.join(", "))
}

/// A scalar zero: what `Link` and `Gate` compute.
fn zero() -> (CpuStorage, Shape) {
    (CpuStorage::F32(vec![0.0]), Shape::from(()))
}

/// Ties leaf `k` into the chain: `Link(previous, leaf) = 0`; its backward hands the leaf its
/// gradient from the recomputation.
pub(super) struct Link {
    pub(super) saved: Arc<Saved>,
    pub(super) k: usize,
}

impl CustomOp2 for Link {
    fn name(&self) -> &'static str {
        "checkpoint-link"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok(zero())
    }

    /// The previous link's scalar zero, copied.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        previous: &candle_core::CudaStorage,
        layout: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((previous.try_clone(layout)?, Shape::from(())))
    }

    fn bwd(
        &self,
        previous: &Tensor,
        leaf: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let kept = self
            .saved
            .state()
            .grads
            .get_mut(self.k)
            .and_then(Option::take);
        // A tracked input is a node candle's backward visits: it must be given a gradient, zero
        // when the outputs do not depend on it. A parameter without one is left without.
        let leaf_grad = match kept {
            Some(g) => Some(g),
            None if self.k < self.saved.tracked_count() => Some(leaf.zeros_like()?),
            None => None,
        };
        let previous_grad = previous.track_op().then(|| grad.clone());
        Ok((previous_grad, leaf_grad))
    }
}

/// After every `Out` and before every `Link`: its backward is the recomputation.
pub(super) struct Gate {
    pub(super) saved: Arc<Saved>,
}

impl CustomOp1 for Gate {
    fn name(&self) -> &'static str {
        "checkpoint-gate"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok(zero())
    }

    /// The anchor's scalar zero, copied.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        anchor: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((anchor.try_clone(layout)?, Shape::from(())))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.saved.recompute().map_err(module_core::error::carry)?;
        Ok(Some(grad.clone()))
    }
}

/// Output `i` of the function: a copy of the forward's value; its backward keeps the output's
/// gradient for the recomputation.
pub(super) struct Out {
    pub(super) saved: Arc<Saved>,
    pub(super) i: usize,
}

impl CustomOp1 for Out {
    fn name(&self) -> &'static str {
        "checkpoint-output"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_storage(&self.take()?)
    }

    /// The output's value, a fresh copy on its CUDA device.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let value = self.take()?.force_contiguous()?;
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, value.shape().clone())),
            _ => candle_core::bail!("checkpoint output {} is not on the CUDA device", self.i),
        }
    }

    fn bwd(&self, gate: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let mut state = self.saved.state();
        if let Some(slot) = state.grad_outputs.get_mut(self.i) {
            *slot = Some(grad.clone());
        }
        Ok(Some(gate.zeros_like()?))
    }
}

impl Out {
    /// The forward's value of output `i`, handed out once.
    fn take(&self) -> candle_core::Result<Tensor> {
        let value = self
            .saved
            .state()
            .outputs
            .get_mut(self.i)
            .and_then(Option::take);
        match value {
            Some(value) => Ok(value),
            None => candle_core::bail!("checkpoint output {} was already handed out", self.i),
        }
    }

    /// A CPU copy of `value`.
    fn cpu_storage(&self, value: &Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
        let flat = value.flatten_all()?;
        let storage = match value.dtype() {
            DType::F32 => CpuStorage::F32(flat.to_vec1()?),
            DType::F64 => CpuStorage::F64(flat.to_vec1()?),
            DType::BF16 => CpuStorage::BF16(flat.to_vec1()?),
            DType::F16 => CpuStorage::F16(flat.to_vec1()?),
            other => candle_core::bail!("checkpoint output of dtype {other:?}"),
        };
        Ok((storage, value.shape().clone()))
    }
}
