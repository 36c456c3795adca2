//! The `Module` trait: the structural walk the derive implements, with the names and children it
//! hands out and the train/eval flag [`Mode`]; `std_impls` implements it for leaves, containers
//! and configuration types.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::buffer::Buffer;
use crate::identity::{CallTarget, ModeMarks, Shared};
use crate::param::Param;

/// A node of a model's tree: PyTorch's `nn.Module`, reduced to the one thing the rest is built on,
/// a walk over the node's direct children.
///
/// Derive it (`#[derive(Module)]`) rather than implementing it: the derive lists every field in
/// declaration order, and every traversal, state dict, hook and conversion in
/// [`ModuleExt`](../module_runtime/trait.ModuleExt.html) is built on that walk.
///
/// Every field of a derived module must itself implement `Module`: other derived modules, the
/// runtime's layers, the leaves [`Param`] and [`Buffer`], the containers `Option`, `Vec`, arrays,
/// `Box`, `Arc`, `BTreeMap<String, _>` and tuples, and configuration values (numbers, `bool`,
/// `String`, `DType`, `Device`, `PhantomData`, …), which are no-op leaves. A bare
/// `candle_core::Tensor` is deliberately *not* a module: say whether it is trained (`Param`) or
/// state (`Buffer`), or mark the field `#[module(skip)]`.
///
/// The trait is object safe: traversal hands out `&dyn Module`, and
/// [`downcast_ref`](trait.Module.html#method.downcast_ref) gets the concrete type back.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a module, so `#[derive(Module)]` cannot walk this field",
    label = "not a `Module`",
    note = "for a tensor, say what it is: `Param` (trained and saved) or `Buffer` (saved, not \
            trained); for configuration or caches, mark the field `#[module(skip)]`; for a type of \
            your own, add `#[derive(Module)]` to it",
    note = "for a candle-nn layer, use the runtime's layer of the same name \
            (`module_runtime::nn::Linear` for `candle_nn::Linear`, ...) or wrap it: \
            `module_runtime::nn::Native<candle_nn::Linear>`; for a `HashMap` of modules, use \
            `BTreeMap<String, _>` (sorted) or `module_runtime::nn::ModuleDict` (insertion order): \
            a `HashMap` has no order, so parameter order and state-dict keys would change from run \
            to run"
)]
pub trait Module: Any + Send + Sync {
    /// Calls `f` on each direct child, in declaration order, with the name it has in paths.
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>));

    /// Like [`visit_children`](Self::visit_children), with mutable access.
    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>));

    /// The type's Rust name (`std::any::type_name`). Summaries, `print(model)` and errors show the
    /// [`class_name`](Self::class_name) instead.
    fn type_name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }

    /// The module's class name, as summaries, `print(model)`, `Debug` of a `dyn Module`, the
    /// dataflow graph and errors show it: [`type_class_name`](Self::type_class_name), or what a
    /// wrapper holds (`Option`, `Box`, `Arc`, a built `Lazy` answer for their module).
    ///
    /// The default is the Rust type name without module paths. Do not implement it by hand: the
    /// derive answers with `type_class_name`, which `#[module(class_name = ...)]` sets. A hand-written
    /// impl that gives its own `type_class_name` gives this too, with the same answer.
    fn class_name(&self) -> String {
        crate::type_name::short_type_name(self.type_name())
    }

    /// The type's class name, without a value of it: PyTorch's class name for the runtime's
    /// layers (`BatchNorm<1>` is `BatchNorm1d`, `RnnBase<LstmGates>` is `LSTM`), otherwise the
    /// Rust name without module paths, with a container's or a generic type's module arguments
    /// shown by their class names (`Vec<BatchNorm1d>`; see
    /// [`generic_class_name`](crate::generic_class_name)). A type chooses its own with the
    /// derive's `#[module(class_name = ...)]`, whose value may use the type's parameters:
    ///
    /// ```
    /// use module_runtime::prelude::*;
    ///
    /// /// PyTorch's `nn.ZeroPad1d` .. `ZeroPad3d`, as one type.
    /// #[derive(Module)]
    /// #[module(class_name = format!("ZeroPad{N}d"))]
    /// struct ZeroPad<const N: usize> {
    ///     padding: [usize; N],
    /// }
    ///
    /// #[derive(Module)]
    /// struct Net {
    ///     pads: Vec<ZeroPad<2>>,
    /// }
    ///
    /// assert_eq!(<ZeroPad<2> as Module>::type_class_name(), "ZeroPad2d");
    /// let net = Net { pads: vec![ZeroPad { padding: [1, 1] }] };
    /// assert_eq!(net.pads.class_name(), "Vec<ZeroPad2d>");
    /// // The Rust name stays what `std::any::type_name` says.
    /// assert!(net.pads[0].type_name().ends_with("ZeroPad<2>"));
    /// assert_eq!(net.summary().rows[2].type_name, "ZeroPad2d");
    /// ```
    fn type_class_name() -> String
    where
        Self: Sized,
    {
        crate::type_name::short_type_name(std::any::type_name::<Self>())
    }

    /// How this value appears when it is a field of another module. Modules are nodes; `Param`,
    /// `Buffer` and [`Mode`] are leaves; `Option`, `Box` and `Arc` are transparent; configuration
    /// values are absent.
    fn as_child(&self) -> Child<'_>
    where
        Self: Sized,
    {
        Child::Module {
            module: self,
            shared: None,
        }
    }

    /// Like [`as_child`](Self::as_child), with mutable access.
    fn as_child_mut(&mut self) -> ChildMut<'_>
    where
        Self: Sized,
    {
        ChildMut::Module(self)
    }

    /// Whether the type is plain configuration (numbers, strings, …) with nothing to walk. Containers
    /// of configuration (`Vec<usize>`, `Option<f64>`) are configuration too, and are not listed as
    /// modules.
    fn is_config() -> bool
    where
        Self: Sized,
    {
        false
    }

    /// The module's extra state (PyTorch's `get_extra_state`/`set_extra_state`), saved in the
    /// state dict under `<path>._extra_state`; `None` (the default) for a module without any.
    /// Do not implement it by hand: implement [`ExtraState`](crate::ExtraState) and mark the type
    /// `#[module(extra_state)]`, and the derive returns `Some(self)`.
    fn extra_state(&self) -> Option<&dyn crate::ExtraState> {
        None
    }

    /// The module's own settings as `print(model)` shows them inside its parentheses: PyTorch's
    /// `extra_repr`. Empty (the default) for a module without any. Do not implement it by hand:
    /// implement [`ExtraRepr`](crate::ExtraRepr) and mark the type `#[module(extra_repr)]`, and
    /// the derive returns its text. See [`module_repr`](crate::module_repr).
    fn extra_repr(&self) -> String {
        String::new()
    }

    /// Whether `print(model)` shows runs of equal children as one line (`(0-2): 3 x Linear(...)`),
    /// as PyTorch's `ModuleList` does. Not public API.
    #[doc(hidden)]
    fn __repr_collapses_repeats(&self) -> bool {
        false
    }

    /// How `print(model)` shows the child `child`, from
    /// [`ExtraRepr::child_repr`](crate::ExtraRepr::child_repr). Not public API.
    #[doc(hidden)]
    fn __repr_child(&self, _child: &str) -> crate::ChildRepr {
        crate::ChildRepr::Own
    }

    /// The class name `print(model)` shows instead of [`class_name`](Self::class_name), where
    /// PyTorch's differs: from [`ExtraRepr::class_repr`](crate::ExtraRepr::class_repr) (an adapted
    /// layer's `lora.Linear`); a `Vec` or array of modules is PyTorch's `ModuleList`, a map of
    /// them its `ModuleDict`. Not public API.
    #[doc(hidden)]
    fn __repr_class(&self) -> Option<String> {
        None
    }

    /// Calls `f` with each `#[module(flatten)]`ed field (its Rust name and its value): the derive
    /// lists them, so that the runtime can lift their extra state and report names that collide
    /// through them. Not public API.
    #[doc(hidden)]
    fn __flattened<'a>(&'a self, _f: &mut dyn FnMut(&'static str, &'a dyn Module)) {}

    /// `self` as a `dyn Module`, named through the trait so that the derive's use of it on a field
    /// whose type is not a module adds no second error. Not public API.
    #[doc(hidden)]
    fn __as_dyn(&self) -> &dyn Module
    where
        Self: Sized,
    {
        self
    }

    /// Whether this node is an unbuilt [`Lazy`](crate::Lazy) cell (which has no children yet).
    /// Not public API: ask [`LazyExt::unbuilt_paths`](crate::LazyExt::unbuilt_paths).
    #[doc(hidden)]
    fn __unbuilt(&self) -> bool {
        false
    }

    /// Which node of the tree a `call` on this value is a call of (hook dispatch finds the module's
    /// path with it). `Box` answers for the module inside; everything else for itself.
    #[doc(hidden)]
    fn __call_target(&self) -> CallTarget
    where
        Self: Sized,
    {
        CallTarget::of(self)
    }
}

impl dyn Module {
    /// The concrete module, if it is a `T`.
    pub fn downcast_ref<T: Module>(&self) -> Option<&T> {
        (self as &dyn Any).downcast_ref::<T>()
    }

    /// The concrete module, mutably, if it is a `T`.
    pub fn downcast_mut<T: Module>(&mut self) -> Option<&mut T> {
        (self as &mut dyn Any).downcast_mut::<T>()
    }

    /// Whether the module is a `T`.
    pub fn is<T: Module>(&self) -> bool {
        (self as &dyn Any).is::<T>()
    }
}

impl std::fmt::Debug for dyn Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.class_name())
    }
}

/// The name of a child within its parent: a field name, a `rename`d checkpoint name, a map key,
/// or a position (`Vec` and tuple elements, tuple-struct fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Name<'a> {
    /// A named field or map key.
    Field(&'a str),
    /// A position.
    Index(usize),
}

impl std::fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Name::Field(s) => f.write_str(s),
            Name::Index(i) => write!(f, "{i}"),
        }
    }
}

impl Name<'_> {
    pub fn push_to(&self, path: &mut String) {
        use std::fmt::Write;
        if !path.is_empty() {
            path.push('.');
        }
        match self {
            Name::Field(s) => path.push_str(s),
            Name::Index(i) => {
                let _ = write!(path, "{i}");
            }
        }
    }

    pub fn matches(&self, segment: &str) -> bool {
        match self {
            Name::Field(s) => *s == segment,
            Name::Index(i) => segment.parse::<usize>().ok() == Some(*i),
        }
    }
}

/// What a child is, as seen by a walk.
#[derive(Clone, Copy)]
pub enum Child<'a> {
    /// A submodule. `shared` is its identity when it is reached through an `Arc` (two `Arc`s to one
    /// module are one module, listed once); plain fields cannot be aliased and have none.
    Module {
        /// The submodule.
        module: &'a dyn Module,
        /// Identity of a module shared through `Arc`.
        shared: Option<Shared>,
    },
    /// A trainable parameter.
    Param(&'a Param),
    /// A buffer.
    Buffer(&'a Buffer),
    /// A train/eval flag.
    Mode(&'a Mode),
    /// Nothing to walk: `None`, or configuration.
    Absent,
}

/// What a child is, as seen by a mutable walk.
pub enum ChildMut<'a> {
    /// A submodule.
    Module(&'a mut dyn Module),
    /// A submodule shared through an `Arc` with other owners, so only reachable immutably.
    Shared(&'a dyn Module),
    /// A trainable parameter.
    Param(&'a mut Param),
    /// A buffer.
    Buffer(&'a mut Buffer),
    /// A train/eval flag.
    Mode(&'a mut Mode),
    /// Nothing to walk: `None`, or configuration.
    Absent,
}

/// The train/eval flag of a module whose behaviour depends on it (PyTorch's `Module.training`).
///
/// Layers that behave differently in training (Dropout, BatchNorm) hold a `Mode` field;
/// [`train`](../module_runtime/trait.ModuleExt.html#method.train) and [`eval`](../module_runtime/trait.ModuleExt.html#method.eval) set every `Mode` in a
/// subtree. A user module can hold one too and read it in `forward`. It takes no part in paths or
/// state dicts. New flags are in training mode, as in PyTorch; a clone copies the current value.
///
/// A module that holds a `Mode` as a direct field reports it as its own flag
/// ([`is_training`](../module_runtime/trait.ModuleExt.html#method.is_training)).
pub struct Mode {
    flag: AtomicBool,
    /// Train/eval flags of the modules this is the first leaf of (like a `Param`'s).
    marks: ModeMarks,
}

impl Mode {
    /// A flag in training mode.
    pub fn new() -> Self {
        Self::with(true, ModeMarks::default())
    }

    fn with(training: bool, marks: ModeMarks) -> Self {
        Self {
            flag: AtomicBool::new(training),
            marks,
        }
    }

    /// The flags of the modules whose first leaf this is (see [`ModeMarks`]).
    pub fn mode_marks(&self) -> &ModeMarks {
        &self.marks
    }

    /// Whether the module is in training mode.
    ///
    /// Inside [`call_and_update`](../module_runtime/trait.FunctionalExt.html#method.call_and_update), the flags of the called
    /// model read as training on the calling thread only (the flag itself is not changed).
    pub fn is_training(&self) -> bool {
        if crate::scope::active()
            && let Some(training) = crate::scope::training(self.addr())
        {
            return training;
        }
        self.flag.load(Ordering::Relaxed)
    }

    /// Sets training (`true`) or evaluation (`false`) mode.
    pub fn set_training(&self, training: bool) {
        self.flag.store(training, Ordering::Relaxed);
    }

    /// The flag's identity while it is borrowed (functional scopes override flags by it).
    pub fn addr(&self) -> usize {
        self as *const Self as usize
    }
}

impl Default for Mode {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for Mode {
    fn clone(&self) -> Self {
        Self::with(self.is_training(), self.marks.snapshot())
    }
}

impl std::fmt::Debug for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Mode").field(&self.flag).finish()
    }
}

mod std_impls;

pub(crate) use std_impls::for_config_types;
