//! How an error prints with `{:?}`: what `fn main() -> Result<..>` and `unwrap` show a user.
//!
//! Rust prints the error a `main` returns, and the one an `unwrap` panics with, with `Debug`. A
//! derived `Debug` is a struct dump (`Forward { path: "", module_type: …, source: InputDType { … },
//! frame: CallTarget { addr: …, ty: TypeId(…) } }`) in which the message that says what to change
//! never appears. So `Debug` prints what `anyhow` prints: the message, then each cause that the
//! message does not already say, and, where candle attached a backtrace (`RUST_BACKTRACE=1`), its
//! frames last. No address or type id is ever shown; match on the variant for its fields.

use std::backtrace::Backtrace;
use std::error::Error as StdError;
use std::fmt;

use super::messages::CandleMessage;
use super::Error;

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_debug(self, f)
    }
}

/// `err` as users meet it (see the module docs): its message, the causes its message does not
/// already say (`Caused by:`), and candle's backtrace if one is attached anywhere in the chain.
/// The `Debug` of this crate's [`Error`] and of the optimizers' error.
pub fn fmt_debug(err: &(dyn StdError + 'static), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let message = err.to_string();
    f.write_str(&message)?;
    let mut said = message;
    let mut heading = true;
    let mut backtrace = None;
    let mut next = Some(err);
    while let Some(e) = next {
        backtrace = backtrace.or_else(|| backtrace_of(e));
        if !std::ptr::addr_eq(e, err) {
            let text = match downcast::<candle_core::Error>(e) {
                Some(candle) => CandleMessage(candle).to_string(),
                None => e.to_string(),
            };
            if !said.contains(&text) {
                if heading {
                    f.write_str("\n\nCaused by:")?;
                    heading = false;
                }
                write!(f, "\n    {}", text.replace('\n', "\n    "))?;
                said.push_str(&text);
            }
        }
        next = e.source();
    }
    if let Some(backtrace) = backtrace {
        write!(
            f,
            "\n\nStack backtrace (where candle raised the error):\n{backtrace}"
        )?;
    }
    Ok(())
}

/// The backtrace candle attached to `e` (`candle_core::Error::WithBacktrace`, also under its
/// `Context` and `WithPath` wrappers), for `e` a candle error or this crate's `Error::Candle`.
fn backtrace_of<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a Backtrace> {
    let candle = match downcast::<Error>(e) {
        Some(Error::Candle(candle)) => candle,
        Some(_) => return None,
        None => downcast::<candle_core::Error>(e)?,
    };
    candle_backtrace(candle)
}

/// `e` as a `T`, also where a variant holds it boxed (a boxed error is the source then).
fn downcast<'a, T: StdError + 'static>(e: &'a (dyn StdError + 'static)) -> Option<&'a T> {
    e.downcast_ref::<T>()
        .or_else(|| e.downcast_ref::<Box<T>>().map(|b| &**b))
}

fn candle_backtrace(e: &candle_core::Error) -> Option<&Backtrace> {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { backtrace, .. } => Some(backtrace),
        E::Context { inner, .. } | E::WithPath { inner, .. } => candle_backtrace(inner),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use crate::Error;

    /// What `main` prints for a forward that failed on the input's dtype: the message with its
    /// fix and the operation that failed, no struct, no address, no type id.
    #[test]
    fn debug_is_the_message_and_its_causes() {
        let err = Error::Forward {
            path: String::new(),
            module_type: "Linear".into(),
            source: Box::new(Error::InputDType {
                input: DType::F64,
                params: DType::F32,
                source: Box::new(candle_core::Error::Msg("dtype mismatch in matmul".into())),
            }),
            frame: crate::identity::CallTarget::of(&()),
        };
        let debug = format!("{err:?}");
        assert!(debug.starts_with(&err.to_string()), "{debug}");
        assert!(debug.contains("convert the input"), "{debug}");
        assert!(
            debug.contains("Caused by:\n    dtype mismatch in matmul"),
            "{debug}"
        );
        for internal in ["CallTarget", "addr", "TypeId", "Forward {", "source:"] {
            assert!(!debug.contains(internal), "{internal} in {debug}");
        }
        // A cause the message already says is not repeated.
        let io = Error::from(std::io::Error::other("disk full"));
        assert_eq!(format!("{io:?}"), io.to_string());
    }

    /// candle's backtrace, when attached, comes after the message, once.
    #[test]
    fn debug_ends_with_candles_backtrace() {
        let candle = candle_core::Error::WithBacktrace {
            inner: Box::new(candle_core::Error::Msg("shape mismatch".into())),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let err = Error::from(candle);
        let debug = format!("{err:?}");
        assert!(
            debug.starts_with("shape mismatch\n\nStack backtrace"),
            "{debug}"
        );
        assert_eq!(debug.matches("shape mismatch").count(), 1, "{debug}");
    }
}
