//! Full backward hooks and pre-hooks at run time: what one module call leaves in candle's graph
//! so that `backward()` calls them, as PyTorch's `torch.utils.hooks.BackwardHook` does.
//!
//! A call of a module with backward hooks puts two identities around it, per side:
//!
//! - every output tensor that requires a gradient `o` becomes `tag(o, gate)`, where `gate` is one
//!   scalar computed from all of them. In the backward, each tag is reached with the whole
//!   gradient of its output and records it; the gate, an argument of every tag, is reached after
//!   all of them (candle walks the graph in topological order), when every output gradient that
//!   the loss gives is known. It runs the pre-hooks on them and hands the outputs the (replaced)
//!   gradients. The tags hand their outputs nothing, so nothing flows around the gate.
//! - the inputs likewise (only when full hooks are registered): the inputs' gate runs the full
//!   hooks with the input gradients and the output gradients as the pre-hooks left them.
//!
//! One gate is one candle op of up to three arguments; more tensors chain gates, whose outer-most
//! (reached first) runs the hooks. Nothing is added when no backward hook targets the module,
//! when grad mode is off, or on a side whose tensors require no gradient.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{CpuStorage, DType, Device, Layout, Shape, Tensor};

use super::grad_op::{check_grad, copy, copy_cpu, requires_grad, scalar, to_candle};
use super::hook::{Armed, BackwardHookCtx, BackwardHookFn, BackwardPreHookFn};
use crate::error::{BackwardHookError, Error, Result};

const FULL: &str = "full backward hook";
const PRE: &str = "full backward pre-hook";

/// One call of a module with backward hooks: its hooks, and the gradients met so far in the
/// backward. The graph's ops hold it; it lives as long as the graph.
pub(super) struct BackwardCall {
    path: Arc<str>,
    class_name: String,
    hooks: Vec<Armed<BackwardHookFn>>,
    pre: Vec<Armed<BackwardPreHookFn>>,
    state: Mutex<State>,
}

/// The shape, dtype and device of a tensor that requires a gradient (for the zero gradient of an
/// input that received none, and to check replacements).
#[derive(Clone)]
struct Meta {
    shape: Shape,
    dtype: DType,
    device: Device,
}

/// Which of the module's tensors.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Input,
    Output,
}

#[derive(Default)]
struct State {
    /// Per input / output position: `Some` for the tensors that require a gradient.
    inputs: Vec<Option<Meta>>,
    outputs: Vec<Option<Meta>>,
    /// The gradients the tags recorded in this backward, by position.
    grad_inputs: Vec<Option<Tensor>>,
    grad_outputs: Vec<Option<Tensor>>,
    /// The output gradients as the pre-hooks left them, for the full hooks; `None` until the
    /// outputs' gate ran in this backward.
    seen_outputs: Option<Vec<Option<Tensor>>>,
    /// What each side's gates hand on, by position, taken as handed.
    handed_inputs: Vec<Option<Tensor>>,
    handed_outputs: Vec<Option<Tensor>>,
}

impl BackwardCall {
    /// The backward hooks of a call of the module at `path`.
    pub(super) fn new(
        path: Arc<str>,
        class_name: String,
        hooks: Vec<Armed<BackwardHookFn>>,
        pre: Vec<Armed<BackwardPreHookFn>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            path,
            class_name,
            hooks,
            pre,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The call's inputs, each one that requires a gradient behind an identity whose backward
    /// records its gradient; `None` when there are no full hooks or no such input (nothing to
    /// replace).
    pub(super) fn wrap_inputs(self: &Arc<Self>, inputs: &[Tensor]) -> Result<Option<Vec<Tensor>>> {
        if self.hooks.is_empty() {
            return Ok(None);
        }
        self.wrap(Side::Input, inputs)
    }

    /// The call's outputs, likewise (`None`: none requires a gradient).
    pub(super) fn wrap_outputs(
        self: &Arc<Self>,
        outputs: &[Tensor],
    ) -> Result<Option<Vec<Tensor>>> {
        self.wrap(Side::Output, outputs)
    }

    fn wrap(self: &Arc<Self>, side: Side, tensors: &[Tensor]) -> Result<Option<Vec<Tensor>>> {
        let metas: Vec<Option<Meta>> = tensors
            .iter()
            .map(|t| {
                requires_grad(t).then(|| Meta {
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                    device: t.device().clone(),
                })
            })
            .collect();
        let tracked: Vec<(usize, &Tensor)> = tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| metas[*i].is_some())
            .collect();
        {
            let mut state = self.state();
            match side {
                Side::Input => state.inputs = metas,
                Side::Output => state.outputs = metas,
            }
        }
        if tracked.is_empty() {
            return Ok(None);
        }
        let gate = self.gate(side, &tracked, true)?;
        let mut wrapped = tensors.to_vec();
        for &(slot, t) in &tracked {
            let tag = Tag {
                call: self.clone(),
                side,
                slot,
            };
            wrapped[slot] = t.apply_op2(&gate, tag)?;
        }
        Ok(Some(wrapped))
    }

    /// The gate of `tracked` (position, tensor): one op of up to three of them, the rest in a
    /// gate of their own passed as its third argument.
    fn gate(
        self: &Arc<Self>,
        side: Side,
        tracked: &[(usize, &Tensor)],
        top: bool,
    ) -> Result<Tensor> {
        let gate = |n: usize| Gate {
            call: self.clone(),
            side,
            slots: tracked[..n].iter().map(|(i, _)| *i).collect(),
            top,
        };
        Ok(match tracked {
            [(_, a)] => a.apply_op1(gate(1))?,
            [(_, a), (_, b)] => a.apply_op2(b, gate(2))?,
            [(_, a), (_, b), (_, c)] => a.apply_op3(b, c, gate(3))?,
            [(_, a), (_, b), rest @ ..] => {
                let inner = self.gate(side, rest, false)?;
                a.apply_op3(b, &inner, gate(2))?
            }
            [] => unreachable!("a gate of no tensor is never made"),
        })
    }

    fn ctx<'a, F: ?Sized>(&'a self, hook: &'a Armed<F>) -> BackwardHookCtx<'a> {
        BackwardHookCtx {
            path: &self.path,
            class_name: &self.class_name,
            registry: &hook.registry,
            id: hook.id,
        }
    }

    /// A tag's backward: the gradient of the tensor at `slot` of `side`.
    fn record(&self, side: Side, slot: usize, grad: &Tensor) {
        let mut state = self.state();
        let grads = match side {
            Side::Input => &mut state.grad_inputs,
            Side::Output => &mut state.grad_outputs,
        };
        if grads.len() <= slot {
            grads.resize(slot + 1, None);
        }
        grads[slot] = Some(grad.clone());
    }

    /// The outputs' gate is reached: every output gradient is known. Runs the pre-hooks, then,
    /// when no input requires a gradient, the full hooks (PyTorch calls them here too, with
    /// `None` for every input).
    fn outputs_ready(&self) -> Result<()> {
        let (mut grads, metas, n_inputs, no_input) = {
            let mut state = self.state();
            let n = state.outputs.len();
            let mut grads = std::mem::take(&mut state.grad_outputs);
            grads.resize(n, None);
            let no_input = state.inputs.iter().all(Option::is_none);
            (grads, state.outputs.clone(), state.inputs.len(), no_input)
        };
        for hook in &self.pre {
            let new = (hook.f)(&self.ctx(hook), &grads).map_err(|e| self.failed(PRE, e))?;
            if let Some(new) = new {
                grads = self.checked(PRE, Side::Output, &metas, new)?;
            }
        }
        let mut seen = None;
        if no_input {
            let none = vec![None; n_inputs];
            for hook in &self.hooks {
                let new =
                    (hook.f)(&self.ctx(hook), &none, &grads).map_err(|e| self.failed(FULL, e))?;
                if new.is_some_and(|new| new.iter().any(Option::is_some)) {
                    let path = self.path.to_string();
                    return Err(Error::from(BackwardHookError::NoInputGrad { path }));
                }
            }
        } else if !self.hooks.is_empty() {
            seen = Some(grads.clone());
        }
        let mut state = self.state();
        state.seen_outputs = seen;
        state.handed_outputs = grads;
        Ok(())
    }

    /// The inputs' gate is reached: every input gradient is known. Runs the full hooks with them
    /// (zeros for an input that requires a gradient and received none, as PyTorch's) and the
    /// output gradients; none if the outputs' gate was not reached (a gradient that reached the
    /// inputs without passing through the outputs, as PyTorch).
    fn inputs_ready(&self) -> Result<()> {
        let (grads, seen, metas) = {
            let mut state = self.state();
            let grads = std::mem::take(&mut state.grad_inputs);
            (grads, state.seen_outputs.take(), state.inputs.clone())
        };
        let mut grads: Vec<Option<Tensor>> = metas
            .iter()
            .enumerate()
            .map(|(i, meta)| match (grads.get(i).cloned().flatten(), meta) {
                (None, Some(m)) => Some(Tensor::zeros(&m.shape, m.dtype, &m.device)).transpose(),
                (g, _) => Ok(g),
            })
            .collect::<candle_core::Result<_>>()?;
        if let Some(outputs) = seen {
            for hook in &self.hooks {
                let new = (hook.f)(&self.ctx(hook), &grads, &outputs)
                    .map_err(|e| self.failed(FULL, e))?;
                if let Some(new) = new {
                    grads = self.checked(FULL, Side::Input, &metas, new)?;
                }
            }
        }
        self.state().handed_inputs = grads;
        Ok(())
    }

    /// A hook's replacement, checked against the tensors it replaces: as many, and for each that
    /// requires a gradient, the same shape and dtype (entries for the others are ignored, as
    /// PyTorch's).
    fn checked(
        &self,
        hook: &'static str,
        side: Side,
        metas: &[Option<Meta>],
        new: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        if new.len() != metas.len() {
            return Err(Error::HookTensorCount {
                path: self.path.to_string(),
                hook,
                expected: metas.len(),
                got: new.len(),
            });
        }
        let name = match side {
            Side::Input => "input",
            Side::Output => "output",
        };
        for (i, (meta, t)) in metas.iter().zip(&new).enumerate() {
            if let (Some(meta), Some(t)) = (meta, t) {
                check_grad(t, &meta.shape, meta.dtype, (&self.path, hook, name, i))?;
            }
        }
        Ok(new)
    }

    fn failed(&self, hook: &'static str, source: Error) -> Error {
        Error::Hook {
            path: self.path.to_string(),
            hook,
            source: Box::new(source),
        }
    }

    /// What a gate hands the tensor `arg` at `slot` of `side`: the gradient its hooks left, or
    /// zeros (for an output that received no gradient, or a hook's `None`).
    fn hand(&self, side: Side, slot: usize, arg: &Tensor) -> candle_core::Result<Tensor> {
        let handed = {
            let mut state = self.state();
            let handed = match side {
                Side::Input => &mut state.handed_inputs,
                Side::Output => &mut state.handed_outputs,
            };
            handed.get_mut(slot).and_then(Option::take)
        };
        match handed {
            Some(g) => Ok(g),
            None => arg.zeros_like(),
        }
    }
}

/// The identity on one tensor of a module's inputs or outputs: its backward records the gradient
/// and hands it to nothing but the gate (a zero), which hands it on.
struct Tag {
    call: Arc<BackwardCall>,
    side: Side,
    slot: usize,
}

impl candle_core::CustomOp2 for Tag {
    fn name(&self) -> &'static str {
        "backward-hook-tag"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        copy_cpu(s, l)
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        copy(s, l)
    }

    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
        _: &candle_core::MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        copy(s, l)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        gate: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        self.call.record(self.side, self.slot, grad);
        Ok((None, Some(gate.zeros_like()?)))
    }
}

/// The op all of one side's tags depend on (see the module docs): `slots` are the positions of
/// its first arguments; an argument past them is the gate of the rest.
struct Gate {
    call: Arc<BackwardCall>,
    side: Side,
    slots: Vec<usize>,
    /// The outer-most gate, reached first: it runs the hooks.
    top: bool,
}

impl Gate {
    /// The backward: runs the hooks if this is the top gate, then hands each argument its
    /// gradient.
    fn hand(&self, args: &[&Tensor]) -> candle_core::Result<Vec<Option<Tensor>>> {
        if self.top {
            match self.side {
                Side::Output => self.call.outputs_ready(),
                Side::Input => self.call.inputs_ready(),
            }
            .map_err(to_candle)?;
        }
        args.iter()
            .enumerate()
            .map(|(i, arg)| match self.slots.get(i) {
                Some(&slot) => self.call.hand(self.side, slot, arg).map(Some),
                // The nested gate's share: nothing flows through it but this zero.
                None => arg.zeros_like().map(Some),
            })
            .collect()
    }
}

impl candle_core::CustomOp1 for Gate {
    fn name(&self) -> &'static str {
        "backward-hook-gate"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar(s)
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        scalar(s)
    }

    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        scalar(s)
    }

    fn bwd(&self, a: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(self.hand(&[a])?.pop().flatten())
    }
}

impl candle_core::CustomOp2 for Gate {
    fn name(&self) -> &'static str {
        "backward-hook-gate"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar(s)
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        scalar(s)
    }

    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        _: &Layout,
        _: &candle_core::MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        scalar(s)
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.hand(&[a, b])?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl candle_core::CustomOp3 for Gate {
    fn name(&self) -> &'static str {
        "backward-hook-gate"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar(s)
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        scalar(s)
    }

    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        _: &Layout,
        _: &candle_core::MetalStorage,
        _: &Layout,
        _: &candle_core::MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        scalar(s)
    }

    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.hand(&[a, b, c])?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}
