//! `expect_outputs`: compare submodule outputs with expected tensors (Ivy's
//! `expected_submod_rets`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Shape, Tensor};

use crate::error::{Error, Result};
use crate::hooks::{Captures, HookOptions, Hooks, PreHookOptions};
use crate::module::Module;
use module_core::{OutputDivergence, Tolerance};

/// A diverging call, with when it started among the checked calls.
struct Divergence {
    start: usize,
    path: String,
    call: usize,
    output: usize,
    max_diff: f64,
    expected_shape: Shape,
    shape: Shape,
}

#[derive(Default)]
struct State {
    next_start: usize,
    /// Per path: how many calls started, and the start numbers of the calls still running.
    started: HashMap<String, (usize, Vec<(usize, usize)>)>,
    divergences: Vec<Divergence>,
}

pub(crate) fn expect_outputs<M: Module, R>(
    root: &M,
    expected: &Captures,
    tolerance: Tolerance,
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<R> {
    let mut by_path: HashMap<String, Vec<Vec<Tensor>>> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for (path, outputs) in expected.iter() {
        if !by_path.contains_key(path) {
            order.push(path.to_owned());
        }
        by_path
            .entry(path.to_owned())
            .or_default()
            .push(outputs.to_vec());
    }
    let by_path = Arc::new(by_path);
    let state = Arc::new(Mutex::new(State::default()));
    let hooks = Hooks::new();
    for path in &order {
        let pre_state = state.clone();
        hooks.register_forward_pre_hook(
            path,
            move |ctx, _| {
                let mut s = pre_state.lock().unwrap_or_else(PoisonError::into_inner);
                let start = s.next_start;
                s.next_start += 1;
                let entry = s.started.entry(ctx.path().to_owned()).or_default();
                entry.1.push((start, entry.0));
                entry.0 += 1;
                Ok(None)
            },
            PreHookOptions::default(),
        )?;
        let (state, by_path) = (state.clone(), by_path.clone());
        hooks.register_forward_hook(
            path,
            move |ctx, _, outputs| {
                let (start, call) = {
                    let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
                    let entry = s.started.entry(ctx.path().to_owned()).or_default();
                    entry.1.pop().unwrap_or((usize::MAX, entry.0))
                };
                let Some(wanted) = by_path.get(ctx.path()).and_then(|calls| calls.get(call)) else {
                    return Ok(None);
                };
                if let Some(d) = compare(wanted, outputs, tolerance)? {
                    let (output, max_diff, expected_shape, shape) = d;
                    state
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .divergences
                        .push(Divergence {
                            start,
                            path: ctx.path().to_owned(),
                            call,
                            output,
                            max_diff,
                            expected_shape,
                            shape,
                        });
                }
                Ok(None)
            },
            HookOptions::default(),
        )?;
    }
    let out = hooks.run(root, run)?;
    let mut state = std::mem::take(&mut *state.lock().unwrap_or_else(PoisonError::into_inner));
    if !state.divergences.is_empty() {
        state.divergences.sort_by_key(|d| d.start);
        let diverging = (state.divergences.iter())
            .map(|d| match d.call {
                0 => d.path.clone(),
                n => format!("{}#{n}", d.path),
            })
            .collect();
        let first = state.divergences.swap_remove(0);
        return Err(Error::OutputMismatch(Box::new(OutputDivergence {
            path: first.path,
            call: first.call,
            output: first.output,
            max_diff: first.max_diff,
            tolerance,
            expected_shape: first.expected_shape,
            shape: first.shape,
            diverging,
        })));
    }
    // Every expected call must have happened.
    for path in &order {
        let calls = state.started.get(path).map_or(0, |(n, _)| *n);
        if calls < by_path[path].len() {
            return Err(Error::NotRun {
                pattern: path.clone(),
                matched: vec![format!(
                    "{path} ({calls} of {} expected calls ran)",
                    by_path[path].len()
                )],
            });
        }
    }
    Ok(out)
}

/// The first output that is not close to the expected one: its index, the largest absolute
/// difference, and both shapes.
fn compare(
    expected: &[Tensor],
    got: &[Tensor],
    tolerance: Tolerance,
) -> Result<Option<(usize, f64, Shape, Shape)>> {
    for (i, (want, have)) in expected.iter().zip(got).enumerate() {
        if want.shape() != have.shape() {
            return Ok(Some((
                i,
                f64::INFINITY,
                want.shape().clone(),
                have.shape().clone(),
            )));
        }
        let want64 = want.to_device(have.device())?.to_dtype(DType::F64)?;
        let have64 = have.detach().to_dtype(DType::F64)?;
        let diff = (&have64 - &want64)?.abs()?;
        let bound = ((want64.abs()? * tolerance.rtol)? + tolerance.atol)?;
        let close = diff.le(&bound)?.to_dtype(DType::U32)?.sum_all()?;
        let close = close.to_scalar::<u32>()? as usize;
        if close != diff.elem_count() {
            let max_diff = if diff.elem_count() == 0 {
                0.0
            } else {
                diff.flatten_all()?.max(0)?.to_scalar::<f64>()?
            };
            // A NaN difference is not close; report it as such.
            let max_diff = if max_diff.is_nan() || close + count_nan(&diff)? < diff.elem_count() {
                max_diff
            } else {
                f64::NAN
            };
            return Ok(Some((
                i,
                max_diff,
                want.shape().clone(),
                have.shape().clone(),
            )));
        }
    }
    if expected.len() != got.len() {
        let i = expected.len().min(got.len());
        let shape = |ts: &[Tensor]| ts.get(i).map_or(Shape::from(()), |t| t.shape().clone());
        return Ok(Some((i, f64::INFINITY, shape(expected), shape(got))));
    }
    Ok(None)
}

fn count_nan(t: &Tensor) -> Result<usize> {
    let nan = t.ne(t)?.to_dtype(DType::U32)?.sum_all()?;
    Ok(nan.to_scalar::<u32>()? as usize)
}
