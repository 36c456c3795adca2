//! What can go wrong with backward hooks and tensor gradient hooks: [`BackwardHookError`],
//! carried by [`Error::BackwardHook`](crate::Error::BackwardHook).

use candle_core::DType;

use super::Error;

/// A backward hook (a module's full backward hook or pre-hook, or a tensor's gradient hook) that
/// cannot be registered, or returned a gradient that cannot replace the one it was given.
///
/// These errors surface where the hook runs: from `loss.backward()` (as candle's error, which
/// converts back into this one with `?`), or from the registration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BackwardHookError {
    /// A hook returned a replacement gradient of another shape or dtype than the gradient it
    /// replaces (PyTorch refuses another shape too: "returned an invalid gradient").
    #[error(
        "{hook} on `{path}` returned a gradient for {side} {index} of shape {got_shape:?} \
         ({got_dtype:?}) where the gradient it replaces is {expected_shape:?} ({expected_dtype:?})"
    )]
    GradMismatch {
        /// The module's path (`""` for the root, or for a tensor hook).
        path: String,
        /// Which kind of hook (`"full backward hook"`, `"full backward pre-hook"`, `"tensor hook"`).
        hook: &'static str,
        /// `"input"` or `"output"`: which of the module's tensors the gradient is for.
        side: &'static str,
        /// The tensor's position among the module's inputs or outputs
        /// ([`TensorTree`](../module_runtime/trait.TensorTree.html) order).
        index: usize,
        /// The shape of the gradient it replaces.
        expected_shape: Vec<usize>,
        /// Its dtype.
        expected_dtype: DType,
        /// The shape the hook returned.
        got_shape: Vec<usize>,
        /// The dtype the hook returned.
        got_dtype: DType,
    },

    /// A full backward hook of a module none of whose inputs requires a gradient returned
    /// gradients for its inputs: there are none to replace (PyTorch's "should always return None
    /// or None for all gradients").
    #[error(
        "full backward hook on `{path}` returned input gradients, but no input of the module \
         requires a gradient: it may return only `None` (or `None` for every input)"
    )]
    NoInputGrad {
        /// The module's path.
        path: String,
    },

    /// `register_hook` on a tensor that records no gradient: neither a variable nor the result
    /// of an operation on one (PyTorch's "cannot register a hook on a tensor that doesn't
    /// require gradient").
    #[error(
        "cannot register a hook on a tensor that does not require a gradient (a {dtype:?} tensor \
         of shape {shape:?}, neither a variable nor computed from one)"
    )]
    NoGrad {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: DType,
    },
}

impl From<BackwardHookError> for Error {
    fn from(e: BackwardHookError) -> Self {
        Error::BackwardHook(Box::new(e))
    }
}

/// A runtime error as candle's error, for code that candle calls and that must return candle's
/// error (a custom op's backward: a backward hook, a checkpoint's recomputation). Candle carries
/// it as `WrappedContext` through its backward, and `From<candle_core::Error>` gives it back as
/// it was (`loss.backward()?` in a function returning this crate's `Result`). Not public API.
#[doc(hidden)]
pub fn carry(e: Error) -> candle_core::Error {
    candle_core::Error::WrappedContext {
        wrapped: Box::new(e),
        context: "raised in candle's backward".to_owned(),
    }
}
