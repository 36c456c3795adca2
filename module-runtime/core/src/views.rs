//! The views PyTorch users know, each one walk: `apply`, freezing by pattern, train/eval modes,
//! and what is still unbuilt. The `named_*` listings are in `names.rs`.

use crate::error::{Error, Result};
use crate::identity::IdentitySet;
use crate::module::{Child, Module};
use crate::names::Names;
use crate::param::Param;
use crate::pattern::PathPattern;
use crate::walk::{walk, Visit};

/// Calls `f` on every module, children before their parent, as PyTorch's `Module.apply` recurses:
/// `for module in self.children(): module.apply(fn)`, then `fn(self)`. `children()` drops
/// duplicates among one module's children only, so a module shared at two depths is visited at
/// each (`torch/nn/modules/module.py`, `Module.apply` and `Module.named_children`).
pub fn apply(root: &dyn Module, f: &mut dyn FnMut(&dyn Module)) {
    let mut children: Vec<&dyn Module> = Vec::new();
    let mut seen = IdentitySet::default();
    root.visit_children(&mut |_, child| {
        if let Child::Module { module, shared } = child
            && shared.is_none_or(|s| seen.insert(s.id))
        {
            children.push(module);
        }
    });
    for child in children {
        apply(child, f);
    }
    f(root);
}

/// Sets `requires_grad` on every parameter at or under a path matching `pattern`; returns how many
/// parameters matched, or [`Error::NoMatch`](crate::Error::NoMatch) naming some that exist.
pub fn set_requires_grad(root: &dyn Module, pattern: &str, on: bool) -> Result<usize> {
    let pattern = PathPattern::new(pattern)?;
    let mut matched: Vec<Param> = Vec::new();
    let mut available = Vec::new();
    let every_alias = Names::new().keep_duplicates();
    for (path, p) in crate::names::named_parameters(root, &every_alias) {
        if pattern.matches_at_or_above(&path) {
            if !matched.iter().any(|m| m.same_as(&p)) {
                matched.push(p);
            }
        } else if available.len() < 8 {
            available.push(path);
        }
    }
    if matched.is_empty() {
        return Err(Error::NoMatch {
            pattern: pattern.as_str().to_owned(),
            available,
        });
    }
    for p in &matched {
        p.set_requires_grad(on);
    }
    Ok(matched.len())
}

/// Sets every [`Mode`](crate::Mode) flag under `root`, and records the flag of `root` and of every
/// module under it with its first leaf (see [`ModeMarks`](crate::identity::ModeMarks)), as
/// PyTorch's `train(mode)` sets `training` on every module of the subtree.
pub fn set_training(root: &dyn Module, training: bool) {
    // Modules (by path) whose first leaf the walk has not reached yet, outermost first.
    let mut pending: Vec<String> = Vec::new();
    walk(root, false, &mut |path, v| {
        // A pending module whose subtree the walk has left has no leaf at all.
        while let Some(module) = pending.last() {
            let inside = module.is_empty()
                || (path.starts_with(module.as_str())
                    && path.as_bytes().get(module.len()) == Some(&b'.'));
            if inside {
                break;
            }
            pending.pop();
        }
        let marks = match v {
            Visit::Module(_) => {
                pending.push(path.to_owned());
                return true;
            }
            Visit::Mode(m) => {
                m.set_training(training);
                m.mode_marks()
            }
            Visit::Extra(_) => return true,
            Visit::Param(p) => p.mode_marks(),
            Visit::Buffer(b) => b.mode_marks(),
        };
        for module in pending.drain(..) {
            marks.set(path[module.len()..].trim_start_matches('.'), training);
        }
        true
    });
}

/// `root`'s own flag, as PyTorch's `module.training`, which only `train`/`eval` on the module or
/// on a module above it change (never `eval` on a child):
///
/// 1. a [`Mode`](crate::Mode) that is a direct field of `root` (the runtime's Dropout, BatchNorm,
///    activations, or a user module's own flag) is its flag;
/// 2. otherwise the flag [`set_training`] last recorded for `root` in its first leaf (parameter,
///    buffer or `Mode`, in walk order);
/// 3. otherwise `true`: nothing was recorded for `root` itself since it was built, and new
///    modules are in training mode, whatever mode its children were put in.
pub fn is_training(root: &dyn Module) -> bool {
    let mut own = None;
    root.visit_children(&mut |_, child| {
        if let (None, Child::Mode(m)) = (own, child) {
            own = Some(m.is_training());
        }
    });
    if let Some(training) = own {
        return training;
    }
    let mut recorded = None;
    let mut leaf_seen = false;
    walk(root, false, &mut |path, v| {
        if leaf_seen {
            return false;
        }
        let marks = match v {
            Visit::Param(p) => p.mode_marks(),
            Visit::Buffer(b) => b.mode_marks(),
            Visit::Mode(m) => m.mode_marks(),
            Visit::Module(_) => return true,
            Visit::Extra(_) => return true,
        };
        leaf_seen = true;
        recorded = marks.get(path);
        false
    });
    recorded.unwrap_or(true)
}

/// The path of every unbuilt parameter, buffer and [`Lazy`](../module_runtime/struct.Lazy.html) cell, each once.
pub fn unbuilt_paths(root: &dyn Module) -> Vec<String> {
    let mut out = Vec::new();
    walk(root, true, &mut |path, v| {
        let unbuilt = match v {
            Visit::Param(p) => !p.is_built(),
            Visit::Buffer(b) => !b.is_built(),
            Visit::Module(m) => m.__unbuilt(),
            Visit::Mode(_) | Visit::Extra(_) => false,
        };
        if unbuilt {
            out.push(path.to_owned());
        }
        true
    });
    out
}

/// Fails with [`Error::Unbuilt`](crate::Error::Unbuilt) (`"cannot {action} …"`) if anything in `root` is unbuilt.
pub fn ensure_built(root: &dyn Module, action: &'static str) -> Result<()> {
    let paths = unbuilt_paths(root);
    if paths.is_empty() {
        Ok(())
    } else {
        Err(Error::Unbuilt { action, paths })
    }
}

/// Fails if `root` holds an unbuilt [`Lazy`](../module_runtime/struct.Lazy.html) cell: a checkpoint cannot say what it would hold.
pub fn ensure_cells_built(root: &dyn Module, action: &'static str) -> Result<()> {
    let mut paths = Vec::new();
    walk(root, true, &mut |path, v| {
        if let Visit::Module(m) = v
            && m.__unbuilt()
        {
            paths.push(path.to_owned());
        }
        true
    });
    if paths.is_empty() {
        Ok(())
    } else {
        Err(Error::Unbuilt { action, paths })
    }
}
