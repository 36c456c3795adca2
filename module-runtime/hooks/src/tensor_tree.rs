//! Inputs and outputs as trees of tensors (JAX's pytrees), so hooks can see and replace what flows
//! through a module whatever its `Forward` input type. This is the tree of *tensors* a call takes
//! and returns; the tree of *modules* is [`Module`](module_core::Module)'s.

use candle_core::{DType, Tensor};

pub use crate::scope::Scope;

pub mod sealed {
    pub trait Sealed {}
}

/// A value made of tensors (and plain configuration values) that hooks can read and rebuild:
/// JAX's "pytree".
///
/// [`call`](crate::ModuleExt::call) needs its input and output to be tensor trees. Implemented for
/// [`Tensor`] and `&Tensor`, tuples of up to six trees, `Vec`, `Option`, arrays, `()`, numbers,
/// `bool`, strings and [`DType`] (leaves without tensors), the runtime's own input types (such as
/// [`AttentionInput`](../module_runtime/nn/struct.AttentionInput.html)), and every type implementing [`TensorStruct`] — that is how a struct of your
/// own becomes an input or output. The trait itself is sealed.
///
/// Hooks see a tree as the list of its tensors, depth first in field order, and may hand back a list
/// of the same length to rebuild it: structure and non-tensor leaves are kept.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tree of tensors",
    label = "not a tensor, a tuple/`Vec`/`Option` of tensors, or a `TensorStruct`",
    note = "derive `TensorStruct` for a struct of your own, or mark a plain field `#[tensor(skip)]`"
)]
pub trait TensorTree: sealed::Sealed {
    /// Calls `f` on every tensor of the tree, depth first, in order.
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor));

    /// Rebuilds the tree with the tensors `next` hands out, in [`for_each_tensor`] order; `next`
    /// is given the tensor it replaces. Structure and non-tensor leaves are kept.
    ///
    /// Borrowed tensors (`&Tensor`) that are replaced are kept alive in `scope`, which only hook
    /// dispatch can create (see [`Scope`]).
    ///
    /// [`for_each_tensor`]: TensorTree::for_each_tensor
    #[doc(hidden)]
    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, scope: &Scope) -> Self
    where
        Self: Sized;

    /// The tree with every borrowed part owned: `Tensor` for `&Tensor`, `(Tensor, Option<Tensor>)`
    /// for `(&Tensor, Option<&Tensor>)`, `String` for `&str`,
    /// [`OwnedAttentionInput`](../module_runtime/nn/struct.OwnedAttentionInput.html) for
    /// [`AttentionInput`](../module_runtime/nn/struct.AttentionInput.html); a `TensorStruct` and an owned tree are their
    /// own owned form. It is what a typed forward hook
    /// ([`register_typed_hook`](crate::Hooks::register_typed_hook)) sees of a module's input,
    /// which `forward` has consumed by the time the hook runs.
    type Owned: 'static;

    /// A copy of the tree with every borrowed part owned (tensors are reference counted: no data
    /// is copied). `None` for a [`TensorStruct`] whose
    /// [`clone_tree`](TensorStruct::clone_tree) gives none.
    fn to_owned_tree(&self) -> Option<Self::Owned>;

    /// The tree's tensors, in order.
    fn tensors(&self) -> Vec<Tensor> {
        let mut out = Vec::new();
        self.for_each_tensor(&mut |t| out.push(t.clone()));
        out
    }

    /// How many tensors the tree holds.
    fn tensor_count(&self) -> usize {
        let mut n = 0;
        self.for_each_tensor(&mut |_| n += 1);
        n
    }
}

/// Makes a struct of your own a [`TensorTree`], so it can be a module's input or output with hooks
/// seeing its tensors. The struct owns its tensors (`'static`).
///
/// Derive it: `#[derive(TensorStruct)]` walks the fields in order, each a tensor or any tensor tree
/// (`Option<Tensor>`, `Vec<Tensor>`, tuples, another `TensorStruct`, …); a field marked
/// `#[tensor(skip)]` is a plain value, carried over unchanged when hooks rebuild the struct. Named
/// fields, tuple structs and generic structs work; enums and unions are a compile error.
///
/// ```
/// use module_runtime::{TensorStruct, TensorTree};
/// use module_runtime::candle_core::{DType, Device, Tensor};
///
/// #[derive(TensorStruct)]
/// struct Encoded {
///     hidden: Tensor,
///     pooled: Option<Tensor>,
///     #[tensor(skip)]
///     lengths: Vec<usize>,
/// }
///
/// let e = Encoded { hidden: Tensor::zeros(2, DType::F32, &Device::Cpu)?, pooled: None, lengths: vec![2] };
/// assert_eq!(e.tensor_count(), 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// By hand, the same impl is:
///
/// ```
/// # use module_runtime::TensorStruct;
/// # use module_runtime::candle_core::Tensor;
/// # struct Encoded { hidden: Tensor, pooled: Option<Tensor>, lengths: Vec<usize> }
/// impl TensorStruct for Encoded {
///     fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
///         f(&self.hidden);
///         self.pooled.iter().for_each(|t| f(t));
///     }
///     fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
///         Self { hidden: f(self.hidden), pooled: self.pooled.map(&mut *f), ..self }
///     }
/// }
/// ```
pub trait TensorStruct: 'static {
    /// Calls `f` on every tensor, in a fixed order.
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor));

    /// Rebuilds the value with each tensor replaced by `f` of it, in the same order.
    fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self;

    /// A copy of the value, for the typed forward hooks of a module that takes it as input
    /// ([`register_typed_hook`](crate::Hooks::register_typed_hook)): by the time such a hook runs,
    /// `forward` has consumed the input. `#[derive(TensorStruct)]` gives `Some(self.clone())` when
    /// the struct is `Clone` (for a generic struct: when `Clone` holds for every parameter that
    /// meets the impl's bounds, so in practice a non-generic struct); the default, `None`, makes
    /// such a hook fail with [`Error::HookInputType`](module_core::Error::HookInputType).
    fn clone_tree(&self) -> Option<Self>
    where
        Self: Sized,
    {
        None
    }
}

impl<T: TensorStruct> sealed::Sealed for T {}

impl<T: TensorStruct> TensorTree for T {
    type Owned = T;

    fn to_owned_tree(&self) -> Option<T> {
        self.clone_tree()
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        TensorStruct::for_each_tensor(self, f)
    }

    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, _scope: &Scope) -> Self {
        self.map_tensors(&mut |old| next(&old))
    }
}

impl sealed::Sealed for Tensor {}

impl TensorTree for Tensor {
    type Owned = Tensor;

    fn to_owned_tree(&self) -> Option<Tensor> {
        Some(self.clone())
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(self)
    }

    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, _scope: &Scope) -> Self {
        next(&self)
    }
}

impl sealed::Sealed for &Tensor {}

impl TensorTree for &Tensor {
    type Owned = Tensor;

    fn to_owned_tree(&self) -> Option<Tensor> {
        Some((*self).clone())
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(self)
    }

    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, scope: &Scope) -> Self {
        let t = next(self);
        if t.id() == self.id() {
            return self;
        }
        scope.keep(t)
    }
}

impl<T: TensorTree> sealed::Sealed for Option<T> {}

impl<T: TensorTree> TensorTree for Option<T> {
    type Owned = Option<T::Owned>;

    fn to_owned_tree(&self) -> Option<Option<T::Owned>> {
        match self {
            Some(t) => t.to_owned_tree().map(Some),
            None => Some(None),
        }
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        if let Some(t) = self {
            t.for_each_tensor(f)
        }
    }

    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, scope: &Scope) -> Self {
        self.map(|t| t.rebuild(next, scope))
    }
}

impl<T: TensorTree> sealed::Sealed for Vec<T> {}

impl<T: TensorTree> TensorTree for Vec<T> {
    type Owned = Vec<T::Owned>;

    fn to_owned_tree(&self) -> Option<Vec<T::Owned>> {
        self.iter().map(T::to_owned_tree).collect()
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.iter().for_each(|t| t.for_each_tensor(f))
    }

    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, scope: &Scope) -> Self {
        self.into_iter().map(|t| t.rebuild(next, scope)).collect()
    }
}

impl<T: TensorTree, const N: usize> sealed::Sealed for [T; N] {}

impl<T: TensorTree, const N: usize> TensorTree for [T; N] {
    type Owned = [T::Owned; N];

    fn to_owned_tree(&self) -> Option<[T::Owned; N]> {
        let owned: Vec<T::Owned> = self.iter().map(T::to_owned_tree).collect::<Option<_>>()?;
        owned.try_into().ok()
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.iter().for_each(|t| t.for_each_tensor(f))
    }

    fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, scope: &Scope) -> Self {
        self.map(|t| t.rebuild(next, scope))
    }
}

macro_rules! tuple_tree {
    ($($name:ident)*) => {
        impl<$($name: TensorTree),*> sealed::Sealed for ($($name,)*) {}

        impl<$($name: TensorTree),*> TensorTree for ($($name,)*) {
            type Owned = ($($name::Owned,)*);

            #[allow(non_snake_case, clippy::unused_unit)]
            fn to_owned_tree(&self) -> Option<Self::Owned> {
                let ($($name,)*) = self;
                Some(($($name.to_owned_tree()?,)*))
            }

            #[allow(non_snake_case, unused_variables)]
            fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
                let ($($name,)*) = self;
                $($name.for_each_tensor(f);)*
            }

            #[allow(non_snake_case, unused_variables, clippy::unused_unit)]
            fn rebuild(self, next: &mut dyn FnMut(&Tensor) -> Tensor, scope: &Scope) -> Self {
                let ($($name,)*) = self;
                ($($name.rebuild(next, scope),)*)
            }
        }
    };
}

tuple_tree!();
tuple_tree!(A);
tuple_tree!(A B);
tuple_tree!(A B C);
tuple_tree!(A B C D);
tuple_tree!(A B C D E);
tuple_tree!(A B C D E F);

macro_rules! leaf_tree {
    ($($ty:ty),*) => {$(
        impl sealed::Sealed for $ty {}

        /// A leaf without tensors: hooks do not see it, and it is kept as it is.
        impl TensorTree for $ty {
            type Owned = $ty;

            fn to_owned_tree(&self) -> Option<$ty> {
                Some(self.clone())
            }

            fn for_each_tensor(&self, _f: &mut dyn FnMut(&Tensor)) {}

            fn rebuild(self, _next: &mut dyn FnMut(&Tensor) -> Tensor, _scope: &Scope) -> Self {
                self
            }
        }
    )*};
}

leaf_tree!(bool, u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, f32, f64, String, DType);

impl sealed::Sealed for &str {}

/// A leaf without tensors.
impl TensorTree for &str {
    type Owned = String;

    fn to_owned_tree(&self) -> Option<String> {
        Some((*self).to_owned())
    }

    fn for_each_tensor(&self, _f: &mut dyn FnMut(&Tensor)) {}

    fn rebuild(self, _next: &mut dyn FnMut(&Tensor) -> Tensor, _scope: &Scope) -> Self {
        self
    }
}
