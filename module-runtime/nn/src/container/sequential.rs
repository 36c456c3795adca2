//! [`Sequential`]: PyTorch's `nn.Sequential`, layers of any types run one after the other.

use std::fmt;

use candle_core::Tensor;

use super::SequentialLayer;
use crate::common::layer_forward;
use crate::error::{Error, Result};
use crate::module::{Child, ChildMut, Name};
use crate::{
    Activation, ElementwiseActivation, LazyLinear, Linear, ReLU, SiLU, Sigmoid, Tanh, GELU,
};
use crate::{Forward, Module};

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

// `print(model)`: PyTorch's repr.
crate::layer_macros::display_as_repr!(impl for Sequential);

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

layer_forward!(Sequential, |layer, x| layer.forward(x.clone()));

impl candle_core::Module for Sequential {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Forward::forward(self, x)?)
    }
}
