//! [`ModuleDict`]: PyTorch's `nn.ModuleDict`, modules by key in insertion order.

use std::fmt;

use super::SequentialLayer;
use crate::entries::Entries;
use crate::module::{Child, ChildMut, Name};
use crate::Module;

/// Modules by name, in insertion order: PyTorch's `nn.ModuleDict`. Children are named by key.
///
/// Inserting an existing key replaces the module in place, keeping its position (a Python dict's
/// rule). The default element type, `Box<dyn SequentialLayer>`, holds layers of different types;
/// a `BTreeMap<String, M>` field is the alternative when key order is wanted.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::ModuleDict;
///
/// let dev = Device::Cpu;
/// let mut heads: ModuleDict<Linear> = ModuleDict::new();
/// heads.insert("sentiment", Linear::new(8, 2, &dev)?);
/// heads.insert("topic", Linear::new(8, 5, &dev)?);
/// assert_eq!(heads.keys().collect::<Vec<_>>(), ["sentiment", "topic"]);
/// assert_eq!(heads["topic"].out_features(), 5);
/// assert!(heads.get_parameter("topic.weight").is_ok());
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct ModuleDict<M = Box<dyn SequentialLayer>> {
    entries: Entries<M>,
}

impl<M> ModuleDict<M> {
    /// An empty dictionary.
    pub fn new() -> Self {
        Self {
            entries: Entries::new(),
        }
    }

    /// Inserts `module` under `key`, returning the module it replaces (which keeps its position).
    ///
    /// As PyTorch's `add_module` (`torch/nn/modules/module.py`), an empty key or one containing `.`
    /// is refused ([`Error::InvalidKey`](module_core::Error::InvalidKey)): it would make paths
    /// ambiguous (`heads.a.b.weight`). So is a key containing `*`, which a path pattern would
    /// read as a wildcard.
    pub fn insert(&mut self, key: impl Into<String>, module: M) -> crate::Result<Option<M>> {
        let key = key.into();
        crate::path::check_key("ModuleDict", "", &key)?;
        Ok(self.entries.insert(key, module))
    }

    /// A dictionary of `entries`, in order (PyTorch's `ModuleDict(dict)`); fails on a key
    /// [`insert`](Self::insert) refuses.
    pub fn from_entries<K: Into<String>>(
        entries: impl IntoIterator<Item = (K, M)>,
    ) -> crate::Result<Self> {
        let mut dict = Self::new();
        for (k, m) in entries {
            dict.insert(k, m)?;
        }
        Ok(dict)
    }

    /// Removes the module under `key`.
    pub fn remove(&mut self, key: &str) -> Option<M> {
        self.entries.remove(key)
    }

    module_core::dict_accessors!(M, "module");

    /// The module under `key`, mutably.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut M> {
        self.entries.get_mut(key)
    }

    /// The modules, in insertion order.
    pub fn values(&self) -> impl Iterator<Item = &M> {
        self.entries.values()
    }
}

impl ModuleDict {
    /// Inserts a layer of any type under `key`, boxing it; see [`insert`](Self::insert).
    pub fn insert_layer(
        &mut self,
        key: impl Into<String>,
        layer: impl SequentialLayer,
    ) -> crate::Result<Option<Box<dyn SequentialLayer>>> {
        self.insert(key, Box::new(layer))
    }
}

/// A copy with each module cloned (a `Linear`'s clone shares its parameters, as the layer's does).
impl<M: Clone> Clone for ModuleDict<M> {
    fn clone(&self) -> Self {
        Self {
            entries: self.entries.clone(),
        }
    }
}

impl<M> Default for ModuleDict<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M> std::ops::Index<&str> for ModuleDict<M> {
    type Output = M;

    /// Panics when `key` is absent; use [`get`](ModuleDict::get) to check.
    fn index(&self, key: &str) -> &M {
        self.get(key)
            .unwrap_or_else(|| panic!("ModuleDict has no key `{key}`"))
    }
}

impl<M: Module> fmt::Debug for ModuleDict<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(k, m)| (k, m as &dyn Module)))
            .finish()
    }
}

// `print(model)`: PyTorch's repr.
crate::layer_macros::display_as_repr!(impl<M: Module> for ModuleDict<M>);

#[diagnostic::do_not_recommend]
impl<M: Module> Module for ModuleDict<M> {
    fn class_name(&self) -> String {
        Self::type_class_name()
    }

    fn type_class_name() -> String {
        let args = [(std::any::type_name::<M>(), M::type_class_name())];
        module_core::generic_class_name(std::any::type_name::<Self>(), &args)
    }

    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (k, m) in self.entries.iter() {
            f(Name::Field(k), m.as_child());
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (k, m) in self.entries.iter_mut() {
            f(Name::Field(k), m.as_child_mut());
        }
    }
}
