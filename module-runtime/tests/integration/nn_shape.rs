//! PyTorch's shape and padding layers (issue 29), forward and input gradients against the
//! fixtures of `fixtures/make_nn_fixtures.py`, their names in summaries, and their errors.

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    ChannelShuffle, CircularPad1d, CircularPad2d, CircularPad3d, ConstantPad1d, ConstantPad2d,
    ConstantPad3d, Flatten, Fold, FoldConfig, Identity, PixelShuffle, PixelUnshuffle,
    ReflectionPad1d, ReflectionPad2d, ReflectionPad3d, ReplicationPad1d, ReplicationPad2d,
    ReplicationPad3d, Unflatten, Unfold, ZeroPad1d, ZeroPad2d, ZeroPad3d,
};
use module_runtime::{short_type_name, Error, Module, ModuleExt};

use crate::nn_fixture::check_unary;

#[test]
fn shape_layers_match_pytorch() {
    check_unary("flatten", &Flatten::new());
    check_unary("flatten_range", &Flatten::with_dims(0, 2));
    check_unary("unflatten", &Unflatten::new(1, [2, 3]));
    check_unary("identity", &Identity::new());
    check_unary("pixel_shuffle", &PixelShuffle::new(2));
    check_unary("pixel_unshuffle", &PixelUnshuffle::new(2));
    check_unary("channel_shuffle", &ChannelShuffle::new(3));
}

#[test]
fn fold_and_unfold_match_pytorch() {
    let options = FoldConfig {
        dilation: (1, 2).into(),
        padding: 1.into(),
        stride: (2, 1).into(),
    };
    check_unary("unfold", &Unfold::new(2));
    check_unary("unfold_options", &Unfold::with_config((2, 3), options));
    check_unary("fold", &Fold::new((3, 4), 2));
    check_unary("fold_options", &Fold::with_config((4, 5), (2, 3), options));
    // Blocks that do not fit, and columns that are not the blocks of the output size.
    let x = Tensor::zeros((1, 2, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let err = Unfold::new(5).call(&x).unwrap_err();
    assert!(err.to_string().contains("[1, 2, 3, 4]"), "{err}");
    let cols = Tensor::zeros((1, 8, 5), DType::F32, &Device::Cpu).unwrap();
    let err = Fold::new((3, 4), 2).call(&cols).unwrap_err();
    assert!(err.to_string().contains("L = 6"), "{err}");
    assert!(Unfold::new(0).call(&x).is_err());
}

#[test]
fn padding_layers_match_pytorch() {
    check_unary("zero_pad1d", &ZeroPad1d::new((0, 2)));
    check_unary("zero_pad2d", &ZeroPad2d::new((1, 2, 0, 3)));
    check_unary("zero_pad3d", &ZeroPad3d::new((1, 0, 0, 2, 1, 1)));
    check_unary("constant_pad1d", &ConstantPad1d::new(2, 3.5));
    check_unary("constant_pad2d", &ConstantPad2d::new((1, 0, 2, 1), -1.0));
    check_unary("constant_pad3d", &ConstantPad3d::new(1, 0.5));
    check_unary("reflection_pad1d", &ReflectionPad1d::new((2, 1)));
    check_unary("reflection_pad2d", &ReflectionPad2d::new([1, 3, 2, 0]));
    check_unary("reflection_pad3d", &ReflectionPad3d::new(1));
    check_unary("replication_pad1d", &ReplicationPad1d::new((3, 1)));
    check_unary("replication_pad2d", &ReplicationPad2d::new((2, 1, 0, 3)));
    check_unary(
        "replication_pad3d",
        &ReplicationPad3d::new((1, 0, 2, 1, 0, 2)),
    );
    check_unary("circular_pad1d", &CircularPad1d::new((2, 1)));
    check_unary("circular_pad2d", &CircularPad2d::new((1, 2, 2, 0)));
    check_unary("circular_pad3d", &CircularPad3d::new((1, 0, 2, 1, 0, 2)));
}

#[test]
fn padding_layers_have_pytorch_names() {
    assert_eq!(<ZeroPad2d as Module>::type_class_name(), "ZeroPad2d");
    assert_eq!(
        <ReflectionPad1d as Module>::type_class_name(),
        "ReflectionPad1d"
    );
    assert_eq!(
        <Vec<ReplicationPad3d> as Module>::type_class_name(),
        "Vec<ReplicationPad3d>"
    );
    // The Rust name without paths is the generic type's.
    assert_eq!(
        short_type_name(std::any::type_name::<ZeroPad2d>()),
        "Pad<2, Zeros>"
    );
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_shapes() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 2, 3), DType::F32, &dev).unwrap();
    // Reflection needs each padding smaller than the dimension.
    let err = ReflectionPad1d::new(3).call(&x).unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::InputShape {
                layer: "ReflectionPad1d",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("[1, 2, 3]"), "{err}");
    // A 2-D reflection pad takes [C, H, W] or [N, C, H, W].
    let flat = Tensor::zeros(5, DType::F32, &dev).unwrap();
    let err = ReflectionPad2d::new(1).call(&flat).unwrap_err();
    assert!(err.to_string().contains("[N, C, H, W]"), "{err}");
    // Constant padding takes any rank of at least N.
    assert_eq!(
        ConstantPad2d::new(1, 0.0)
            .call(&x.squeeze(0).unwrap())
            .unwrap()
            .dims(),
        [4, 5]
    );

    let err = PixelShuffle::new(2).call(&x).unwrap_err();
    assert!(err.to_string().contains("[1, 2, 3]"), "{err}");
    let err = PixelUnshuffle::new(2).call(&x).unwrap_err();
    assert!(err.to_string().contains("divisible by 2"), "{err}");
    let err = Unflatten::new(1, [3, -1]).call(&x).unwrap_err();
    assert!(err.to_string().contains("Unflatten"), "{err}");
    assert!(Flatten::with_dims(2, 1).call(&x).is_err());
    assert!(Flatten::with_dims(0, 5).call(&x).is_err());
    let err = ChannelShuffle::new(4).call(&x).unwrap_err();
    assert!(err.to_string().contains("groups = 4"), "{err}");
}

/// The new layers are `Sequential` layers, with PyTorch's state-dict names and, in summaries,
/// PyTorch's class names (the generic padding type included).
#[test]
fn new_layers_compose_in_a_sequential_under_pytorch_names() {
    use module_runtime::nn::{PReLU, Sequential, Upsample, UpsampleMode};
    let dev = Device::Cpu;
    let seq = Sequential::new()
        .add(ReflectionPad2d::new(1))
        .add(PReLU::new(2, &dev).unwrap())
        .add(Upsample::scale_factor(2.0, UpsampleMode::Nearest))
        .add(Flatten::new());
    let x = Tensor::randn(0f32, 1., (1, 2, 3, 3), &dev).unwrap();
    assert_eq!(seq.call(&x).unwrap().dims(), [1, 2 * 10 * 10]);
    let names: Vec<String> = seq.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["1.weight"]);
    let summary = seq.summary();
    let types: Vec<&str> = summary.rows.iter().map(|r| r.type_name.as_str()).collect();
    assert_eq!(
        types,
        [
            "Sequential",
            "ReflectionPad2d",
            "PReLU",
            "Upsample",
            "Flatten"
        ]
    );
}

/// Gathering layers take non-contiguous inputs (a transposed view) as they take contiguous ones.
#[test]
fn non_contiguous_inputs_give_the_contiguous_results() {
    use module_runtime::nn::{NLLLoss, Upsample, UpsampleMode};
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (1, 4, 3), &dev).unwrap();
    let view = x.transpose(1, 2).unwrap();
    assert!(!view.is_contiguous());
    let dense = view.contiguous().unwrap();
    let same = |a: Tensor, b: Tensor| {
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    };
    let pad = ReflectionPad1d::new(2);
    same(pad.call(&view).unwrap(), pad.call(&dense).unwrap());
    let up = Upsample::scale_factor(2.0, UpsampleMode::Nearest);
    same(up.call(&view).unwrap(), up.call(&dense).unwrap());
    let (scores, target) = (
        view.squeeze(0).unwrap(),
        Tensor::new(&[0i64, 3, 1], &dev).unwrap(),
    );
    let nll = NLLLoss::new();
    same(
        nll.call((&scores, &target)).unwrap(),
        nll.call((&scores.contiguous().unwrap(), &target)).unwrap(),
    );
}
