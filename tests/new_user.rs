//! What a new user runs into first: the prelude has what the README writes bare, `?` works on the
//! standard library's I/O errors, error messages read like PyTorch's (no backtrace in `Display`,
//! PyTorch's class names), train/eval flags are per module, and an unbuilt parameter cannot be
//! read by mistake. Public API only (issue #27).

use module_runtime::prelude::*;

/// The README's inference snippet writes `build_empty`, `no_grad` (and the table `without_grad`,
/// `enable_grad`) bare after `use module_runtime::prelude::*;`; `expect_outputs` takes a
/// `Tolerance`.
#[test]
fn the_prelude_has_what_the_readme_writes_bare() -> Result<()> {
    let model = build_empty(|| Linear::new(3, 2, &Device::Cpu))?;
    assert!(model.weight.value().is_err()); // built only to load
    let _guard = no_grad();
    assert!(!module_runtime::is_grad_enabled());
    {
        let _inner = enable_grad();
        assert!(module_runtime::is_grad_enabled());
    }
    assert!(without_grad(|| !module_runtime::is_grad_enabled()));
    let _ = Tolerance::default();
    Ok(())
}

/// `?` on a `std::fs` call in a function returning `module_runtime::Result`.
#[test]
fn question_mark_converts_io_errors() {
    fn read(path: &std::path::Path) -> Result<Vec<u8>> {
        Ok(std::fs::read(path)?)
    }
    let missing = std::env::temp_dir().join("candle-module-new-user-no-such-file");
    let err = read(&missing).unwrap_err();
    let Error::Io { path, source, .. } = &err else {
        panic!("expected Error::Io, got {err:?}")
    };
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
    assert!(path.as_os_str().is_empty());
    // The message is the operating system's, with no empty file name in front of it.
    assert_eq!(err.to_string(), source.to_string());
    assert!(std::error::Error::source(&err).is_some());
}

/// With `RUST_BACKTRACE=1`, candle wraps its errors in `WithBacktrace`, whose `Display` prints the
/// frames. Through `call`, the message is the error's alone; the backtrace is in `{:?}` only.
#[test]
fn forward_errors_print_no_backtrace() {
    #[derive(Module)]
    struct Net {
        fc: Linear,
    }
    impl Forward<&Tensor> for Net {
        type Output = Tensor;
        fn forward(&self, _: &Tensor) -> Result<Tensor> {
            // What `candle_core::Error::bt` makes when RUST_BACKTRACE is set; built here so the
            // test does not depend on the process's environment.
            Err(candle_core::Error::WithBacktrace {
                inner: Box::new(candle_core::Error::Msg("shapes do not match".into())),
                backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
            }
            .into())
        }
    }
    use module_runtime::candle_core;
    let net = Net {
        fc: Linear::new(2, 2, &Device::Cpu).unwrap(),
    };
    let x = Tensor::zeros((1, 2), DType::F32, &Device::Cpu).unwrap();
    let err = net.call(&x).unwrap_err();
    assert_eq!(
        err.to_string(),
        "forward of Net failed: shapes do not match"
    );
    // The frames are in the `Debug` form (candle's `Debug` prints them after the message).
    assert!(format!("{err:?}").lines().count() > 2);
}
