//! Load-state-dict post-hooks (PyTorch's `register_load_state_dict_post_hook`): functions given
//! to [`LoadOptions::post_hook`](crate::LoadOptions::post_hook) that see, and may edit, the
//! missing and unexpected keys of a load before its strictness is decided.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::module::Module;
use crate::report::{LoadReport, Mismatch};
use crate::walk::{walk, Visit};

/// A load-state-dict post-hook: called with the module it is registered on and the load's
/// [`IncompatibleKeys`], which it may edit in place.
pub type LoadPostHookFn =
    dyn Fn(&dyn Module, &mut IncompatibleKeys<'_>) -> Result<()> + Send + Sync;

/// What a load post-hook sees: PyTorch's `incompatible_keys` (`_IncompatibleKeys(missing_keys,
/// unexpected_keys)`), editable in place.
///
/// Keys are full paths from the module the load was called on, after the load's key rules, as in
/// PyTorch. Removing a key accepts it: a strict load with nothing left missing or unexpected
/// succeeds. Adding one makes a strict load fail. The shape and dtype mismatches are only shown:
/// a value that does not fit cannot be loaded, so they fail the load whatever the hooks do (PyTorch
/// reports them through `error_msgs`, which hooks do not see either).
pub struct IncompatibleKeys<'a> {
    /// Model paths the checkpoint has no value for.
    pub missing_keys: &'a mut Vec<String>,
    /// Checkpoint keys that name nothing in the model.
    pub unexpected_keys: &'a mut Vec<String>,
    mismatched: &'a [Mismatch],
}

impl IncompatibleKeys<'_> {
    /// The entries whose shape or dtype does not fit (read only).
    pub fn mismatched(&self) -> &[Mismatch] {
        self.mismatched
    }

    /// Whether nothing is missing or unexpected (PyTorch's `<All keys matched successfully>`).
    pub fn is_empty(&self) -> bool {
        self.missing_keys.is_empty() && self.unexpected_keys.is_empty()
    }
}

/// The post-hooks of a [`LoadOptions`](crate::LoadOptions), each with the path of the module it
/// is registered on.
#[derive(Clone, Default)]
pub struct PostHooks(Vec<(String, Arc<LoadPostHookFn>)>);

impl std::fmt::Debug for PostHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(p, _)| p))
            .finish()
    }
}

impl PostHooks {
    pub fn push(&mut self, path: String, hook: Arc<LoadPostHookFn>) {
        self.0.push((path, hook));
    }

    /// Runs the hooks on `report`, children's before their parents' (PyTorch's `load` recursion
    /// runs a module's hooks after its children's), each module's in registration order. Fails
    /// with [`Error::NoSubmodule`] if a hook's path names no module (before any hook runs), or
    /// with [`Error::Hook`] if a hook fails.
    pub fn run(&self, root: &dyn Module, report: &mut LoadReport) -> Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let mut hooks = Vec::with_capacity(self.0.len());
        for (path, hook) in &self.0 {
            hooks.push((path.as_str(), crate::path::submodule(root, path)?, hook));
        }
        let mut preorder: HashMap<String, usize> = HashMap::new();
        walk(root, false, &mut |path, v| {
            if matches!(v, Visit::Module(_)) {
                let n = preorder.len();
                preorder.entry(path.to_owned()).or_insert(n);
            }
            true
        });
        // Post-order: a module after everything under it, unrelated modules in pre-order.
        hooks.sort_by(|(a, ..), (b, ..)| {
            if is_under(b, a) {
                std::cmp::Ordering::Greater
            } else if is_under(a, b) {
                std::cmp::Ordering::Less
            } else {
                preorder.get(*a).cmp(&preorder.get(*b))
            }
        });
        for (path, module, hook) in hooks {
            let mut keys = IncompatibleKeys {
                missing_keys: &mut report.missing,
                unexpected_keys: &mut report.unexpected,
                mismatched: &report.mismatched,
            };
            hook(module, &mut keys).map_err(|e| Error::Hook {
                path: path.to_owned(),
                hook: "load_state_dict post-hook",
                source: Box::new(e),
            })?;
        }
        Ok(())
    }
}

/// Whether `path` is strictly under `module` (`""` is the root).
fn is_under(path: &str, module: &str) -> bool {
    path != module
        && (module.is_empty()
            || (path.starts_with(module) && path.as_bytes().get(module.len()) == Some(&b'.')))
}
