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
                    module_type: module.type_name(),
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
            module_type: module.type_name(),
            source: Box::new(error),
            frame: target,
        },
    }
}
