//! Containers: PyTorch's `Sequential`, `ModuleList` and `ModuleDict`.
//!
//! A derived struct already holds `Vec<M>` and `BTreeMap<String, M>` fields as lists and maps of
//! *one* module type. These containers add what a plain field cannot: layers of different types in
//! one list, run in order ([`Sequential`]), and a dictionary in insertion order ([`ModuleDict`]), as
//! in PyTorch. Heterogeneous elements are [`SequentialLayer`] trait objects.

use std::fmt;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::module::{Child, ChildMut, Name};
use crate::{
    Activation, ElementwiseActivation, LazyLinear, Linear, ReLU, SiLU, Sigmoid, Tanh, GELU,
};
use crate::{Forward, Module, ModuleExt};

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

    fn as_child(&self) -> Child<'_> {
        (**self).layer_child()
    }

    fn as_child_mut(&mut self) -> ChildMut<'_> {
        (**self).layer_child_mut()
    }
}

/// Layers of any types, run one after the other: PyTorch's `nn.Sequential`.
///
/// Children appended with [`add`](Self::add) or [`push`](Self::push) are named by position (`0`,
/// `1`, …), so a PyTorch `Sequential`'s checkpoint (`0.weight`, `2.bias`) loads by name. As in
/// PyTorch, an entry may also carry a name of its own ([`add_module`](Self::add_module),
/// [`from_named`](Self::from_named), PyTorch's `Sequential(OrderedDict(...))`): a feature extractor
/// sliced out of a larger `Sequential` keeps the original indices (`4.weight`, `8.bias`). Either
/// way the layers run in insertion order. The input and output are tensors of any shape the layers
/// accept; an empty `Sequential` returns its input.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Functional, Sequential};
///
/// let dev = Device::Cpu;
/// let mlp = Sequential::new()
///     .add(Linear::new(4, 8, &dev)?)
///     .add(Functional::new(|x: &Tensor| x.relu()))
///     .add(Linear::new(8, 2, &dev)?);
/// let names: Vec<String> = mlp.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
/// let y = mlp.call(&Tensor::zeros((3, 4), DType::F32, &dev)?)?;
/// assert_eq!(y.dims(), [3, 2]);
/// let first: &Linear = mlp.get_submodule("0")?;
/// assert_eq!(first.out_features(), 8);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Named entries, as PyTorch's `slice.add_module(str(i), features[i])`:
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Functional, Sequential};
///
/// let dev = Device::Cpu;
/// let mut slice = Sequential::new();
/// slice.add_module("4", Linear::new(4, 8, &dev)?)?;
/// slice.add_module("5", Functional::new(|x: &Tensor| x.relu()))?;
/// slice.add_module("8", Linear::new(8, 2, &dev)?)?;
/// let names: Vec<String> = slice.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["4.weight", "4.bias", "8.weight", "8.bias"]);
/// assert!(slice.get(2).unwrap().is::<Linear>()); // positional
/// assert!(slice.get_named("8").unwrap().is::<Linear>()); // by name
/// assert!(slice.add_module("8", Linear::new(2, 2, &dev)?).is_err()); // taken
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Entry>,
}

/// One layer of a [`Sequential`] and how it is named.
struct Entry {
    name: EntryName,
    layer: Box<dyn SequentialLayer>,
}

/// A [`Sequential`] entry's name: a position given at `push`, or a name given by the user.
enum EntryName {
    Index(usize),
    Named(String),
}

impl EntryName {
    fn as_name(&self) -> Name<'_> {
        match self {
            EntryName::Index(i) => Name::Index(*i),
            EntryName::Named(s) => Name::Field(s),
        }
    }

    fn is(&self, name: &str) -> bool {
        match self {
            EntryName::Index(i) => name == i.to_string(),
            EntryName::Named(s) => s == name,
        }
    }
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sequence of named layers, run in the given order: PyTorch's
    /// `nn.Sequential(OrderedDict([("4", conv), ("5", bn)]))`.
    ///
    /// [`Error::InvalidKey`](module_core::Error::InvalidKey) for a name that is not a path segment (see
    /// [`add_module`](Self::add_module)), [`Error::InvalidConfig`](module_core::Error::InvalidConfig)
    /// for a name given twice.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::{Sequential, SequentialLayer};
    ///
    /// let dev = Device::Cpu;
    /// let head = Sequential::from_named([
    ///     ("proj", Box::new(Linear::new(4, 8, &dev)?) as Box<dyn SequentialLayer>),
    ///     ("out", Box::new(Linear::new(8, 2, &dev)?)),
    /// ])?;
    /// assert!(head.get_parameter("out.bias").is_ok());
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn from_named<K, I>(layers: I) -> Result<Self>
    where
        K: Into<String>,
        I: IntoIterator<Item = (K, Box<dyn SequentialLayer>)>,
    {
        let mut seq = Self::new();
        for (name, layer) in layers {
            seq.add_module_boxed(name, layer)?;
        }
        Ok(seq)
    }

    /// The sequence with `layer` appended (builder style).
    // Named like candle-nn's `Sequential::add`, which candle users know; it is not `+`.
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl SequentialLayer) -> Self {
        self.push(layer);
        self
    }

    /// Appends `layer`; it is named by its position.
    ///
    /// When that position's number is already the name of an entry added with
    /// [`add_module`](Self::add_module), the layer takes the next free number instead (PyTorch's
    /// `append` would silently replace that entry).
    pub fn push(&mut self, layer: impl SequentialLayer) {
        self.push_boxed(Box::new(layer));
    }

    /// Appends an already boxed layer, named as [`push`](Self::push) says.
    pub fn push_boxed(&mut self, layer: Box<dyn SequentialLayer>) {
        let mut index = self.layers.len();
        while self.position_of(&index.to_string()).is_some() {
            index += 1;
        }
        self.layers.push(Entry {
            name: EntryName::Index(index),
            layer,
        });
    }

    /// Appends `layer` under `name`: PyTorch's `add_module(name, layer)`. The name is the layer's
    /// path segment (`"4"` gives `4.weight`); the layer still runs after the earlier ones.
    ///
    /// [`Error::InvalidKey`](module_core::Error::InvalidKey) for an empty name or one containing `.`
    /// (PyTorch's `KeyError`) or `*` (a pattern's wildcard);
    /// [`Error::InvalidConfig`](module_core::Error::InvalidConfig) for a name already in the sequence
    /// (PyTorch would replace that entry; here a second layer under one name is a mistake
    /// reported, not a silent replacement).
    pub fn add_module(
        &mut self,
        name: impl Into<String>,
        layer: impl SequentialLayer,
    ) -> Result<()> {
        self.add_module_boxed(name, Box::new(layer))
    }

    /// Like [`add_module`](Self::add_module), with an already boxed layer.
    pub fn add_module_boxed(
        &mut self,
        name: impl Into<String>,
        layer: Box<dyn SequentialLayer>,
    ) -> Result<()> {
        let name = name.into();
        crate::path::check_key("Sequential", "", &name)?;
        let problem = if self.position_of(&name).is_some() {
            Some(format!("two layers are named `{name}`"))
        } else {
            None
        };
        if let Some(message) = problem {
            return Err(Error::InvalidConfig {
                layer: "Sequential",
                message,
            });
        }
        self.layers.push(Entry {
            name: EntryName::Named(name),
            layer,
        });
        Ok(())
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layer at position `index` (in running order, whatever its name), as a module (downcast
    /// it with [`downcast_ref`](trait.Module.html)).
    pub fn get(&self, index: usize) -> Option<&dyn Module> {
        self.layers.get(index).map(|e| e.layer.as_module())
    }

    /// The layer named `name` (its path segment: `"4"` for a layer added as
    /// `add_module("4", …)`, or its position for one appended with [`push`](Self::push)).
    pub fn get_named(&self, name: &str) -> Option<&dyn Module> {
        self.position_of(name).and_then(|i| self.get(i))
    }

    /// The layers' names (path segments), in running order.
    pub fn names(&self) -> impl Iterator<Item = Name<'_>> {
        self.layers.iter().map(|e| e.name.as_name())
    }

    /// The layers in order.
    pub fn iter(&self) -> impl Iterator<Item = &dyn SequentialLayer> {
        self.layers.iter().map(|e| &*e.layer)
    }

    /// The position of the layer named `name`.
    fn position_of(&self, name: &str) -> Option<usize> {
        self.layers.iter().position(|e| e.name.is(name))
    }
}

impl FromIterator<Box<dyn SequentialLayer>> for Sequential {
    fn from_iter<I: IntoIterator<Item = Box<dyn SequentialLayer>>>(iter: I) -> Self {
        let mut seq = Self::new();
        iter.into_iter().for_each(|layer| seq.push_boxed(layer));
        seq
    }
}

impl fmt::Debug for Sequential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layers = self.layers.iter();
        if layers
            .clone()
            .all(|e| matches!(e.name, EntryName::Index(_)))
        {
            return f
                .debug_list()
                .entries(layers.map(|e| e.layer.as_module()))
                .finish();
        }
        f.debug_map()
            .entries(layers.map(|e| (e.name.as_name().to_string(), e.layer.as_module())))
            .finish()
    }
}

#[diagnostic::do_not_recommend]
impl Module for Sequential {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for e in &self.layers {
            f(e.name.as_name(), e.layer.layer_child());
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for e in self.layers.iter_mut() {
            f(e.name.as_name(), e.layer.layer_child_mut());
        }
    }
}

impl Forward<Tensor> for Sequential {
    type Output = Tensor;

    /// Runs the layers in order. A [`Linear`] (or [`LazyLinear`]) followed by an elementwise
    /// activation runs as [`Linear::call_then`], which fuses the two during CPU float32 inference.
    fn forward(&self, x: Tensor) -> Result<Tensor> {
        let mut x = x;
        let mut layers = self.layers.iter().map(|e| &*e.layer).peekable();
        while let Some(layer) = layers.next() {
            let next = layers.peek().map(|next| next.as_module());
            x = match next.and_then(|next| linear_then(layer.as_module(), next, &x)) {
                Some(y) => {
                    layers.next();
                    y?
                }
                None => layer.forward_tensor(x)?,
            };
        }
        Ok(x)
    }
}

/// `activation(linear(x))` through [`Linear::call_then`] if `linear` is a [`Linear`] or
/// [`LazyLinear`] and `activation` an [`ElementwiseActivation`]; `None` otherwise.
fn linear_then(linear: &dyn Module, activation: &dyn Module, x: &Tensor) -> Option<Result<Tensor>> {
    fn then<A: ElementwiseActivation>(
        linear: &dyn Module,
        activation: &dyn Module,
        x: &Tensor,
    ) -> Option<Result<Tensor>> {
        let activation = activation.downcast_ref::<A>()?;
        if let Some(linear) = linear.downcast_ref::<Linear>() {
            return Some(linear.call_then(x, activation));
        }
        Some(
            linear
                .downcast_ref::<LazyLinear>()?
                .call_then(x, activation),
        )
    }
    then::<GELU>(linear, activation, x)
        .or_else(|| then::<ReLU>(linear, activation, x))
        .or_else(|| then::<SiLU>(linear, activation, x))
        .or_else(|| then::<Sigmoid>(linear, activation, x))
        .or_else(|| then::<Tanh>(linear, activation, x))
        .or_else(|| then::<Activation>(linear, activation, x))
}

impl Forward<&Tensor> for Sequential {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward(x.clone())
    }
}

impl candle_core::Module for Sequential {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Forward::forward(self, x)?)
    }
}

/// A list of modules: PyTorch's `nn.ModuleList`. Elements are named `0`, `1`, ….
///
/// `ModuleList<M>` holds one module type (a `Vec<M>` field does the same job; this type exists for
/// PyTorch users and for its default, `Box<dyn SequentialLayer>`, which holds layers of different
/// types). It dereferences to a slice, so `len`, `iter`, indexing and `get` work as on a `Vec`.
/// Unlike [`Sequential`] it has no forward: the owner decides how to run the elements.
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

#[diagnostic::do_not_recommend]
impl<M: Module> Module for ModuleList<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (i, m) in self.items.iter().enumerate() {
            f(Name::Index(i), m.as_child());
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (i, m) in self.items.iter_mut().enumerate() {
            f(Name::Index(i), m.as_child_mut());
        }
    }
}

/// Modules by name, in insertion order: PyTorch's `nn.ModuleDict`. Children are named by key.
///
/// Inserting an existing key replaces the module in place, keeping its position (a Python dict's
/// rule). Lookups scan the entries, which suits the handful of entries a model has. The default
/// element type, `Box<dyn SequentialLayer>`, holds layers of different types; a
/// `BTreeMap<String, M>` field is the alternative when key order is wanted.
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
    entries: Vec<(String, M)>,
}

impl<M> ModuleDict<M> {
    /// An empty dictionary.
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
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
        Ok(match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some((_, slot)) => Some(std::mem::replace(slot, module)),
            None => {
                self.entries.push((key, module));
                None
            }
        })
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
        let index = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(index).1)
    }

    /// The module under `key`.
    pub fn get(&self, key: &str) -> Option<&M> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, m)| m)
    }

    /// The module under `key`, mutably.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut M> {
        self.entries
            .iter_mut()
            .find(|(k, _)| k == key)
            .map(|(_, m)| m)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The keys, in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// The modules, in insertion order.
    pub fn values(&self) -> impl Iterator<Item = &M> {
        self.entries.iter().map(|(_, m)| m)
    }

    /// `(key, module)` pairs, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &M)> {
        self.entries.iter().map(|(k, m)| (k.as_str(), m))
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

#[diagnostic::do_not_recommend]
impl<M: Module> Module for ModuleDict<M> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (k, m) in &self.entries {
            f(Name::Field(k), m.as_child());
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (k, m) in self.entries.iter_mut() {
            f(Name::Field(k), m.as_child_mut());
        }
    }
}
