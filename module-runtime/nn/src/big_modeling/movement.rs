//! The hooks a dispatched model runs with: each placed module's inputs moved to its device where
//! the placement changes (and, inside another placed module on another device, its outputs moved
//! back out), the model's output brought back to the caller's device; and what they record
//! ([`DispatchTrace`], [`Move`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use candle_core::{Device, Tensor};

use super::offload::LoadCounter;
use crate::error::Result;
use crate::hooks::{HookCtx, HookOptions, Hooks, PreHookOptions};
use module_core::device_name;

/// Activations moved at a boundary: the inputs of the module at `path` (or, at `""`, the
/// model's output on its way back to the caller) moved from one placement to another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// The placed module whose inputs moved (an inner placed module's *outputs* move back to its
    /// enclosing one's device under the inner path); `""` for the output returned to the caller.
    pub path: String,
    /// The placement the tensors were on (`cpu` for the caller's CPU tensors).
    pub from: String,
    /// The placement they moved to.
    pub to: String,
    /// How many tensors moved.
    pub tensors: usize,
}

/// What a dispatched model did: the moves of its last call, and how many offloaded weights
/// (`cpu` on a GPU map, `disk`) were read since the dispatch, with their bytes. For tests and
/// for seeing what a map costs.
#[derive(Debug, Default)]
pub struct DispatchTrace {
    moves: Mutex<Vec<Move>>,
    counter: Arc<LoadCounter>,
}

impl DispatchTrace {
    pub(super) fn new(counter: Arc<LoadCounter>) -> Self {
        Self {
            moves: Mutex::default(),
            counter,
        }
    }

    /// The boundary moves of the last call, in the order they happened.
    pub fn moves(&self) -> Vec<Move> {
        self.moves
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many times an offloaded weight was read (each layer reads its weights once per call;
    /// a state dict reads each once).
    pub fn loads(&self) -> usize {
        self.counter.loads.load(Ordering::Relaxed)
    }

    /// The bytes those reads made.
    pub fn bytes_loaded(&self) -> usize {
        self.counter.bytes.load(Ordering::Relaxed)
    }

    fn record(&self, m: Move) {
        self.moves
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(m);
    }
}

/// A placed module: where its activations must be (the device it computes on, by name).
pub(super) struct Unit {
    pub(super) path: String,
    pub(super) placement: String,
    pub(super) label: String,
    pub(super) device: Device,
}

/// The per-thread state of dispatched calls: the caller's placement and device, the placed
/// modules being called (innermost last), and where the activations are now.
#[derive(Default)]
struct CallState {
    caller: Option<(String, Device)>,
    frames: Vec<(String, Device)>,
    current: String,
}

type Calls = Arc<Mutex<HashMap<ThreadId, CallState>>>;

fn with_state<R>(calls: &Calls, f: impl FnOnce(&mut CallState) -> R) -> R {
    let mut calls = calls.lock().unwrap_or_else(PoisonError::into_inner);
    f(calls.entry(std::thread::current().id()).or_default())
}

/// `tensors` on `device`, and whether any of them was elsewhere.
fn moved_to(tensors: &[Tensor], device: &Device) -> Result<(Vec<Tensor>, bool)> {
    let mut any = false;
    let out = tensors
        .iter()
        .map(|t| match t.device().same_device(device) {
            true => Ok(t.clone()),
            false => {
                any = true;
                Ok(t.to_device(device)?)
            }
        })
        .collect::<Result<_>>()?;
    Ok((out, any))
}

/// The hooks of a dispatch: at the root, the caller's device noted before and the output brought
/// back after; at each placed module, its inputs moved in before and (inside another placed
/// module on another device) its outputs moved back out after.
pub(super) fn movement_hooks(units: &[Unit], trace: &Arc<DispatchTrace>) -> Result<Hooks> {
    let hooks = Hooks::new();
    let calls: Calls = Arc::default();
    let (c, t) = (calls.clone(), trace.clone());
    hooks.register_forward_pre_hook(
        "",
        move |_ctx: &HookCtx<'_>, input: &[Tensor]| {
            let device = input.first().map_or(Device::Cpu, |x| x.device().clone());
            let label = device_name(&device);
            t.moves
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
            with_state(&c, |s| {
                *s = CallState {
                    caller: Some((label.clone(), device)),
                    frames: Vec::new(),
                    current: label,
                }
            });
            Ok(None)
        },
        PreHookOptions::default(),
    )?;
    for unit in units {
        let (c, t) = (calls.clone(), trace.clone());
        let (label, device, path) = (unit.label.clone(), unit.device.clone(), unit.path.clone());
        hooks.register_forward_pre_hook(
            &unit.path,
            move |_ctx: &HookCtx<'_>, input: &[Tensor]| {
                let (moved, any) = moved_to(input, &device)?;
                let from = with_state(&c, |s| {
                    let from = std::mem::replace(&mut s.current, label.clone());
                    s.frames.push((label.clone(), device.clone()));
                    from
                });
                if from != label || any {
                    t.record(Move {
                        path: path.clone(),
                        from,
                        to: label.clone(),
                        tensors: input.len(),
                    });
                }
                Ok(any.then_some(moved))
            },
            PreHookOptions::default(),
        )?;
    }
    for unit in units {
        let (c, t) = (calls.clone(), trace.clone());
        let (label, path) = (unit.label.clone(), unit.path.clone());
        hooks.register_forward_hook(
            &unit.path,
            move |ctx: &HookCtx<'_>, _input: &[Tensor], output: &[Tensor]| {
                let outer = with_state(&c, |s| {
                    s.frames.pop();
                    let outer = s.frames.last().cloned();
                    if let Some((outer_label, _)) = &outer {
                        s.current = outer_label.clone();
                    }
                    outer
                });
                match outer {
                    Some((outer_label, device)) if outer_label != label && !ctx.failed() => {
                        t.record(Move {
                            path: path.clone(),
                            from: label.clone(),
                            to: outer_label,
                            tensors: output.len(),
                        });
                        Ok(Some(moved_to(output, &device)?.0))
                    }
                    _ => Ok(None),
                }
            },
            HookOptions::default().always_call(),
        )?;
    }
    let (c, t) = (calls, trace.clone());
    hooks.register_forward_hook(
        "",
        move |ctx: &HookCtx<'_>, _input: &[Tensor], output: &[Tensor]| {
            let state = c
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&std::thread::current().id());
            let Some(CallState {
                caller: Some((caller, device)),
                current,
                ..
            }) = state
            else {
                return Ok(None);
            };
            let (moved, any) = moved_to(output, &device)?;
            if (current != caller || any) && !ctx.failed() {
                t.record(Move {
                    path: String::new(),
                    from: current,
                    to: caller,
                    tensors: output.len(),
                });
            }
            Ok(any.then_some(moved))
        },
        HookOptions::default().always_call(),
    )?;
    Ok(hooks)
}
