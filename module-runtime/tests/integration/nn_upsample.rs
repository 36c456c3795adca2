//! `Upsample` (issue 29): nearest (also to a fractional scale and in 3-D), nearest-exact, linear,
//! bilinear, bicubic and trilinear, with and without `align_corners`, to a `size` or by a `scale_factor`:
//! forward and input gradients against the fixtures of `fixtures/make_nn_fixtures.py`; and its
//! errors.

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{Upsample, UpsampleMode, UpsampleTarget};
use module_runtime::{Error, ModuleExt};

use crate::nn_fixture::check_unary;

const BILINEAR: UpsampleMode = UpsampleMode::Bilinear {
    align_corners: false,
};
const BILINEAR_ALIGNED: UpsampleMode = UpsampleMode::Bilinear {
    align_corners: true,
};

#[test]
fn nearest_matches_pytorch() {
    use UpsampleMode::Nearest;
    check_unary(
        "upsample_nearest_scale",
        &Upsample::scale_factor(2.0, Nearest),
    );
    check_unary("upsample_nearest_size", &Upsample::size([5, 7], Nearest));
    check_unary(
        "upsample_nearest_frac",
        &Upsample::scale_factor(1.5, Nearest),
    );
    let legacy = Upsample::upsampling_nearest2d(UpsampleTarget::ScaleFactor(vec![3.0]));
    check_unary("upsampling_nearest2d", &legacy);
}

#[test]
fn bilinear_and_bicubic_match_pytorch() {
    check_unary(
        "upsample_bilinear_scale",
        &Upsample::scale_factor(2.0, BILINEAR),
    );
    check_unary("upsample_bilinear_size", &Upsample::size([5, 7], BILINEAR));
    check_unary(
        "upsample_bilinear_align",
        &Upsample::size([5, 7], BILINEAR_ALIGNED),
    );
    check_unary(
        "upsample_bilinear_align_scale",
        &Upsample::scale_factor(2.0, BILINEAR_ALIGNED),
    );
    let bicubic = UpsampleMode::Bicubic {
        align_corners: false,
    };
    check_unary(
        "upsample_bicubic_scale",
        &Upsample::scale_factor(2.0, bicubic),
    );
    let bicubic_aligned = UpsampleMode::Bicubic {
        align_corners: true,
    };
    check_unary(
        "upsample_bicubic_align",
        &Upsample::size([5, 7], bicubic_aligned),
    );
    let legacy = Upsample::upsampling_bilinear2d(UpsampleTarget::Size(vec![4, 5]));
    check_unary("upsampling_bilinear2d", &legacy);
}

#[test]
fn nearest_exact_linear_and_trilinear_match_pytorch() {
    use UpsampleMode::{Linear, Nearest, NearestExact, Trilinear};
    check_unary(
        "upsample_nearest_exact",
        &Upsample::size([5, 7], NearestExact),
    );
    let linear = Linear {
        align_corners: false,
    };
    check_unary("upsample_linear", &Upsample::scale_factor(2.5, linear));
    let aligned = Linear {
        align_corners: true,
    };
    check_unary("upsample_linear_align", &Upsample::size([7], aligned));
    let trilinear = Trilinear {
        align_corners: false,
    };
    check_unary("upsample_trilinear", &Upsample::size([3, 5, 4], trilinear));
    let per_dim = UpsampleTarget::ScaleFactor(vec![2.0, 1.0, 3.0]);
    check_unary("upsample_nearest_3d", &Upsample::new(per_dim, Nearest));
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_shapes() {
    let dev = Device::Cpu;
    let flat = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
    let err = Upsample::scale_factor(2.0, UpsampleMode::Nearest)
        .call(&flat)
        .unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::InputShape {
                layer: "Upsample",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("[2, 3]"), "{err}");
    // Bilinear takes 4-D inputs only; a size per dimension must match the spatial rank.
    let seq = Tensor::zeros((1, 2, 5), DType::F32, &dev).unwrap();
    assert!(Upsample::scale_factor(2.0, BILINEAR).call(&seq).is_err());
    let image = Tensor::zeros((1, 2, 3, 4), DType::F32, &dev).unwrap();
    assert!(Upsample::size([2, 3, 4], UpsampleMode::Nearest)
        .call(&image)
        .is_err());
    assert!(Upsample::scale_factor(0.1, UpsampleMode::Nearest)
        .call(&image)
        .is_err());
    assert!(Upsample::scale_factor(f64::INFINITY, UpsampleMode::Nearest)
        .call(&image)
        .is_err());
    assert!(Upsample::scale_factor(f64::NAN, BILINEAR)
        .call(&image)
        .is_err());
    let empty = Tensor::zeros((1, 2, 0, 4), DType::F32, &dev).unwrap();
    assert!(Upsample::size([3, 3], UpsampleMode::Nearest)
        .call(&empty)
        .is_err());
    assert!(Upsample::size([3, 3], BILINEAR).call(&empty).is_err());
}
