//! What is built on hooks: capturing outputs by path pattern, the call order, and the shapes of a
//! summary.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::Tensor;

use super::{HookOptions, Hooks, PreHookOptions};
use crate::error::{Error, Result};
use crate::module::Module;

/// The outputs of the modules a [`capture`](crate::ModuleExt::capture) watched, in call order (a
/// module called twice appears twice).
#[derive(Clone, Debug, Default)]
pub struct Captures {
    entries: Vec<(String, Vec<Tensor>)>,
}

impl Captures {
    /// How many calls were captured.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing was captured.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The (first) output tensor of the first call of the module at `path`.
    pub fn get(&self, path: &str) -> Option<&Tensor> {
        self.outputs(path).and_then(<[Tensor]>::first)
    }

    /// Every output tensor of the first call of the module at `path`.
    pub fn outputs(&self, path: &str) -> Option<&[Tensor]> {
        self.entries
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, t)| t.as_slice())
    }

    /// The captured paths, in call order.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(p, _)| p.as_str())
    }

    /// Every captured call: the path and the output tensors.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[Tensor])> {
        self.entries.iter().map(|(p, t)| (p.as_str(), t.as_slice()))
    }

    /// The captured calls, owned.
    pub fn into_vec(self) -> Vec<(String, Vec<Tensor>)> {
        self.entries
    }
}

/// Expected outputs built by hand (for [`expect_outputs`](../module_runtime/trait.FunctionalExt.html#method.expect_outputs)),
/// for instance from a reference implementation's tensors saved by path: each `(path, tensor)` is
/// one call of the module at `path` with one output, in order.
///
/// ```
/// use module_runtime::{candle_core::{Device, Tensor}, Captures};
/// let expected: Captures = [("fc1", Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?)]
///     .into_iter()
///     .collect();
/// assert_eq!(expected.paths().collect::<Vec<_>>(), ["fc1"]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
impl<K: Into<String>> FromIterator<(K, Tensor)> for Captures {
    fn from_iter<I: IntoIterator<Item = (K, Tensor)>>(iter: I) -> Self {
        Self {
            entries: iter.into_iter().map(|(k, t)| (k.into(), vec![t])).collect(),
        }
    }
}

pub fn capture<M: Module, R>(
    root: &M,
    patterns: &[&str],
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<(R, Captures)> {
    let hooks = Hooks::new();
    let store = Arc::new(Mutex::new(Vec::new()));
    let ran: Arc<Vec<AtomicBool>> =
        Arc::new(patterns.iter().map(|_| AtomicBool::new(false)).collect());
    for (i, pattern) in patterns.iter().enumerate() {
        let store = store.clone();
        let ran = ran.clone();
        hooks.register_forward_hook(
            pattern,
            move |ctx, _input, output| {
                ran[i].store(true, Ordering::Relaxed);
                store
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((ctx.path().to_owned(), output.to_vec()));
                Ok(None)
            },
            HookOptions::default(),
        )?;
    }
    let out = hooks.run(root, run)?;
    let entries = std::mem::take(&mut *store.lock().unwrap_or_else(PoisonError::into_inner));
    // A pattern that matches modules none of which ran is as silent as a typo: say so.
    for (i, pattern) in patterns.iter().enumerate() {
        if !ran[i].load(Ordering::Relaxed) {
            let parsed = crate::pattern::PathPattern::new(pattern)?;
            let table = super::call_table::CallTable::of(root);
            let matched = table.paths().filter(|p| parsed.matches(p));
            return Err(Error::NotRun {
                pattern: (*pattern).to_owned(),
                matched: matched.take(5).map(str::to_owned).collect(),
            });
        }
    }
    Ok((out, Captures { entries }))
}

pub fn call_order<M: Module, R>(
    root: &M,
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<(R, Vec<String>)> {
    let hooks = Hooks::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let sink = order.clone();
    hooks.register_global_forward_pre_hook(
        move |ctx, _| {
            sink.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(ctx.path().to_owned());
            Ok(None)
        },
        PreHookOptions::default(),
    );
    let out = hooks.run(root, run)?;
    let order = std::mem::take(&mut *order.lock().unwrap_or_else(PoisonError::into_inner));
    Ok((out, order))
}

/// Input and output shapes of every module call, for [`ModuleExt::summary_with`](crate::ModuleExt::summary_with):
/// `path -> (input shapes, output shapes)` of the first call.
pub fn record_shapes<M: Module, R>(
    root: &M,
    run: impl FnOnce(&M) -> Result<R>,
) -> Result<Vec<(String, String, String)>> {
    type Rows = Vec<(String, String, String)>;
    let hooks = Hooks::new();
    let rows: Arc<Mutex<Rows>> = Arc::default();
    let sink = rows.clone();
    hooks.register_global_forward_hook(
        move |ctx, input, output| {
            let mut rows = sink.lock().unwrap_or_else(PoisonError::into_inner);
            if !rows.iter().any(|(p, _, _)| p == ctx.path()) {
                rows.push((ctx.path().to_owned(), shapes(input), shapes(output)));
            }
            Ok(None)
        },
        HookOptions::default(),
    );
    hooks.run(root, run)?;
    let rows = std::mem::take(&mut *rows.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(rows)
}

/// `[2, 3]`, or `[2, 3], [4]` for several tensors.
fn shapes(tensors: &[Tensor]) -> String {
    tensors
        .iter()
        .map(|t| format!("{:?}", t.dims()))
        .collect::<Vec<_>>()
        .join(", ")
}
