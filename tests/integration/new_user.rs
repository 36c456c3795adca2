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
    assert!(model.weight.tensor().is_err()); // built only to load
    let _guard = no_grad();
    assert!(!module_runtime::is_grad_enabled());
    {
        let _inner = enable_grad();
        assert!(module_runtime::is_grad_enabled());
    }
    assert!(without_grad(|| !module_runtime::is_grad_enabled()));
    let _ = Tolerance::for_dtype(DType::F32);
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

/// The same with a real candle error under `RUST_BACKTRACE=1`: this test runs
/// [`real_shape_error_without_backtrace`] in a child process with the variable set (std reads it
/// once per process, so it cannot be set for one test of a running binary).
#[test]
fn forward_errors_print_no_backtrace_under_rust_backtrace() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "new_user::real_shape_error_without_backtrace",
            "--nocapture",
        ])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{log}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(log.contains("1 passed"), "{log}");
}

/// Run by [`forward_errors_print_no_backtrace_under_rust_backtrace`].
#[test]
#[ignore = "run in a child process with RUST_BACKTRACE=1"]
fn real_shape_error_without_backtrace() {
    // A layer of one's own calling candle directly (`Linear` checks its input itself).
    #[derive(Module)]
    struct Projection {
        weight: Param,
    }
    impl Forward<&Tensor> for Projection {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            Ok(x.matmul(&self.weight.tensor()?)?)
        }
    }
    #[derive(Module)]
    struct Net {
        fc: Projection,
    }
    impl Forward<&Tensor> for Net {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.fc.call(x)
        }
    }
    let weight = Tensor::zeros((4, 2), DType::F32, &Device::Cpu).unwrap();
    let net = Net {
        fc: Projection {
            weight: Param::new(weight).unwrap(),
        },
    };
    let err = net
        .call(&Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap())
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("forward of `fc` (Projection) failed: "),
        "{message}"
    );
    assert_eq!(message.lines().count(), 1, "{message}");
    if std::env::var("RUST_BACKTRACE").as_deref() == Ok("1") {
        let debug = format!("{err:?}");
        assert!(
            debug.lines().count() > 3,
            "candle attached no backtrace: {debug}"
        );
    }
}

/// Summaries, `Debug` and type errors name the runtime's generic layers as PyTorch does
/// (`BatchNorm1d`, not `BatchNorm<1>`), wherever they sit in a type.
#[test]
fn generic_layers_have_pytorch_class_names() {
    use module_runtime::nn::*;
    #[derive(Module)]
    struct Zoo {
        bn1: BatchNorm1d,
        bn2: BatchNorm2d,
        lbn1: LazyBatchNorm1d,
        lbn2: LazyBatchNorm2d,
        conv1: Conv1d,
        conv2: Conv2d,
        lconv1: LazyConv1d,
        lconv2: LazyConv2d,
        max: MaxPool2d,
        avg: AvgPool2d,
        lstm: Lstm,
        gru: Gru,
        lstm_cell: LstmCell,
        gru_cell: GruCell,
        rms: RmsNorm,
        convs: Vec<Conv2d>,
    }
    let dev = Device::Cpu;
    let zoo = Zoo {
        bn1: BatchNorm1d::new(2, &dev).unwrap(),
        bn2: BatchNorm2d::new(2, &dev).unwrap(),
        lbn1: LazyBatchNorm1d::new(&dev).unwrap(),
        lbn2: LazyBatchNorm2d::new(&dev).unwrap(),
        conv1: Conv1d::new(1, 1, 1, &dev).unwrap(),
        conv2: Conv2d::new(1, 1, 1, &dev).unwrap(),
        lconv1: LazyConv1d::new(1, 1, &dev).unwrap(),
        lconv2: LazyConv2d::new(1, 1, &dev).unwrap(),
        max: MaxPool2d::new(2),
        avg: AvgPool2d::new(2),
        lstm: Lstm::new(2, 2, &dev).unwrap(),
        gru: Gru::new(2, 2, &dev).unwrap(),
        lstm_cell: LstmCell::new(2, 2, &dev).unwrap(),
        gru_cell: GruCell::new(2, 2, &dev).unwrap(),
        rms: RmsNorm::new(2, &dev).unwrap(),
        convs: vec![Conv2d::new(1, 1, 1, &dev).unwrap()],
    };
    let summary = zoo.summary();
    let name = |path: &str| {
        summary
            .rows
            .iter()
            .find(|r| r.path == path)
            .unwrap_or_else(|| panic!("no row {path}"))
            .type_name
            .clone()
    };
    for (path, pytorch) in [
        ("bn1", "BatchNorm1d"),
        ("bn2", "BatchNorm2d"),
        ("lbn1", "LazyBatchNorm1d"),
        ("lbn2", "LazyBatchNorm2d"),
        ("conv1", "Conv1d"),
        ("conv2", "Conv2d"),
        ("lconv1", "LazyConv1d"),
        ("lconv2", "LazyConv2d"),
        ("max", "MaxPool2d"),
        ("avg", "AvgPool2d"),
        ("lstm", "LSTM"),
        ("gru", "GRU"),
        ("lstm_cell", "LSTMCell"),
        ("gru_cell", "GRUCell"),
        ("rms", "RMSNorm"),
        ("convs", "Vec<Conv2d>"),
        ("convs.0", "Conv2d"),
    ] {
        assert_eq!(name(path), pytorch, "{path}");
    }
    let table = summary.to_string();
    assert!(
        table.contains("MaxPool2d") && !table.contains("Pool2d<"),
        "{table}"
    );
    assert_eq!(
        format!("{:?}", zoo.get_submodule_dyn("bn1").unwrap()),
        "BatchNorm1d"
    );
    // Type errors too.
    let err = zoo.get_submodule::<Conv1d>("conv2").err().unwrap();
    assert_eq!(
        err.to_string(),
        "submodule `conv2` is a `Conv2d`, not a `Conv1d`"
    );
}

/// A user's generic module shows its module arguments by their class names (`Block<Conv2d>`), as
/// a container does (`Option<BatchNorm1d>` while it is `None`); `print(model)` drops the
/// arguments, as PyTorch's class names have none.
#[test]
fn a_generic_module_shows_its_arguments_class_names() {
    use module_runtime::nn::{BatchNorm1d, Conv1d, Conv2d};
    #[derive(Module)]
    struct Block<L> {
        layer: L,
        norm: Option<BatchNorm1d>,
    }
    #[derive(Module)]
    struct Net {
        block: Block<Conv2d>,
    }
    let dev = Device::Cpu;
    let net = Net {
        block: Block {
            layer: Conv2d::new(1, 1, 1, &dev).unwrap(),
            norm: None,
        },
    };
    assert_eq!(
        <Block<Conv2d> as Module>::type_class_name(),
        "Block<Conv2d>"
    );
    assert_eq!(net.block.class_name(), "Block<Conv2d>");
    assert_eq!(
        <Option<BatchNorm1d> as Module>::type_class_name(),
        "Option<BatchNorm1d>"
    );
    let rows: Vec<String> = net
        .summary()
        .rows
        .iter()
        .map(|r| r.type_name.clone())
        .collect();
    assert_eq!(rows, ["Net", "Block<Conv2d>", "Conv2d"]);
    assert!(net
        .to_string()
        .starts_with("Net(\n  (block): Block(\n    (layer): Conv2d("));
    let err = net.get_submodule::<Block<Conv1d>>("block").err().unwrap();
    assert_eq!(
        err.to_string(),
        "submodule `block` is a `Block<Conv2d>`, not a `Block<Conv1d>`"
    );
}

/// PyTorch: each module has its own `training` flag; `model.drop.eval()` on a new model leaves
/// `model.training` `True` (`torch/nn/modules/module.py`, `Module.train` sets `self.training` and
/// recurses into children only).
#[test]
fn eval_on_a_child_leaves_the_parent_in_training() {
    use module_runtime::nn::{Dropout, ReLU};
    #[derive(Module)]
    struct Net {
        drop: Dropout,
        fc: Linear,
    }
    let net = Net {
        drop: Dropout::new(0.1),
        fc: Linear::new(2, 2, &Device::Cpu).unwrap(),
    };
    net.drop.eval();
    assert!(net.is_training(), "a child's eval() changed the parent");
    assert!(!net.drop.is_training() && net.fc.is_training());
    net.eval();
    assert!(!net.is_training() && !net.drop.is_training());
    net.drop.train();
    assert!(!net.is_training() && net.drop.is_training());
    net.train();
    assert!(net.is_training());

    // A module without parameters or buffers keeps its flag in its layers' `Mode`s.
    #[derive(Module)]
    struct Head {
        act: ReLU,
        drop: Dropout,
    }
    let head = Head {
        act: ReLU::new(),
        drop: Dropout::new(0.1),
    };
    head.drop.eval();
    assert!(head.is_training());
    head.eval();
    assert!(!head.is_training());
    head.act.train();
    assert!(!head.is_training() && head.act.is_training());
    head.train();
    assert!(head.is_training() && head.drop.is_training());
}

/// PyTorch raises "Attempted to use an uninitialized parameter" when an `UninitializedParameter`
/// is used; here every read of an unbuilt parameter or buffer is `Error::NotLoaded`, never an
/// empty `[0]` tensor that arithmetic silently accepts.
#[test]
fn reading_an_unbuilt_parameter_is_an_error() -> Result<()> {
    use module_runtime::nn::{LazyBatchNorm1d, LazyLinear};
    use module_runtime::{Init, LazyShape};
    let dev = Device::Cpu;
    let not_loaded = |r: Result<Tensor>| matches!(r, Err(Error::NotLoaded { .. }));

    // A lazy layer before its first call.
    let fc = LazyLinear::new(2, &dev)?;
    assert!(not_loaded(fc.weight.tensor()));
    assert!(not_loaded(fc.weight.tensor()));
    assert!(matches!(fc.weight.var(), Err(Error::NotLoaded { .. })));
    fc.call(&Tensor::ones((1, 3), DType::F32, &dev)?)?;
    assert_eq!(fc.weight.tensor()?.dims(), [2, 3]);
    assert_eq!(fc.weight.var()?.dims(), [2, 3]);

    // A parameter of its own, and a lazy buffer.
    let p = Param::lazy(LazyShape::new([None]), Init::Zeros, DType::F32, &dev)?;
    assert!(not_loaded(p.tensor()));
    let bn = LazyBatchNorm1d::new(&dev)?;
    assert!(not_loaded(bn.running_mean.as_ref().unwrap().tensor()));

    // A model built only to load.
    let empty = build_empty(|| Linear::new(3, 2, &dev))?;
    assert!(not_loaded(empty.weight.tensor()));
    assert!(not_loaded(empty.bias.as_ref().unwrap().tensor()));
    Ok(())
}

/// What `main` prints for an error (`Error: ` and its `Debug`): the message and its causes, with
/// no struct, address or type id. The README's "Use it in your crate" shows this very text.
#[test]
fn an_error_reaching_main_prints_its_message_and_causes() {
    #[derive(Module)]
    struct Net {
        fc: Linear,
    }
    impl Forward<&Tensor> for Net {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.fc.call(x)
        }
    }
    let net = Net {
        fc: Linear::new(4, 2, &Device::Cpu).unwrap(),
    };
    let x = Tensor::zeros((3, 4), DType::F64, &Device::Cpu).unwrap();
    let err = net.call(&x).unwrap_err();
    let debug = format!("Error: {err:?}");
    // Under RUST_BACKTRACE=1 (as test runners often set it), candle's frames follow.
    let printed = debug
        .split("\n\nStack backtrace")
        .next()
        .unwrap_or_default();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let block = readme
        .split("```text\n")
        .map(|b| b.split("\n```").next().unwrap_or(""))
        .find(|b| b.starts_with("Error: forward of"))
        .expect("README shows an error reaching main");
    assert_eq!(
        printed, block,
        "update README's \"Use it in your crate\" block"
    );
    for internal in ["CallTarget", "TypeId", "Forward {"] {
        assert!(!debug.contains(internal), "{debug}");
    }
}
