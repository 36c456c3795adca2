//! Containers: PyTorch's `Sequential`, `ModuleList` and `ModuleDict`.
//!
//! A derived struct already holds `Vec<M>` and `BTreeMap<String, M>` fields as lists and maps of
//! *one* module type. These containers add what a plain field cannot: layers of different types in
//! one list, run in order ([`Sequential`]), and a dictionary in insertion order ([`ModuleDict`]), as
//! in PyTorch. Heterogeneous elements are [`SequentialLayer`] trait objects.

use candle_core::Tensor;

use crate::error::Result;
use crate::module::{Child, ChildMut, Name};
use crate::{Forward, Module, ModuleExt};

mod module_dict;
mod module_list;
mod sequential;

pub use module_dict::ModuleDict;
pub use module_list::ModuleList;
pub use sequential::Sequential;

/// A module that maps a tensor to a tensor, usable as a trait object: the element type of
/// [`Sequential`] and the default element of [`ModuleList`] and [`ModuleDict`].
///
/// Implemented for every [`Module`] with `Forward<Tensor, Output = Tensor>` (every runtime layer
/// with a single-tensor forward, your derived modules once they implement it, [`Sequential`] itself,
/// and [`Functional`](crate::Functional) for closures and candle-nn layers). A
/// `Box<dyn SequentialLayer>` is itself a module: traversal sees the layer inside, with its own type
/// name and children, exactly as if it were stored directly.
///
/// Layers with other inputs or outputs (an LSTM's state tuple, attention masks) do not fit a
/// sequence; hold them in a derived struct, a `Vec`, or a [`ModuleList`] of their own type.
pub trait SequentialLayer: Module {
    /// Runs the layer through [`call`](crate::ModuleExt::call), so hooks see it.
    fn forward_tensor(&self, x: Tensor) -> Result<Tensor>;

    /// The layer as a plain module (for traversal and downcasting).
    fn as_module(&self) -> &dyn Module;

    /// How the layer appears as a child of its container (see [`Module::as_child`]).
    fn layer_child(&self) -> Child<'_>;

    /// Like [`layer_child`](Self::layer_child), with mutable access.
    fn layer_child_mut(&mut self) -> ChildMut<'_>;
}

impl<M: Module + Forward<Tensor, Output = Tensor>> SequentialLayer for M {
    fn forward_tensor(&self, x: Tensor) -> Result<Tensor> {
        self.call(x)
    }

    fn as_module(&self) -> &dyn Module {
        self
    }

    fn layer_child(&self) -> Child<'_> {
        self.as_child()
    }

    fn layer_child_mut(&mut self) -> ChildMut<'_> {
        self.as_child_mut()
    }
}

/// Transparent, like `Box<M>`: the boxed layer is the module. Run it with
/// [`forward_tensor`](SequentialLayer::forward_tensor) (which goes through the layer's `call`).
#[diagnostic::do_not_recommend]
impl Module for Box<dyn SequentialLayer> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        (**self).visit_children(f);
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        (**self).visit_children_mut(f);
    }

    fn type_name(&self) -> &'static str {
        (**self).type_name()
    }

    fn class_name(&self) -> String {
        (**self).class_name()
    }

    fn extra_repr(&self) -> String {
        (**self).extra_repr()
    }

    fn __repr_collapses_repeats(&self) -> bool {
        (**self).__repr_collapses_repeats()
    }

    fn __repr_class(&self) -> Option<String> {
        (**self).__repr_class()
    }

    fn __repr_child(&self, child: &str) -> module_core::ChildRepr {
        (**self).__repr_child(child)
    }

    fn as_child(&self) -> Child<'_> {
        (**self).layer_child()
    }

    fn as_child_mut(&mut self) -> ChildMut<'_> {
        (**self).layer_child_mut()
    }
}
