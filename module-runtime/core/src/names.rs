//! [`Names`]: the `prefix`, `recurse` and `remove_duplicate` arguments of PyTorch's
//! `named_parameters`, `named_buffers` and `named_modules`, as one options value, and the one
//! implementation of those listings (and `named_children`): with and without aliases, with and
//! without a prefix.

use crate::buffer::Buffer;
use crate::module::Module;
use crate::param::Param;
use crate::walk::{walk, Visit};

/// How [`named_parameters_with`](../module_runtime/trait.ModuleExt.html#method.named_parameters_with),
/// [`named_buffers_with`](../module_runtime/trait.ModuleExt.html#method.named_buffers_with) and
/// [`named_modules_with`](../module_runtime/trait.ModuleExt.html#method.named_modules_with) name and select what they list:
/// PyTorch's `prefix`, `recurse` and `remove_duplicate` arguments
/// (`torch/nn/modules/module.py`, `Module.named_parameters`, `Module._named_members`,
/// `Module.named_modules`).
///
/// The default is PyTorch's: no prefix, recursive, each shared parameter, buffer or module once.
///
/// - [`prefix`](Self::prefix): joined to every name with `"."`, as PyTorch's
///   `prefix + ("." if prefix else "") + name`; an empty prefix gives the bare names, and
///   `named_modules_with` names the root itself by the prefix.
/// - [`recurse(false)`](Self::recurse): only the module's own, direct parameters or buffers
///   (`[(prefix, self)]` instead of `self.named_modules(...)`); `named_modules_with` ignores it,
///   as PyTorch's `named_modules` has no such argument.
/// - [`keep_duplicates`](Self::keep_duplicates) (PyTorch's `remove_duplicate=False`): a tied
///   parameter, or a module shared through `Arc`, is listed under every path that reaches it.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::Names;
///
/// #[derive(Module)]
/// struct Net {
///     scale: Param,
///     fc: Linear,
/// }
///
/// let dev = Device::Cpu;
/// let net = Net { scale: Param::new(Tensor::ones(1, DType::F32, &dev)?)?, fc: Linear::new(2, 2, &dev)? };
/// let names = |list: Vec<(String, Param)>| list.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
/// assert_eq!(
///     names(net.named_parameters_with(&Names::new().prefix("model"))),
///     ["model.scale", "model.fc.weight", "model.fc.bias"]
/// );
/// assert_eq!(names(net.named_parameters_with(&Names::new().recurse(false))), ["scale"]);
/// let modules: Vec<String> =
///     net.named_modules_with(&Names::new().prefix("model")).into_iter().map(|(n, _)| n).collect();
/// assert_eq!(modules, ["model", "model.fc"]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    prefix: String,
    recurse: bool,
    remove_duplicate: bool,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            recurse: true,
            remove_duplicate: true,
        }
    }
}

impl Names {
    /// PyTorch's defaults: no prefix, recursive, duplicates removed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `prefix.` in front of every name (PyTorch's `prefix=`); `""` gives the bare names.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Whether to list the parameters or buffers of submodules too (PyTorch's `recurse=`, default
    /// `true`); with `false`, only the module's own.
    pub fn recurse(mut self, recurse: bool) -> Self {
        self.recurse = recurse;
        self
    }

    /// Lists a shared parameter, buffer or module under every path that reaches it (PyTorch's
    /// `remove_duplicate=False`).
    pub fn keep_duplicates(self) -> Self {
        self.remove_duplicate(false)
    }

    /// Whether to list shared things once, under their first path (PyTorch's `remove_duplicate=`,
    /// default `true`).
    pub fn remove_duplicate(mut self, remove: bool) -> Self {
        self.remove_duplicate = remove;
        self
    }

    /// The prefix.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether submodules are listed.
    pub fn is_recursive(&self) -> bool {
        self.recurse
    }

    /// Whether shared things are listed once.
    pub fn removes_duplicates(&self) -> bool {
        self.remove_duplicate
    }

    /// `prefix + ("." if prefix else "") + path`, and the prefix alone for the root (`""`).
    fn join(&self, path: &str) -> String {
        match (self.prefix.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}.{path}", self.prefix),
        }
    }

    /// Walks `root`, descending into submodules only when recursive.
    fn walk<'a>(&self, root: &'a dyn Module, f: &mut dyn FnMut(&str, Visit<'a>)) {
        walk(root, self.remove_duplicate, &mut |path, v| {
            let descend = !matches!(v, Visit::Module(_)) || path.is_empty() || self.recurse;
            f(path, v);
            descend
        });
    }
}

/// Every leaf `pick` takes, with its name.
fn named_leaves<T>(
    root: &dyn Module,
    names: &Names,
    pick: impl Fn(Visit<'_>) -> Option<T>,
) -> Vec<(String, T)> {
    let mut out = Vec::new();
    names.walk(root, &mut |path, v| {
        out.extend(pick(v).map(|leaf| (names.join(path), leaf)));
    });
    out
}

pub fn named_parameters(root: &dyn Module, names: &Names) -> Vec<(String, Param)> {
    named_leaves(root, names, |v| match v {
        Visit::Param(p) => Some(p.clone()),
        _ => None,
    })
}

pub fn named_buffers(root: &dyn Module, names: &Names) -> Vec<(String, Buffer)> {
    named_leaves(root, names, |v| match v {
        Visit::Buffer(b) => Some(b.clone()),
        _ => None,
    })
}

pub fn named_modules<'a>(root: &'a dyn Module, names: &Names) -> Vec<(String, &'a dyn Module)> {
    let names = Names {
        recurse: true,
        ..names.clone()
    };
    let mut out = Vec::new();
    names.walk(root, &mut |path, v| {
        if let Visit::Module(m) = v {
            out.push((names.join(path), m));
        }
    });
    out
}

/// The direct submodules, each once (PyTorch's `named_children`).
pub fn named_children(root: &dyn Module) -> Vec<(String, &dyn Module)> {
    let mut out = Vec::new();
    Names::new().recurse(false).walk(root, &mut |path, v| {
        if let Visit::Module(m) = v
            && !path.is_empty()
        {
            out.push((path.to_owned(), m));
        }
    });
    out
}
