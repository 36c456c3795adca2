//! Forward errors that name the submodule that failed, like the frames of a PyTorch traceback.
//!
//! Nothing is recorded while a model runs: a successful `call` does no work here. When a module's
//! `forward` fails, its `call` wraps the error once in [`Error::Forward`] with the module's type
//! and its identity (the [`CallTarget`] hook dispatch uses). As the error passes up through each
//! enclosing `call`, that module looks for the failing one among its descendants (by identity),
//! and puts the path between them in front of the error's path. The outermost `call` returns the
//! full path (`encoder.layer.3.intermediate.dense`, a `Linear`).

use crate::error::Error;
use crate::identity::CallTarget;
use crate::module::Module;
use crate::walk::find_call_target;

/// `call`'s cold path: `error` came out of `module`'s forward (or hook dispatch).
#[cold]
#[inline(never)]
pub fn forward_error<M: Module>(module: &M, error: Error) -> Error {
    wrap(module, module.__call_target(), error)
}

fn wrap(module: &dyn Module, target: CallTarget, error: Error) -> Error {
    match error {
        Error::Forward {
            path,
            module_type,
            source,
            frame,
        } => {
            if frame == target {
                // The same node called again (a `Box`'s `call` runs the boxed module's).
                return Error::Forward {
                    path,
                    module_type,
                    source,
                    frame,
                };
            }
            match find_call_target(module, frame, String::new()) {
                Some((_, mut prefix)) => {
                    if !path.is_empty() {
                        prefix.push('.');
                        prefix.push_str(&path);
                    }
                    Error::Forward {
                        path: prefix,
                        module_type,
                        source,
                        frame: target,
                    }
                }
                // The failing module is not part of this one (a module built inside `forward`,
                // or held in a skipped field): this module's frame goes around it.
                None => Error::Forward {
                    path: String::new(),
                    module_type: module.class_name().into(),
                    source: Box::new(Error::Forward {
                        path,
                        module_type,
                        source,
                        frame,
                    }),
                    frame: target,
                },
            }
        }
        // Hook errors name the module's path already.
        error @ (Error::Hook { .. }
        | Error::HookTensorCount { .. }
        | Error::TensorTreeMismatch { .. }) => error,
        error => Error::Forward {
            path: String::new(),
            module_type: module.class_name().into(),
            source: Box::new(explain(module, error)),
            frame: target,
        },
    }
}

/// The failing module's own error, made actionable where it is a candle operation between two
/// dtypes (or devices) of which one is the module's parameters': then the other is the input's.
fn explain(module: &dyn Module, error: Error) -> Error {
    use candle_core::Error as E;
    let Error::Candle(candle) = error else {
        return error;
    };
    let mut inner = &candle;
    while let E::WithBacktrace { inner: i, .. } | E::Context { inner: i, .. } = inner {
        inner = i;
    }
    let mismatch = match inner {
        E::DTypeMismatchBinaryOp { lhs, rhs, .. } => Some((Some((*lhs, *rhs)), None)),
        E::DeviceMismatchBinaryOp { lhs, rhs, .. } => Some((None, Some((*lhs, *rhs)))),
        _ => None,
    };
    let first = crate::names::named_parameters(module, &crate::names::Names::new())
        .into_iter()
        .map(|(_, p)| p)
        .find(|p| p.is_built());
    let (Some((dtypes, devices)), Some(param)) = (mismatch, first) else {
        return Error::Candle(candle);
    };
    if let Some(input) = dtypes.and_then(|d| other(d, param.dtype())) {
        return Error::InputDType {
            input,
            params: param.dtype(),
            source: Box::new(candle),
        };
    }
    if let Some(input) = devices.and_then(|d| other(d, param.device().location())) {
        return Error::InputDevice {
            input,
            params: param.device().location(),
            source: Box::new(candle),
        };
    }
    Error::Candle(candle)
}

/// Of an operation's two sides, the one that is not `own` (the parameters'): the input's.
fn other<T: PartialEq>((lhs, rhs): (T, T), own: T) -> Option<T> {
    match (lhs == own, rhs == own) {
        (true, false) => Some(rhs),
        (false, true) => Some(lhs),
        _ => None,
    }
}
