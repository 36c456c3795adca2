//! Inputs and outputs as trees of tensors, so hooks can see and replace what flows through a module
//! whatever its `Forward` input type.

use std::cell::RefCell;

use candle_core::{DType, Tensor};

use crate::nn::AttentionInput;

mod sealed {
    pub trait Sealed {}
}

/// A value made of tensors (and plain configuration values) that hooks can read and rebuild:
/// JAX's "pytree".
///
/// [`call`](crate::ModuleExt::call) needs its input and output to be tensor trees. Implemented for
/// [`Tensor`] and `&Tensor`, tuples of up to six trees, `Vec`, `Option`, arrays, `()`, numbers,
/// `bool`, strings and [`DType`] (leaves without tensors), the runtime's own input types (such as
/// [`AttentionInput`]), and every type implementing [`TensorStruct`] — that is how a struct of your
/// own becomes an input or output. The trait itself is sealed.
///
/// Hooks see a tree as the list of its tensors, depth first in field order, and may hand back a list
/// of the same length to rebuild it: structure and non-tensor leaves are kept.
pub trait TensorTree: sealed::Sealed {
    /// Calls `f` on every tensor of the tree, depth first, in order.
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor));

    /// Rebuilds the tree with the tensors `next` hands out, in [`for_each_tensor`] order.
    ///
    /// Borrowed tensors (`&Tensor`) that are replaced are kept alive in `scope`.
    ///
    /// # Safety
    ///
    /// A tree holding references may come back pointing into `scope`: the caller must keep `scope`
    /// alive for as long as the returned value or anything derived from it is used, and must not
    /// let it escape (the runtime only hands it to `forward` calls whose output is `'static`).
    ///
    /// [`for_each_tensor`]: TensorTree::for_each_tensor
    #[doc(hidden)]
    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self
    where
        Self: Sized;

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
/// ```
/// use module_runtime::{TensorStruct, TensorTree};
/// use module_runtime::candle_core::{Device, Tensor};
///
/// struct Encoded {
///     hidden: Tensor,
///     pooled: Option<Tensor>,
///     lengths: Vec<usize>,
/// }
///
/// impl TensorStruct for Encoded {
///     fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
///         f(&self.hidden);
///         self.pooled.iter().for_each(|t| f(t));
///     }
///     fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
///         Self { hidden: f(self.hidden), pooled: self.pooled.map(&mut *f), ..self }
///     }
/// }
///
/// let e = Encoded { hidden: Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?, pooled: None, lengths: vec![2] };
/// assert_eq!(e.tensor_count(), 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub trait TensorStruct: 'static {
    /// Calls `f` on every tensor, in a fixed order.
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor));

    /// Rebuilds the value with each tensor replaced by `f` of it, in the same order.
    fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self;
}

impl<T: TensorStruct> sealed::Sealed for T {}

impl<T: TensorStruct> TensorTree for T {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        TensorStruct::for_each_tensor(self, f)
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, _scope: &Scope) -> Self {
        self.map_tensors(&mut |_| next())
    }
}

/// Where replaced borrowed tensors live while the call that uses them runs.
#[doc(hidden)]
#[derive(Default)]
pub struct Scope {
    // Boxed so that a reference handed out stays valid when the vector grows.
    #[allow(clippy::vec_box)]
    kept: RefCell<Vec<Box<Tensor>>>,
}

impl Scope {
    /// Keeps `t` alive as long as the scope and returns a reference to it.
    ///
    /// # Safety
    ///
    /// The reference is valid only while `self` is: the caller chooses `'a` and must not use the
    /// reference after the scope is dropped.
    unsafe fn keep<'a>(&self, t: Tensor) -> &'a Tensor {
        let boxed = Box::new(t);
        let ptr: *const Tensor = &*boxed;
        // The heap allocation does not move when the box is moved into the vector, and boxes are
        // only dropped with the scope.
        self.kept.borrow_mut().push(boxed);
        // SAFETY: `ptr` points into a live box owned by `self`; the caller bounds its use.
        unsafe { &*ptr }
    }
}

impl sealed::Sealed for Tensor {}

impl TensorTree for Tensor {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(self)
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, _scope: &Scope) -> Self {
        next()
    }
}

impl sealed::Sealed for &Tensor {}

impl TensorTree for &Tensor {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(self)
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self {
        let t = next();
        if t.id() == self.id() {
            return self;
        }
        // SAFETY: forwarded to the caller's contract (keep `scope` alive while the value is used).
        unsafe { scope.keep(t) }
    }
}

impl<T: TensorTree> sealed::Sealed for Option<T> {}

impl<T: TensorTree> TensorTree for Option<T> {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        if let Some(t) = self {
            t.for_each_tensor(f)
        }
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self {
        // SAFETY: the caller's contract covers the parts.
        self.map(|t| unsafe { t.rebuild(next, scope) })
    }
}

impl<T: TensorTree> sealed::Sealed for Vec<T> {}

impl<T: TensorTree> TensorTree for Vec<T> {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.iter().for_each(|t| t.for_each_tensor(f))
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self {
        self.into_iter()
            // SAFETY: the caller's contract covers the parts.
            .map(|t| unsafe { t.rebuild(next, scope) })
            .collect()
    }
}

impl<T: TensorTree, const N: usize> sealed::Sealed for [T; N] {}

impl<T: TensorTree, const N: usize> TensorTree for [T; N] {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.iter().for_each(|t| t.for_each_tensor(f))
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self {
        // SAFETY: the caller's contract covers the parts.
        self.map(|t| unsafe { t.rebuild(next, scope) })
    }
}

macro_rules! tuple_tree {
    ($($name:ident)*) => {
        impl<$($name: TensorTree),*> sealed::Sealed for ($($name,)*) {}

        impl<$($name: TensorTree),*> TensorTree for ($($name,)*) {
            #[allow(non_snake_case, unused_variables)]
            fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
                let ($($name,)*) = self;
                $($name.for_each_tensor(f);)*
            }

            #[allow(non_snake_case, unused_variables, clippy::unused_unit)]
            unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self {
                let ($($name,)*) = self;
                // SAFETY: the caller's contract covers the parts.
                ($(unsafe { $name.rebuild(next, scope) },)*)
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
            fn for_each_tensor(&self, _f: &mut dyn FnMut(&Tensor)) {}

            unsafe fn rebuild(self, _next: &mut dyn FnMut() -> Tensor, _scope: &Scope) -> Self {
                self
            }
        }
    )*};
}

leaf_tree!(bool, u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, f32, f64, String, DType);

impl sealed::Sealed for &str {}

/// A leaf without tensors.
impl TensorTree for &str {
    fn for_each_tensor(&self, _f: &mut dyn FnMut(&Tensor)) {}

    unsafe fn rebuild(self, _next: &mut dyn FnMut() -> Tensor, _scope: &Scope) -> Self {
        self
    }
}

impl sealed::Sealed for AttentionInput<'_> {}

/// Hooks see `query`, `key`, `value`, then the masks that are present.
impl TensorTree for AttentionInput<'_> {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.query.for_each_tensor(f);
        self.key.for_each_tensor(f);
        self.value.for_each_tensor(f);
        self.key_padding_mask.for_each_tensor(f);
        self.attn_mask.for_each_tensor(f);
    }

    unsafe fn rebuild(self, next: &mut dyn FnMut() -> Tensor, scope: &Scope) -> Self {
        // SAFETY: the caller's contract covers the parts.
        unsafe {
            Self {
                query: self.query.rebuild(next, scope),
                key: self.key.rebuild(next, scope),
                value: self.value.rebuild(next, scope),
                key_padding_mask: self.key_padding_mask.rebuild(next, scope),
                attn_mask: self.attn_mask.rebuild(next, scope),
                ..self
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn borrowed_tensors_are_replaced_through_the_scope() -> candle_core::Result<()> {
        let a = Tensor::new(&[1f32], &Device::Cpu)?;
        let b = Tensor::new(&[2f32], &Device::Cpu)?;
        let tree = (&a, (Some(&b), 3usize), vec![a.clone()]);
        assert_eq!(tree.tensor_count(), 3);
        let scope = Scope::default();
        let mut supply = vec![a.clone(), (&b * 10.)?, a.clone()].into_iter();
        let rebuilt = unsafe { tree.rebuild(&mut || supply.next().unwrap(), &scope) };
        // Unchanged borrowed tensors are the originals; replaced ones live in the scope.
        assert!(std::ptr::eq(rebuilt.0, &a));
        assert_eq!(rebuilt.1 .0.unwrap().to_vec1::<f32>()?, [20.]);
        assert_eq!(rebuilt.1 .1, 3);
        assert_eq!(scope.kept.borrow().len(), 1);
        Ok(())
    }
}
