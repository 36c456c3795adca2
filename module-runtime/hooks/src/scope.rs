//! Where a pre-hook's replacement of a *borrowed* input tensor lives while its call runs.
//!
//! A module called with a `&Tensor` is given a `&Tensor`; when a pre-hook replaces that tensor, the
//! replacement is a new `Tensor` that must live as long as the call, behind a reference of the
//! caller's lifetime. [`TensorTree::rebuild`] hands out such references from a [`Scope`], and the
//! lifetime it hands out cannot be tied to the scope in the trait's signature (`Self` may be any
//! `&'a Tensor`). So this file holds the hook machinery's `unsafe`: the scope's constructor is
//! `unsafe`, and the only functions that create a scope are the three below, each with the
//! reasoning for why nothing rebuilt with it outlives it:
//!
//! - `forward_replaced`: rebuilds a call's input and runs the call on it, the scope on its own
//!   stack frame, around the call;
//! - `rebuild_owned`: rebuilds a call's output (a `'static` value);
//! - [`map_tree`]: what `#[derive(TensorStruct)]`'s `map_tensors` does with each field.

use std::cell::RefCell;

use candle_core::Tensor;

use crate::error::Error;
use crate::tensor_tree::TensorTree;

/// Where replaced borrowed input tensors live while the call that uses them runs.
///
/// Only this file's functions create one (the constructor is `unsafe`): that is what makes
/// [`TensorTree::rebuild`], which hands out references into it, safe to call.
#[doc(hidden)]
pub struct Scope {
    // Boxed so that a reference handed out stays valid when the vector grows.
    #[allow(clippy::vec_box)]
    kept: RefCell<Vec<Box<Tensor>>>,
}

impl Scope {
    /// An empty scope.
    ///
    /// # Safety
    ///
    /// The scope must outlive every value rebuilt with it and everything derived from those values:
    /// [`keep`](Self::keep) hands out references of any lifetime into it.
    unsafe fn new() -> Self {
        Self {
            kept: RefCell::new(Vec::new()),
        }
    }

    /// Whether nothing was kept.
    fn is_empty(&self) -> bool {
        self.kept.borrow().is_empty()
    }

    /// Whether a tensor of `tree` is one this scope keeps (a borrowed leaf pointing into it).
    fn is_referenced_by<T: TensorTree>(&self, tree: &T) -> bool {
        let kept = self.kept.borrow();
        let mut found = false;
        tree.for_each_tensor(&mut |t| {
            found |= kept.iter().any(|k| std::ptr::eq(&**k, t));
        });
        found
    }

    /// Keeps `t` alive as long as the scope and returns a reference to it.
    pub fn keep<'a>(&self, t: Tensor) -> &'a Tensor {
        let boxed = Box::new(t);
        let ptr: *const Tensor = &*boxed;
        // The heap allocation does not move when the box is moved into the vector, and boxes are
        // only dropped with the scope.
        self.kept.borrow_mut().push(boxed);
        // SAFETY: `ptr` points into a live box owned by `self`, and the scope outlives every use of
        // the reference by the contract of `Scope::new`, its only constructor.
        unsafe { &*ptr }
    }
}

/// A rebuild was handed another number of tensors than the tree visited: a
/// [`TensorStruct`](crate::TensorStruct) impl that maps another number of tensors than it lists.
#[derive(Debug)]
pub(crate) struct Mismatch {
    type_name: &'static str,
    listed: usize,
    visited: usize,
}

impl Mismatch {
    /// The error, naming the module at `path` whose input or output it was.
    pub(crate) fn into_error(self, path: &str) -> Error {
        Error::TensorTreeMismatch {
            path: path.to_owned(),
            type_name: self.type_name,
            listed: self.listed,
            visited: self.visited,
        }
    }
}

/// Rebuilds `tree` with `tensors` (as many as it lists), or says how the counts differ.
fn rebuild<T: TensorTree>(tree: T, tensors: Vec<Tensor>, scope: &Scope) -> Result<T, Mismatch> {
    let listed = tensors.len();
    let mut supply = tensors.into_iter();
    let mut visited = 0;
    let rebuilt = tree.rebuild(
        &mut |old| {
            visited += 1;
            // Past the end, keep the old tensor: the count check below reports the mismatch.
            supply.next().unwrap_or_else(|| old.clone())
        },
        scope,
    );
    if visited != listed {
        return Err(Mismatch {
            type_name: std::any::type_name::<T>(),
            listed,
            visited,
        });
    }
    Ok(rebuilt)
}

/// Runs `forward` on `input` rebuilt with `tensors` (a pre-hook's replacement, as many as the input
/// lists); fails before running it if the input visits another number of tensors.
///
/// The replaced borrowed tensors of the input live in a scope on this function's frame, which
/// outlives the call.
pub(crate) fn forward_replaced<In, Out, E>(
    input: In,
    tensors: Vec<Tensor>,
    forward: impl FnOnce(In) -> Result<Out, E>,
) -> Result<Result<Out, E>, Mismatch>
where
    In: TensorTree,
    Out: TensorTree + 'static,
    E: 'static,
{
    // SAFETY: the rebuilt input is the only value that references the scope, and it is moved into
    // `forward`, which returns before the scope is dropped (at the end of this function, or never).
    // What `forward` returns is `'static`, so the only references into the scope it can carry are
    // `&'static Tensor` leaves (a module handing its replaced input back as its output): when one
    // is there, the scope is leaked instead of dropped. A `&'static Tensor` in a
    // `#[tensor(skip)]` field of a `TensorStruct` output is not visited, and would escape this
    // check; no such output exists in this workspace.
    let scope = unsafe { Scope::new() };
    let input = rebuild(input, tensors, &scope)?;
    let result = forward(input);
    if let Ok(out) = &result
        && !scope.is_empty()
        && scope.is_referenced_by(out)
    {
        std::mem::forget(scope);
    }
    Ok(result)
}

/// Rebuilds `tree` (a call's output, which forward hooks replace) with `tensors`, as many as it
/// lists.
///
/// An owned tree keeps nothing in the scope; a borrowed `&'static Tensor` leaf that is replaced
/// needs a home that lives forever, and the scope that holds it is then leaked.
pub(crate) fn rebuild_owned<T: TensorTree + 'static>(
    tree: T,
    tensors: Vec<Tensor>,
) -> Result<T, Mismatch> {
    // SAFETY: the scope outlives every value rebuilt with it: when `keep` handed out a reference
    // the scope is leaked, and when it did not, no value refers to it.
    let scope = unsafe { Scope::new() };
    let rebuilt = rebuild(tree, tensors, &scope);
    if !scope.is_empty() {
        std::mem::forget(scope);
    }
    rebuilt
}

/// Rebuilds `tree` with each tensor replaced by `f` of it, outside hook dispatch: what
/// `#[derive(TensorStruct)]`'s `map_tensors` does with each field.
///
/// A borrowed `&'static Tensor` leaf that `f` replaces needs a home that lives forever: the scope
/// that holds it is then leaked (a field type no derived struct has in practice); otherwise nothing
/// references the scope and it is dropped.
pub fn map_tree<T: TensorTree>(tree: T, f: &mut dyn FnMut(Tensor) -> Tensor) -> T {
    // SAFETY: the scope outlives every value rebuilt with it: when `keep` handed out a reference
    // the scope is leaked, and when it did not, no value refers to it.
    let scope = unsafe { Scope::new() };
    let rebuilt = tree.rebuild(&mut |old| f(old.clone()), &scope);
    if !scope.is_empty() {
        std::mem::forget(scope);
    }
    rebuilt
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
        // SAFETY: the scope outlives `rebuilt`, the only value rebuilt with it.
        let scope = unsafe { Scope::new() };
        let mut supply = vec![a.clone(), (&b * 10.)?, a.clone()].into_iter();
        let rebuilt = tree.rebuild(&mut |_| supply.next().unwrap(), &scope);
        // Unchanged borrowed tensors are the originals; replaced ones live in the scope.
        assert!(std::ptr::eq(rebuilt.0, &a));
        assert_eq!(rebuilt.1 .0.unwrap().to_vec1::<f32>()?, [20.]);
        assert_eq!(rebuilt.1 .1, 3);
        assert_eq!(scope.kept.borrow().len(), 1);
        assert!(scope.is_referenced_by(&rebuilt));
        assert!(!scope.is_referenced_by(&(&a, &b)));
        Ok(())
    }

    #[test]
    fn a_replaced_input_handed_back_as_the_output_outlives_the_call() -> candle_core::Result<()> {
        static INPUT: std::sync::OnceLock<Tensor> = std::sync::OnceLock::new();
        let input: &'static Tensor =
            INPUT.get_or_init(|| Tensor::new(&[1f32], &Device::Cpu).unwrap());
        let replacement = Tensor::new(&[5f32], &Device::Cpu)?;
        // The identity on a `&'static Tensor`: its output is the replaced input, which must stay
        // alive after the call (the scope is leaked).
        let out = forward_replaced(input, vec![replacement], Ok::<_, ()>)
            .unwrap()
            .unwrap();
        assert_eq!(out.to_vec1::<f32>()?, [5.]);
        let short = forward_replaced(input, vec![], Ok::<_, ()>).unwrap_err();
        assert_eq!((short.listed, short.visited), (0, 1));
        Ok(())
    }
}
