//! The one walk every traversal is built on: depth first over the derive's
//! [`visit_children`](crate::Module::visit_children), growing the dotted path in place, with
//! PyTorch's memo set to list shared things once.

use crate::buffer::Buffer;
use crate::identity::IdentitySet;
use crate::module::{Child, Mode, Module, Name};
use crate::param::Param;

/// What a walk reaches.
pub(crate) enum Visit<'a> {
    Module(&'a dyn Module),
    Param(&'a Param),
    Buffer(&'a Buffer),
    Mode(&'a Mode),
}

/// When a walk reports a module: before its children (and then it may skip them), or after.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Parents first; the callback returns whether to descend into a module.
    Pre,
    /// Children first (PyTorch's `apply`); the callback's return value is ignored.
    Post,
}

/// Walks `root` depth-first in declaration order, calling `f` with each node's dotted path
/// (`""` for the root). `f` returns whether to descend into a module. With `dedup`, a module shared
/// through `Arc`, a parameter or a buffer reached a second time is skipped with everything under it
/// (PyTorch's memo set: the first path wins).
pub(crate) fn walk<'a>(
    root: &'a dyn Module,
    dedup: bool,
    f: &mut dyn FnMut(&str, Visit<'a>) -> bool,
) {
    walk_in(root, dedup, Order::Pre, f)
}

/// [`walk`] in the given order.
pub(crate) fn walk_in<'a>(
    root: &'a dyn Module,
    dedup: bool,
    order: Order,
    f: &mut dyn FnMut(&str, Visit<'a>) -> bool,
) {
    let mut walker = Walker {
        path: String::new(),
        dedup,
        order,
        seen: IdentitySet::default(),
        f,
    };
    walker.module(root);
}

struct Walker<'a, 'f> {
    path: String,
    dedup: bool,
    order: Order,
    seen: IdentitySet,
    f: &'f mut dyn FnMut(&str, Visit<'a>) -> bool,
}

impl<'a> Walker<'a, '_> {
    fn module(&mut self, module: &'a dyn Module) {
        match self.order {
            Order::Pre => {
                if (self.f)(&self.path, Visit::Module(module)) {
                    self.children(module);
                }
            }
            Order::Post => {
                self.children(module);
                (self.f)(&self.path, Visit::Module(module));
            }
        }
    }

    fn children(&mut self, module: &'a dyn Module) {
        module.visit_children(&mut |name, child| self.child(name, child));
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
