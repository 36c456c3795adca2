//! `deep_clone`: a copy of a model with fresh parameters and buffers, ties kept.

use std::collections::HashMap;

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::identity::IdentitySet;
use crate::module::{ChildMut, Module};
use crate::param::Param;
use crate::walk::{walk, Visit};

/// Fresh leaves by the identity of the leaf they copy, so that aliases stay aliases.
#[derive(Default)]
struct Fresh {
    params: HashMap<usize, Param>,
    buffers: HashMap<usize, Buffer>,
    failed: Option<Error>,
}

pub(crate) fn deep_clone<M: Module + Clone>(model: &M) -> Result<M> {
    crate::views::ensure_built(model, "deep-clone")?;
    // A derived `Clone` shares every `Param` and `Buffer` (a clone is the same leaf): re-point each
    // to a fresh copy, one per original identity.
    let mut copy = model.clone();
    let mut fresh = Fresh::default();
    repoint(&mut copy, &mut fresh);
    if let Some(e) = fresh.failed {
        return Err(e);
    }
    // What could not be re-pointed (inside an `Arc` the clone shares) is still the original's.
    let mut original = IdentitySet::default();
    walk(model, false, &mut |_, v| {
        match v {
            Visit::Param(p) => original.insert(p.id()),
            Visit::Buffer(b) => original.insert(b.id()),
            _ => true,
        };
        true
    });
    let mut shared = None;
    walk(&copy, false, &mut |path, v| {
        let id = match v {
            Visit::Param(p) => p.id(),
            Visit::Buffer(b) => b.id(),
            _ => return shared.is_none(),
        };
        if shared.is_none() && original.contains(&id) {
            shared = Some(path.to_owned());
        }
        shared.is_none()
    });
    match shared {
        Some(leaf) => Err(Error::SharedModule {
            path: shared_module_path(&copy, &leaf),
        }),
        None => Ok(copy),
    }
}

fn repoint(module: &mut dyn Module, fresh: &mut Fresh) {
    module.visit_children_mut(&mut |_, child| {
        if fresh.failed.is_some() {
            return;
        }
        let result = match child {
            ChildMut::Module(m) => {
                repoint(m, fresh);
                Ok(())
            }
            ChildMut::Param(p) => match fresh.params.get(&p.id()) {
                Some(new) => {
                    *p = new.clone();
                    Ok(())
                }
                None => p.deep_copy().map(|new| {
                    fresh.params.insert(p.id(), new.clone());
                    *p = new;
                }),
            },
            ChildMut::Buffer(b) => match fresh.buffers.get(&b.id()) {
                Some(new) => {
                    *b = new.clone();
                    Ok(())
                }
                None => b.deep_copy().map(|new| {
                    fresh.buffers.insert(b.id(), new.clone());
                    *b = new;
                }),
            },
            // Checked after the walk (an `Arc` shared with the original cannot be changed).
            ChildMut::Shared(_) | ChildMut::Mode(_) | ChildMut::Absent => Ok(()),
        };
        if let Err(e) = result {
            fresh.failed = Some(e);
        }
    });
}

/// The path of the outermost `Arc`-shared module above `leaf` (the leaf's parent when none is
/// found).
fn shared_module_path(root: &dyn Module, leaf: &str) -> String {
    let mut found = None;
    find_shared(root, "", leaf, &mut found);
    found.unwrap_or_else(|| leaf.rsplit_once('.').map_or("", |(p, _)| p).to_owned())
}

fn find_shared(module: &dyn Module, path: &str, leaf: &str, found: &mut Option<String>) {
    module.visit_children(&mut |name, child| {
        if found.is_some() {
            return;
        }
        if let crate::module::Child::Module { module, shared } = child {
            let mut p = path.to_owned();
            name.push_to(&mut p);
            if leaf.starts_with(&format!("{p}.")) {
                if shared.is_some() {
                    *found = Some(p);
                } else {
                    find_shared(module, &p, leaf, found);
                }
            }
        }
    });
}
