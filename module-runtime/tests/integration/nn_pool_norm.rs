//! Adaptive, 1-D and power-average pooling, instance and local response norms, `ConvTranspose1d`
//! and `Conv3d` (issue 29) against the fixtures of
//! `fixtures/make_nn_fixtures.py`: forward, input gradients and parameter gradients; their
//! PyTorch names, state-dict keys and errors.

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveMaxPool1d, AdaptiveMaxPool2d, AvgPool1d, Conv3d,
    ConvConfig, ConvTranspose1d, ConvTransposeConfig, InstanceNorm1d, InstanceNorm2d,
    InstanceNormConfig, LPPool1d, LPPool2d, LocalResponseNorm, MaxPool1d, Pool1dConfig,
};
use module_runtime::{Error, Module, ModuleExt};

use crate::nn_fixture::check_unary;

#[test]
fn adaptive_pools_match_pytorch() {
    check_unary("adaptive_avg_pool1d", &AdaptiveAvgPool1d::new(3));
    check_unary("adaptive_avg_pool2d", &AdaptiveAvgPool2d::new((3, 4)));
    check_unary(
        "adaptive_avg_pool2d_none",
        &AdaptiveAvgPool2d::new((None, Some(2))),
    );
    check_unary("adaptive_avg_pool2d_global", &AdaptiveAvgPool2d::new(1));
    check_unary("adaptive_max_pool1d", &AdaptiveMaxPool1d::new(4));
    check_unary("adaptive_max_pool2d", &AdaptiveMaxPool2d::new((2, 3)));
    check_unary("adaptive_max_pool2d_unbatched", &AdaptiveMaxPool2d::new(3));
}

#[test]
fn pools_1d_and_lp_pools_match_pytorch() {
    let config = |stride, padding| Pool1dConfig {
        stride: Some(stride),
        padding,
        ..Default::default()
    };
    check_unary("max_pool1d", &MaxPool1d::with_config(3, config(2, 1)));
    let dilated = Pool1dConfig {
        dilation: 2,
        ceil_mode: true,
        ..config(2, 0)
    };
    check_unary(
        "max_pool1d_dilation_ceil",
        &MaxPool1d::with_config(2, dilated),
    );
    let avg = Pool1dConfig {
        ceil_mode: true,
        count_include_pad: false,
        ..config(2, 1)
    };
    check_unary("avg_pool1d", &AvgPool1d::with_config(3, avg));
    check_unary("avg_pool1d_unbatched", &AvgPool1d::new(2));
    let lp1 = LPPool1d {
        norm_type: 2.0,
        kernel_size: [3],
        stride: Some([2]),
        ceil_mode: false,
    };
    check_unary("lp_pool1d", &lp1);
    check_unary("lp_pool2d", &LPPool2d::new(4.0, 2));
    // Errors name the 1-D layer and the 1-D shapes.
    let x = Tensor::zeros((1, 2, 2), DType::F32, &Device::Cpu).unwrap();
    let err = MaxPool1d::new(3).call(&x).unwrap_err();
    assert!(
        err.to_string()
            .contains("MaxPool1d expects an input of shape [N, C, L]"),
        "{err}"
    );
    let err = AvgPool1d::with_config(2, config(1, 2))
        .call(&x)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("invalid configuration for AvgPool1d"),
        "{err}"
    );
    assert_eq!(lp1.class_name(), "LPPool1d");
}

#[test]
fn instance_norms_match_pytorch() {
    let dev = Device::Cpu;
    check_unary("instance_norm1d", &InstanceNorm1d::new(4, &dev).unwrap());
    let affine = InstanceNormConfig {
        affine: true,
        ..Default::default()
    };
    check_unary(
        "instance_norm2d_affine",
        &InstanceNorm2d::with_config(3, affine, &dev).unwrap(),
    );
    let tracked = InstanceNormConfig {
        track_running_stats: true,
        ..affine
    };
    let train = InstanceNorm2d::with_config(3, tracked, &dev).unwrap();
    check_unary("instance_norm2d_tracked_train", &train);
    let eval = InstanceNorm2d::with_config(
        3,
        InstanceNormConfig {
            track_running_stats: true,
            ..Default::default()
        },
        &dev,
    )
    .unwrap();
    eval.eval();
    check_unary("instance_norm2d_tracked_eval", &eval);
}

/// In training, the running statistics move towards the batch's mean of the instances' own
/// statistics (PyTorch: `F.instance_norm` through `batch_norm` over `N * C` channels, then
/// averaged); `num_batches_tracked` is kept but not counted.
#[test]
fn instance_norm_running_statistics_follow_pytorch() {
    let dev = Device::Cpu;
    let config = InstanceNormConfig {
        track_running_stats: true,
        ..Default::default()
    };
    let norm = InstanceNorm1d::with_config(2, config, &dev).unwrap();
    // Instances (n, c): [0, 2], [1, 3] / [4, 8], [5, 9]: means 1, 2 / 6, 7; unbiased vars 2, 2 / 8, 8.
    let x = Tensor::new(&[[[0f32, 2.], [1., 3.]], [[4., 8.], [5., 9.]]], &dev).unwrap();
    norm.call(&x).unwrap();
    let mean: Vec<f32> = norm
        .running_mean
        .as_ref()
        .unwrap()
        .tensor()
        .unwrap()
        .to_vec1()
        .unwrap();
    let var: Vec<f32> = norm
        .running_var
        .as_ref()
        .unwrap()
        .tensor()
        .unwrap()
        .to_vec1()
        .unwrap();
    // 0.9 * 0 + 0.1 * mean over the batch: (1 + 6) / 2 = 3.5 and (2 + 7) / 2 = 4.5.
    assert!(
        (mean[0] - 0.35).abs() < 1e-6 && (mean[1] - 0.45).abs() < 1e-6,
        "{mean:?}"
    );
    // 0.9 * 1 + 0.1 * (2 + 8) / 2.
    assert!(
        (var[0] - 1.4).abs() < 1e-6 && (var[1] - 1.4).abs() < 1e-6,
        "{var:?}"
    );
    let count = norm.num_batches_tracked.as_ref().unwrap().tensor().unwrap();
    assert_eq!(count.to_scalar::<i64>().unwrap(), 0);
    let keys: Vec<String> = norm
        .state_dict()
        .unwrap()
        .keys()
        .map(str::to_owned)
        .collect();
    assert_eq!(keys, ["running_mean", "running_var", "num_batches_tracked"]);
}

#[test]
fn local_response_norms_match_pytorch() {
    check_unary("local_response_norm", &LocalResponseNorm::new(3));
    check_unary(
        "local_response_norm_even",
        &LocalResponseNorm::with_params(4, 1e-2, 0.5, 2.0),
    );
}

#[test]
fn names_and_errors() {
    let dev = Device::Cpu;
    assert_eq!(AdaptiveAvgPool2d::new(1).class_name(), "AdaptiveAvgPool2d");
    assert_eq!(AdaptiveMaxPool1d::new(1).class_name(), "AdaptiveMaxPool1d");
    let norm = InstanceNorm2d::new(3, &dev).unwrap();
    assert_eq!(norm.class_name(), "InstanceNorm2d");
    let x = Tensor::zeros((2, 3, 4), DType::F32, &dev).unwrap();
    let err = AdaptiveAvgPool2d::new(2)
        .call(&x.unsqueeze(0).unwrap().unsqueeze(0).unwrap())
        .unwrap_err();
    assert!(matches!(err.inner(), Error::InputShape { .. }), "{err}");
    assert!(err.to_string().contains("AdaptiveAvgPool2d"), "{err}");
    let affine = InstanceNorm1d::with_config(
        4,
        InstanceNormConfig {
            affine: true,
            ..Default::default()
        },
        &dev,
    )
    .unwrap();
    let err = affine.call(&x).unwrap_err();
    assert!(err.to_string().contains("[N, 4, L] or [4, L]"), "{err}");
    // Without affine parameters or statistics, any number of channels (PyTorch warns).
    assert_eq!(
        InstanceNorm1d::new(4, &dev)
            .unwrap()
            .call(&x)
            .unwrap()
            .dims(),
        [2, 3, 4]
    );
    let err = LocalResponseNorm::new(2).call(&Tensor::zeros((2, 3), DType::F32, &dev).unwrap());
    assert!(err.is_err());
}

/// `nn.ConvTranspose1d`, computed as the direct convolution it equals: stride, padding and output
/// padding, groups with dilation, padding larger than the kernel's reach (the output is cut), an
/// unbatched input; forward, input and parameter gradients.
#[test]
fn conv_transpose1d_matches_pytorch() {
    let dev = Device::Cpu;
    let config = |stride, padding, output_padding| ConvTransposeConfig {
        stride,
        padding,
        output_padding,
        ..Default::default()
    };
    let layer = ConvTranspose1d::with_config(4, 3, 3, config(2, 1, 1), &dev).unwrap();
    check_unary("conv_transpose1d", &layer);
    let grouped = ConvTransposeConfig {
        groups: 2,
        dilation: 2,
        bias: false,
        ..Default::default()
    };
    let layer = ConvTranspose1d::with_config(4, 6, 3, grouped, &dev).unwrap();
    assert_eq!(layer.weight.shape().dims(), [4, 3, 3]);
    check_unary("conv_transpose1d_groups_dilation", &layer);
    let crop = ConvTranspose1d::with_config(3, 2, 2, config(3, 2, 0), &dev).unwrap();
    check_unary("conv_transpose1d_crop", &crop);
    check_unary(
        "conv_transpose1d_unbatched",
        &ConvTranspose1d::new(2, 3, 3, &dev).unwrap(),
    );
    let err = ConvTranspose1d::new(2, 3, 3, &dev)
        .unwrap()
        .call(&Tensor::zeros((1, 5, 4), DType::F32, &dev).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("[N, 2, L]"), "{err}");
}

/// `nn.Conv3d`, as 2-D convolutions over depth slices: padding, stride with dilation and groups
/// and a non-cubic kernel, an unbatched input; forward, input and parameter gradients.
#[test]
fn conv3d_matches_pytorch() {
    let dev = Device::Cpu;
    let padded = ConvConfig {
        padding: 1.into(),
        ..Default::default()
    };
    check_unary(
        "conv3d",
        &Conv3d::with_config(3, 4, 3, padded, &dev).unwrap(),
    );
    let strided = ConvConfig {
        stride: 2.into(),
        dilation: 2.into(),
        groups: 2,
        bias: false,
        ..Default::default()
    };
    let layer = Conv3d::with_config(4, 6, [2, 3, 3], strided, &dev).unwrap();
    assert_eq!(layer.weight.shape().dims(), [6, 2, 2, 3, 3]);
    check_unary("conv3d_strided_grouped", &layer);
    check_unary("conv3d_unbatched", &Conv3d::new(2, 3, 2, &dev).unwrap());
    assert_eq!(layer.class_name(), "Conv3d");
    let err = Conv3d::new(2, 3, 2, &dev)
        .unwrap()
        .call(
            &Tensor::zeros((1, 2, 5, 5), DType::F32, &dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("Conv3d"), "{err}");
}
