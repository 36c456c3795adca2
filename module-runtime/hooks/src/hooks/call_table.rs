//! The modules of a hooked tree by identity: one walk when hooks are attached lists every module at
//! every path it is reachable by, so that a call finds its path (and dispatch the hooks to fire) by
//! looking up the identity it is called through instead of searching the tree.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::identity::CallTarget;
use crate::module::{Child, Module};
use crate::pattern::PathPattern;

/// One module of the tree at one of its paths.
pub(super) struct Node {
    /// The dotted path from the root (`""` for the root).
    pub(super) path: Arc<str>,
    /// The module (for `Box`, `Arc` and a built `Lazy`, the module inside). A module reachable by
    /// several paths (through `Arc`) has a node at each, all with this target.
    module: CallTarget,
    /// The `Arc` value the module is reached through at this path: a call through it is a call
    /// at this path.
    holder: Option<CallTarget>,
}

/// The nodes a call target names: nearly always one.
enum Slots {
    One(usize),
    Many(Vec<usize>),
}

impl Slots {
    fn as_slice(&self) -> &[usize] {
        match self {
            Slots::One(i) => std::slice::from_ref(i),
            Slots::Many(v) => v,
        }
    }

    fn push(&mut self, i: usize) {
        match self {
            Slots::One(first) => *self = Slots::Many(vec![*first, i]),
            Slots::Many(v) => v.push(i),
        }
    }
}

/// Every module under a root, in the order of `named_modules` without its dedup (depth first, each
/// module before its submodules), indexed by the targets a call can name it by: the module itself
/// (`self.fc.call(x)` with `fc: Linear`, `Box<Linear>` or a built `Lazy<Linear>`) and, for a module
/// shared through `Arc`, the `Arc` field it is called through (`self.a.call(x)` with
/// `a: Arc<Linear>`).
pub(super) struct CallTable {
    nodes: Vec<Node>,
    index: HashMap<CallTarget, Slots, BuildHasherDefault<TargetHasher>>,
}

impl CallTable {
    /// The table of `root`'s tree: one walk.
    pub(super) fn of<M: Module>(root: &M) -> Self {
        let mut nodes = vec![Node {
            path: Arc::from(""),
            module: root.__call_target(),
            holder: None,
        }];
        add_descendants(root, &mut String::new(), &mut nodes);
        Self::indexed(nodes)
    }

    fn indexed(nodes: Vec<Node>) -> Self {
        let mut index: HashMap<CallTarget, Slots, _> =
            HashMap::with_capacity_and_hasher(nodes.len(), BuildHasherDefault::default());
        for (i, node) in nodes.iter().enumerate() {
            for target in std::iter::once(node.module).chain(node.holder) {
                match index.get_mut(&target) {
                    Some(slots) => slots.push(i),
                    None => {
                        index.insert(target, Slots::One(i));
                    }
                }
            }
        }
        Self { nodes, index }
    }

    /// How many nodes the table holds.
    pub(super) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The nodes, in walk order.
    pub(super) fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node a call through `target` is a call of, while the module at `running` runs (`None`
    /// outside any call), or `None` if `target` is not part of the tree (a temporary).
    ///
    /// A module reachable by several paths and called through a plain reference (not through an
    /// `Arc` field, which names one path) is at the first of its paths under the running module,
    /// else at its first path: so `self.fc.call(x)` in a module shared as `a` and `b` is at `a.fc`
    /// when called through `a`, and at `b.fc` through `b`.
    pub(super) fn find(&self, target: CallTarget, running: Option<&str>) -> Option<usize> {
        match self.index.get(&target)? {
            Slots::One(i) => Some(*i),
            Slots::Many(nodes) => {
                let under = running.and_then(|parent| {
                    nodes
                        .iter()
                        .find(|&&i| is_under(&self.nodes[i].path, parent))
                });
                Some(*under.unwrap_or(&nodes[0]))
            }
        }
    }

    /// The nodes of the module at node `i`, in walk order (more than one for a module shared
    /// through `Arc`).
    fn nodes_of(&self, i: usize) -> impl Iterator<Item = usize> {
        let module = self.nodes[i].module;
        let nodes = self.index.get(&module).map_or(&[][..], Slots::as_slice);
        nodes
            .iter()
            .copied()
            .filter(move |&j| self.nodes[j].module == module)
    }

    /// The first node of the module at node `i`: nodes of one module fire the same hooks.
    pub(super) fn identity(&self, i: usize) -> usize {
        self.nodes_of(i).next().unwrap_or(i)
    }

    /// Every path of the module at node `i` (more than one for a module shared through `Arc`).
    pub(super) fn paths_of(&self, i: usize) -> impl Iterator<Item = &str> {
        self.nodes_of(i).map(|j| &*self.nodes[j].path)
    }

    /// Every path of the tree (a module shared through `Arc` under each of its paths).
    pub(super) fn paths(&self) -> impl Iterator<Item = &str> {
        self.nodes.iter().map(|n| &*n.path)
    }

    /// Fails with [`Error::NoModuleMatch`] if `pattern` matches no module path.
    pub(super) fn check(&self, pattern: &PathPattern, what: &'static str) -> Result<()> {
        if self.paths().any(|p| pattern.matches(p)) {
            return Ok(());
        }
        Err(Error::NoModuleMatch {
            what,
            pattern: pattern.as_str().to_owned(),
            near: near(pattern.as_str(), self.paths()),
        })
    }

    /// Records that the unbuilt [`Lazy`](../../module_runtime/nn/struct.Lazy.html) cell called as
    /// `cell` (a module without children) was built and holds `built`, which is called as
    /// `inner`: the cell's nodes become `built`'s, with `built`'s submodules under them. Returns
    /// whether the table changed (whether the cell is part of this tree and was not grafted yet).
    pub(super) fn graft(
        &mut self,
        cell: CallTarget,
        inner: CallTarget,
        built: &dyn Module,
    ) -> bool {
        if !self.index.contains_key(&cell) {
            return false;
        }
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for node in std::mem::take(&mut self.nodes) {
            if node.module != cell {
                nodes.push(node);
                continue;
            }
            let mut path = node.path.to_string();
            nodes.push(Node {
                module: inner,
                ..node
            });
            add_descendants(built, &mut path, &mut nodes);
        }
        *self = Self::indexed(nodes);
        true
    }
}

/// Appends a node for every module under `parent` (at `path`), depth first.
fn add_descendants(parent: &dyn Module, path: &mut String, nodes: &mut Vec<Node>) {
    parent.visit_children(&mut |name, child| {
        if let Child::Module { module, shared } = child {
            let len = path.len();
            name.push_to(path);
            nodes.push(Node {
                path: Arc::from(path.as_str()),
                module: CallTarget::of_dyn(module),
                holder: shared.map(|s| s.holder),
            });
            add_descendants(module, path, nodes);
            path.truncate(len);
        }
    });
}

/// Whether `path` is strictly under `parent`.
fn is_under(path: &str, parent: &str) -> bool {
    if parent.is_empty() {
        return !path.is_empty();
    }
    path.len() > parent.len() && path.starts_with(parent) && path.as_bytes()[parent.len()] == b'.'
}

/// Up to five of `paths`, the most like `pattern` first.
fn near<'p>(pattern: &str, paths: impl Iterator<Item = &'p str>) -> Vec<String> {
    let mut ranked: Vec<(usize, &str)> = paths
        .filter(|p| !p.is_empty())
        .map(|p| (strsim::levenshtein(pattern, p), p))
        .collect();
    ranked.sort();
    ranked.dedup_by(|a, b| a.1 == b.1);
    ranked
        .into_iter()
        .take(5)
        .map(|(_, p)| p.to_owned())
        .collect()
}

/// A hasher for call targets (an address and a type id), which need no protection from
/// adversarial keys: SipHash would be most of a lookup's cost. Each word is folded in with a
/// multiply by 2^64/φ.
#[derive(Default)]
struct TargetHasher(u64);

impl Hasher for TargetHasher {
    fn finish(&self) -> u64 {
        // The multiply leaves the low bits (which pick the bucket) least mixed: fold the high in.
        self.0 ^ (self.0 >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(23) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn under_means_strictly_below_at_a_segment_boundary() {
        assert!(is_under("a.b", "a"));
        assert!(is_under("a", ""));
        assert!(!is_under("", ""));
        assert!(!is_under("a", "a"));
        assert!(!is_under("ab.c", "a"));
        assert!(!is_under("b.a", "a"));
    }
}
