//! The one walk every traversal is built on: depth first over the derive's
//! [`visit_children`](crate::Module::visit_children), growing the dotted path in place, with
//! PyTorch's memo set to list shared things once; every module's extra state by key (what the
//! state dict saves), and the one search for a called module.

use crate::buffer::Buffer;
use crate::extra_state::{ExtraState, EXTRA_STATE_KEY};
use crate::identity::{CallTarget, IdentitySet};
use crate::module::{Child, Mode, Module, Name};
use crate::param::Param;

/// The extra state saved at a module's `_extra_state` key: its own, or else the first one its
/// `#[module(flatten)]`ed fields lift to its level (a flattened field's children are listed as
/// the parent's own, and so is its extra state). Two of them at one module are refused by the
/// state dict and loads ([`check_keys`](crate::path::check_keys)).
pub fn extra_state(module: &dyn Module) -> Option<&dyn ExtraState> {
    let mut found = module.extra_state();
    if found.is_none() {
        module.__flattened(&mut |_, field| {
            if found.is_none() {
                found = extra_state(field);
            }
        });
    }
    found
}

/// What a walk reaches.
pub enum Visit<'a> {
    Module(&'a dyn Module),
    Param(&'a Param),
    Buffer(&'a Buffer),
    Mode(&'a Mode),
    /// A module's extra state, at `<module path>._extra_state`.
    Extra(&'a dyn ExtraState),
}

/// Walks `root` depth-first in PyTorch's order (each module's own parameters, own buffers, then
/// submodules, each group in declaration order), calling `f` with each node's dotted path
/// (`""` for the root). `f` returns whether to descend into a module. With `dedup`, a module shared
/// through `Arc`, a parameter or a buffer reached a second time is skipped with everything under it
/// (PyTorch's memo set: the first path wins).
pub fn walk<'a>(root: &'a dyn Module, dedup: bool, f: &mut dyn FnMut(&str, Visit<'a>) -> bool) {
    let mut walker = Walker {
        path: String::new(),
        dedup,
        seen: IdentitySet::default(),
        f,
    };
    walker.module(root);
}

/// The three groups a module's children are listed in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Param,
    Buffer,
    Other,
}

impl Kind {
    fn of(child: &Child<'_>) -> Self {
        match child {
            Child::Param(_) => Kind::Param,
            Child::Buffer(_) => Kind::Buffer,
            _ => Kind::Other,
        }
    }
}

struct Walker<'a, 'f> {
    path: String,
    dedup: bool,
    seen: IdentitySet,
    f: &'f mut dyn FnMut(&str, Visit<'a>) -> bool,
}

impl<'a> Walker<'a, '_> {
    fn module(&mut self, module: &'a dyn Module) {
        if (self.f)(&self.path, Visit::Module(module)) {
            self.children(module);
        }
    }

    /// A module's children in PyTorch's order, whatever the field order: its own parameters, then
    /// its own buffers, then its submodules (`Module._save_to_state_dict` writes `_parameters`, then
    /// `_buffers`, before recursing into `_modules`; `named_parameters` lists each module's own
    /// parameters before its submodules'). Within each kind, declaration order. A module's extra
    /// state comes after its buffers (`_save_to_state_dict` writes it last).
    fn children(&mut self, module: &'a dyn Module) {
        for kind in [Kind::Param, Kind::Buffer, Kind::Other] {
            module.visit_children(&mut |name, child| {
                if Kind::of(&child) == kind {
                    self.child(name, child)
                }
            });
            if kind == Kind::Buffer
                && let Some(extra) = extra_state(module)
            {
                let len = self.path.len();
                Name::Field(EXTRA_STATE_KEY).push_to(&mut self.path);
                (self.f)(&self.path, Visit::Extra(extra));
                self.path.truncate(len);
            }
        }
    }

    fn child(&mut self, name: Name<'_>, child: Child<'a>) {
        let identity = match child {
            Child::Module { shared, .. } => shared.map(|s| s.id),
            Child::Param(p) => p.has_aliases().then(|| p.id()),
            Child::Buffer(b) => b.has_aliases().then(|| b.id()),
            Child::Mode(_) | Child::Absent => None,
        };
        if self.dedup && identity.is_some_and(|id| !self.seen.insert(id)) {
            return;
        }
        let len = self.path.len();
        name.push_to(&mut self.path);
        match child {
            Child::Module { module, .. } => self.module(module),
            Child::Param(p) => {
                (self.f)(&self.path, Visit::Param(p));
            }
            Child::Buffer(b) => {
                (self.f)(&self.path, Visit::Buffer(b));
            }
            Child::Mode(m) => {
                (self.f)(&self.path, Visit::Mode(m));
            }
            Child::Absent => {}
        }
        self.path.truncate(len);
    }
}

/// Every module's extra state under its key, each alias of a shared module under each path (as
/// `state_dict` saves it).
pub fn extra_state_slots(root: &dyn Module) -> Vec<(String, &dyn ExtraState)> {
    let mut out = Vec::new();
    walk(root, false, &mut |path, v| {
        if let Visit::Extra(e) = v {
            out.push((path.to_owned(), e));
        }
        true
    });
    out
}

/// The module called as `target` (a [`CallTarget`]: the module itself, or the `Arc` holding it)
/// among the descendants of `parent`, with its path (`base` joined with the path from `parent`).
/// Breadth of one level, then depth: the direct children of `parent` are checked before any of
/// their own children, since that is where nearly every call goes. A forward error finds the
/// path of the module that failed with it (hook dispatch looks calls up in a table instead).
pub fn find_call_target(
    parent: &dyn Module,
    target: CallTarget,
    base: String,
) -> Option<(&dyn Module, String)> {
    let mut found: Option<(&dyn Module, String)> = None;
    let mut submodules: Vec<(&dyn Module, String)> = Vec::new();
    parent.visit_children(&mut |name, child| {
        if found.is_some() {
            return;
        }
        if let Child::Module { module, shared } = child {
            let mut path = base.clone();
            name.push_to(&mut path);
            let hit =
                CallTarget::of_dyn(module) == target || shared.is_some_and(|s| s.holder == target);
            if hit {
                found = Some((module, path));
            } else {
                submodules.push((module, path));
            }
        }
    });
    if found.is_some() {
        return found;
    }
    submodules
        .into_iter()
        .find_map(|(module, path)| find_call_target(module, target, path))
}
