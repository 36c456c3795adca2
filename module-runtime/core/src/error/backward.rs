//! What can go wrong with backward hooks and tensor gradient hooks: [`BackwardHookError`],
//! carried by [`Error::BackwardHook`](crate::Error::BackwardHook).

use std::cell::RefCell;

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

thread_local! {
    /// The last runtime error sent through candle's backward on this thread, with the message of
    /// the candle error that stands for it.
    static CARRIED: RefCell<Option<(String, Error)>> = const { RefCell::new(None) };
}

/// A runtime error as candle's error, for code that candle calls and that must return candle's
/// error (a custom op's backward, where backward hooks run): candle's error cannot hold it, so
/// it is kept on this thread, and `From<candle_core::Error>` gives it back when it meets the
/// candle error that stands for it (`loss.backward()?` in a function returning this crate's
/// `Result`). Not public API.
#[doc(hidden)]
pub fn carry(e: Error) -> candle_core::Error {
    let message = e.to_string();
    CARRIED.with(|c| *c.borrow_mut() = Some((message.clone(), e)));
    candle_core::Error::Msg(message)
}

/// The error [`carry`] kept for `e`, if `e` stands for one (taken: it is given back once).
pub(super) fn carried(e: &candle_core::Error) -> Option<Error> {
    let candle_core::Error::Msg(message) = e else {
        return None;
    };
    CARRIED.with(|c| {
        let mut c = c.borrow_mut();
        match c.take() {
            Some((m, e)) if m == *message => Some(e),
            other => {
                *c = other;
                None
            }
        }
    })
}
