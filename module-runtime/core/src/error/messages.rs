//! What [`Error`]'s messages are made of: the helpers its variants' `#[error]` texts call, a
//! candle error's message without its backtraces, the conversions from and to `std::io` and
//! candle errors, and [`Error::inner`].

use candle_core::{DType, DeviceLocation, Shape};

use super::Error;

/// `` `encoder.layer.3` (Layer)``, or the bare type for the module called.
pub(super) fn module_at(path: &str, ty: &str) -> String {
    if path.is_empty() {
        ty.to_owned()
    } else {
        format!("`{path}` ({ty})")
    }
}

pub(super) fn near_matches(names: &[String]) -> String {
    if names.is_empty() {
        String::from(" (it has no submodules)")
    } else {
        format!("; did you mean: {}", names.join(", "))
    }
}

pub(super) fn list_children(names: &[String]) -> String {
    if names.is_empty() {
        String::from(" (it has none)")
    } else {
        format!("; there is: {}", names.join(", "))
    }
}

impl From<candle_core::Error> for Error {
    /// An [`Error::Candle`], except for an error of ours that went through candle's backward (a
    /// backward hook's, a checkpoint's recomputation's: [`carry`](super::backward::carry), which
    /// candle carries as `WrappedContext`): it comes back as itself.
    fn from(e: candle_core::Error) -> Self {
        match e {
            candle_core::Error::WrappedContext { wrapped, context } => {
                match wrapped.downcast::<Error>() {
                    Ok(ours) => *ours,
                    Err(wrapped) => {
                        Error::Candle(candle_core::Error::WrappedContext { wrapped, context })
                    }
                }
            }
            other => Error::Candle(other),
        }
    }
}

/// A candle error's message without its backtraces (`WithBacktrace` anywhere in the chain of
/// `Context`/`WithPath` wrappers prints its inner error only).
pub(super) struct CandleMessage<'a>(pub(super) &'a candle_core::Error);

impl std::fmt::Display for CandleMessage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use candle_core::Error as E;
        // The same texts as candle's own `#[error(..)]` for these variants, minus the backtrace.
        match self.0 {
            E::WithBacktrace { inner, .. } => CandleMessage(inner).fmt(f),
            E::Context { inner, context } => write!(f, "{context}\n{}", CandleMessage(inner)),
            E::WithPath { inner, path } => write!(f, "path: {path:?} {}", CandleMessage(inner)),
            other => std::fmt::Display::fmt(other, f),
        }
    }
}

impl From<std::io::Error> for Error {
    /// An [`Error::Io`] that names no file (the `std::io::Error` does not know it).
    fn from(source: std::io::Error) -> Self {
        Error::Io {
            path: std::path::PathBuf::new(),
            source,
        }
    }
}

/// `` `path`: `` before an [`Error::Io`]'s message, or nothing when the file is unknown.
pub(super) fn file_prefix(path: &std::path::Path) -> String {
    if path.as_os_str().is_empty() {
        String::new()
    } else {
        format!("`{}`: ", path.display())
    }
}

impl From<Error> for candle_core::Error {
    /// Lets runtime layers implement `candle_nn::Module` by converting back to candle's error type.
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// The name of a device's location: `cpu`, `cuda:0`, `metal:0`.
pub fn location_name(location: &DeviceLocation) -> String {
    match location {
        DeviceLocation::Cpu => "cpu".to_owned(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The end of a [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) message whose two devices are one GPU opened twice.
pub(super) fn same_location_hint(expected: &DeviceLocation, got: &DeviceLocation) -> &'static str {
    if expected == got {
        " (two handles for one GPU: create the device once, e.g. with `parse_device`)"
    } else {
        ""
    }
}

pub(super) fn at_offset(offset: &Option<u64>) -> String {
    match offset {
        Some(offset) => format!(" (at byte {offset})"),
        None => String::new(),
    }
}

/// What to do about [`Error::NotLoaded`].
pub(super) fn not_loaded_hint(awaits_load: &bool) -> &'static str {
    if *awaits_load {
        "the model was built under `empty_weights` (build only to load); load a checkpoint into it \
         before calling it"
    } else {
        "it is lazy and not built; call the model once, run `model.build(&sample)`, or load a \
         checkpoint"
    }
}

/// ` at `path`` for a path that is known and not the root's.
pub(super) fn with_article(kind: &str) -> String {
    let article = if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {kind}")
}

pub(super) fn flattened_fields(fields: &[&str], parent_type: &str) -> String {
    let list = fields
        .iter()
        .map(|f| format!("`{f}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let (s, verb, its) = if fields.len() == 1 {
        ("", "lifts", "its")
    } else {
        ("s", "lift", "their")
    };
    format!(
        "the `#[module(flatten)]`ed field{s} {list} {verb} {its} children and extra state to \
         `{parent_type}`'s level"
    )
}

/// What to change when the input's dtype is not the parameters': a float input or the model can
/// be converted; an integer input cannot become the model's dtype (parameters are floats), so it
/// is converted, or looked up with an `Embedding` if it holds ids.
pub(super) fn dtype_fix(input: DType, params: DType) -> String {
    if input.is_float() {
        format!(
            "convert the input (`x.to_dtype(DType::{params:?})?`), or the model \
             (`model.to_dtype(DType::{input:?})?`)"
        )
    } else {
        format!(
            "convert the input (`x.to_dtype(DType::{params:?})?`); if it holds token or class \
             ids, look them up with an `Embedding` layer first (a model's parameters are \
             floating-point, so it cannot become {input:?})"
        )
    }
}

/// What to change, for [`Error::InputShape`], where the expected shape is one list of
/// dimensions (`[N, C, H, W]`, `[batch, 16]`): a missing batch dimension, one too many, or the
/// dimensions whose size the layer fixes and the input does not have. Empty where the expected
/// shapes are alternatives (`… or …`) or nothing can be said.
pub(super) fn shape_fix(expected: &str, got: &Shape) -> String {
    let Some(inner) = expected
        .trim()
        .strip_prefix('[')
        .and_then(|e| e.strip_suffix(']'))
        .filter(|e| !e.contains('[') && !e.contains(" or "))
    else {
        return String::new();
    };
    let wanted: Vec<&str> = inner.split(',').map(str::trim).collect();
    let dims = got.dims();
    if dims.len() + 1 == wanted.len() {
        return format!(
            ": one dimension short; for a single sample add the batch dimension \
             (`x.unsqueeze(0)?`, giving {:?})",
            std::iter::once(1)
                .chain(dims.iter().copied())
                .collect::<Vec<_>>()
        );
    }
    if dims.len() == wanted.len() + 1 && dims.first() == Some(&1) {
        return ": one dimension too many; remove the leading 1 (`x.squeeze(0)?`)".to_owned();
    }
    if dims.len() != wanted.len() {
        return format!(
            ": {} dimensions where {} are expected; reshape the input (`x.reshape(..)?`)",
            dims.len(),
            wanted.len()
        );
    }
    let wrong: Vec<String> = wanted
        .iter()
        .zip(dims)
        .enumerate()
        .filter_map(|(i, (w, &g))| {
            let w: usize = w.split_whitespace().next()?.parse().ok()?;
            (w != g).then(|| format!("dimension {i} is {g}, the layer takes {w}"))
        })
        .collect();
    match wrong.is_empty() {
        true => String::new(),
        false => format!(
            ": {}; give it inputs of that size, or build the layer for {}",
            wrong.join(", "),
            if wrong.len() == 1 {
                "this one"
            } else {
                "these"
            }
        ),
    }
}

pub(super) fn at(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!(" at `{path}`")
    }
}

impl Error {
    /// The error itself, or for an [`Error::Forward`] the error the forward failed with (under
    /// every `Forward` frame), to match on what went wrong wherever it happened.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::Error;
    ///
    /// // A layer of your own that calls candle directly.
    /// #[derive(Module)]
    /// struct Projection { weight: Param }
    /// impl Forward<&Tensor> for Projection {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> { Ok(x.matmul(&self.weight.tensor()?)?) }
    /// }
    ///
    /// #[derive(Module)]
    /// struct Net { fc: Projection }
    /// impl Forward<&Tensor> for Net {
    ///     type Output = Tensor;
    ///     fn forward(&self, x: &Tensor) -> Result<Tensor> { self.fc.call(x) }
    /// }
    ///
    /// let weight = Param::new(Tensor::zeros((4, 2), DType::F32, &Device::Cpu)?)?;
    /// let net = Net { fc: Projection { weight } };
    /// let err = net.call(&Tensor::zeros((3, 5), DType::F32, &Device::Cpu)?).unwrap_err();
    /// assert!(matches!(&err, Error::Forward { path, .. } if path == "fc"));
    /// assert!(matches!(err.inner(), Error::Candle(_))); // candle's matmul failed
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn inner(&self) -> &Error {
        let mut error = self;
        while let Error::Forward { source, .. } = error {
            error = source;
        }
        error
    }
}

#[cfg(test)]
mod tests {
    use crate::Error;

    /// A candle error as candle builds it with `RUST_BACKTRACE=1` (`Error::bt`), whatever the
    /// environment of the test process.
    fn with_backtrace(inner: candle_core::Error) -> candle_core::Error {
        candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        }
    }

    #[test]
    fn display_leaves_candle_backtraces_out_and_debug_keeps_them() {
        let plain = candle_core::Error::Msg("shape mismatch".into());
        let cases = [
            (with_backtrace(plain), "shape mismatch"),
            (
                with_backtrace(candle_core::Error::Msg("inner".into())).context("while adding"),
                "while adding\ninner",
            ),
            (
                with_backtrace(candle_core::Error::Msg("inner".into())).with_path("m.bin"),
                "path: \"m.bin\" inner",
            ),
        ];
        for (candle, expected) in cases {
            assert!(
                candle.to_string().len() > expected.len(),
                "candle prints a backtrace"
            );
            let e = Error::from(candle);
            assert_eq!(e.to_string(), expected);
            // candle's `Debug` prints its message with the frames, one or two lines each.
            let debug = format!("{e:?}");
            assert!(
                debug.lines().count() > expected.lines().count() + 1,
                "{debug}"
            );
        }
        // Nested in a forward frame, too.
        let forward = Error::Forward {
            path: "fc".into(),
            module_type: "Linear".into(),
            source: Box::new(Error::from(with_backtrace(candle_core::Error::Msg(
                "shape mismatch".into(),
            )))),
            frame: crate::identity::CallTarget::of(&()),
        };
        assert_eq!(
            forward.to_string(),
            "forward of `fc` (Linear) failed: shape mismatch"
        );
    }
}
