//! [`ModuleList`]: PyTorch's `nn.ModuleList`, a `Vec` of modules that is a module.

use std::fmt;

use super::SequentialLayer;
use crate::module::{Child, ChildMut, Name};
use crate::Module;

/// A list of modules: PyTorch's `nn.ModuleList`. Elements are named `0`, `1`, ….
///
/// `ModuleList<M>` holds one module type (a `Vec<M>` field does the same job; this type exists for
/// PyTorch users and for its default, `Box<dyn SequentialLayer>`, which holds layers of different
/// types). It dereferences to a slice, so `len`, `iter`, indexing and `get` work as on a `Vec`.
/// Unlike [`Sequential`](crate::Sequential) it has no forward: the owner decides how to run the
/// elements.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::ModuleList;
///
/// let dev = Device::Cpu;
/// let blocks: ModuleList<Linear> = (0..3).map(|_| Linear::new(4, 4, &dev)).collect::<Result<_>>()?;
/// assert_eq!(blocks.len(), 3);
/// assert!(blocks.get_parameter("2.bias").is_ok());
/// let mut x = Tensor::ones((1, 4), DType::F32, &dev)?;
/// for block in blocks.iter() {
///     x = block.call(&x)?;
/// }
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct ModuleList<M = Box<dyn SequentialLayer>> {
    items: Vec<M>,
}

impl<M> ModuleList<M> {
    /// An empty list.
    pub fn new() -> Self {
        Self { items: Vec::new() }
    }

    /// Appends `module`.
    pub fn push(&mut self, module: M) {
        self.items.push(module);
    }

    /// Inserts `module` at `index`, shifting the later elements (and their names) up by one.
    pub fn insert(&mut self, index: usize, module: M) {
        self.items.insert(index, module);
    }

    /// Removes and returns the last module.
    pub fn pop(&mut self) -> Option<M> {
        self.items.pop()
    }

    /// The elements, as a `Vec`.
    pub fn into_vec(self) -> Vec<M> {
        self.items
    }
}

impl ModuleList {
    /// Appends a layer of any type, boxing it.
    pub fn push_layer(&mut self, layer: impl SequentialLayer) {
        self.items.push(Box::new(layer));
    }
}

impl<M> Default for ModuleList<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M> std::ops::Deref for ModuleList<M> {
    type Target = [M];
    fn deref(&self) -> &[M] {
        &self.items
    }
}

impl<M> std::ops::DerefMut for ModuleList<M> {
    fn deref_mut(&mut self) -> &mut [M] {
        &mut self.items
    }
}

impl<M> From<Vec<M>> for ModuleList<M> {
    fn from(items: Vec<M>) -> Self {
        Self { items }
    }
}

impl<M> FromIterator<M> for ModuleList<M> {
    fn from_iter<I: IntoIterator<Item = M>>(iter: I) -> Self {
        Self {
            items: iter.into_iter().collect(),
        }
    }
}

impl<M> Extend<M> for ModuleList<M> {
    fn extend<I: IntoIterator<Item = M>>(&mut self, iter: I) {
        self.items.extend(iter);
    }
}

impl<'a, M> IntoIterator for &'a ModuleList<M> {
    type Item = &'a M;
    type IntoIter = std::slice::Iter<'a, M>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<M> IntoIterator for ModuleList<M> {
    type Item = M;
    type IntoIter = std::vec::IntoIter<M>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<M: Module> fmt::Debug for ModuleList<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.items.iter().map(|m| m as &dyn Module))
            .finish()
    }
}

// `print(model)`: PyTorch's repr.
crate::layer_macros::display_as_repr!(impl<M: Module> for ModuleList<M>);

#[diagnostic::do_not_recommend]
impl<M: Module> Module for ModuleList<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        self.items.visit_children(f);
    }

    fn __repr_collapses_repeats(&self) -> bool {
        true
    }

    fn class_name(&self) -> String {
        Self::type_class_name()
    }

    fn type_class_name() -> String {
        let args = [(std::any::type_name::<M>(), M::type_class_name())];
        module_core::generic_class_name(std::any::type_name::<Self>(), &args)
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        self.items.visit_children_mut(f);
    }
}
