//! A quantized parameter holds no float copy of its values, and reads, moves, loads and
//! dequantizes as one that did.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::lazy_shape::LazyShape;
use crate::{Error, Init, Param, Result};

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?)
}

#[test]
fn a_quantized_parameter_keeps_no_float_values_and_reads_as_its_weight() -> Result<()> {
    let w = Param::new(Tensor::randn(0f32, 1., (8, 64), &Device::Cpu)?)?;
    w.quantize(GgmlDType::Q8_0)?;
    // The cell holds an empty stand-in; the logical layout is the weight's.
    assert_eq!(w.read().elem_count(), 0);
    assert_eq!(w.shape().dims(), [8, 64]);
    assert_eq!((w.elem_count(), w.dtype()), (512, DType::F32));
    let expected = w.quantized()?.unwrap().dequantize(&Device::Cpu)?;
    assert_eq!(max_diff(&w.tensor()?, &expected)?, 0.0);
    assert_eq!(max_diff(w.var()?.as_tensor(), &expected)?, 0.0);
    assert!(format!("{w:?}").contains("shape: [8, 64]"));

    // A dtype change reads the values in the new dtype, still without keeping them.
    w.to_dtype(DType::F16)?;
    assert_eq!(
        (w.read().elem_count(), w.tensor()?.dtype()),
        (0, DType::F16)
    );
    assert!(max_diff(&w.tensor()?, &expected)? < 1e-2);
    w.to_dtype(DType::F32)?;

    // A copy is a quantized parameter too, sharing the weight.
    let copy = w.deep_copy()?;
    assert_eq!(copy.quantized_dtype(), Some(GgmlDType::Q8_0));
    assert_eq!(max_diff(&copy.tensor()?, &expected)?, 0.0);

    // Back to floats: the values become the parameter's own again.
    w.dequantize()?;
    assert!(!w.is_quantized() && w.requires_grad());
    assert_eq!(w.read().elem_count(), 512);
    assert_eq!(max_diff(&w.tensor()?, &expected)?, 0.0);
    Ok(())
}

#[test]
fn set_requantizes_and_a_wrong_shape_changes_nothing() -> Result<()> {
    let w = Param::new(Tensor::zeros((4, 32), DType::F32, &Device::Cpu)?)?;
    w.quantize(GgmlDType::Q8_0)?;
    let ones = Tensor::ones((4, 32), DType::F32, &Device::Cpu)?;
    w.set(&ones)?;
    assert_eq!(w.quantized_dtype(), Some(GgmlDType::Q8_0));
    assert_eq!(w.read().elem_count(), 0);
    let loaded = w.tensor()?;
    assert!(max_diff(&loaded, &ones)? < 1e-2); // within q8_0's step

    let wrong = QTensor::quantize(
        &Tensor::ones((2, 32), DType::F32, &Device::Cpu)?,
        GgmlDType::Q8_0,
    )?;
    assert!(matches!(
        w.set_quantized(wrong),
        Err(Error::ValueMismatch { .. })
    ));
    assert!(matches!(
        w.set(&Tensor::ones((2, 32), DType::F32, &Device::Cpu)?),
        Err(Error::ValueMismatch { .. })
    ));
    assert_eq!(w.shape().dims(), [4, 32]);
    assert_eq!(max_diff(&w.tensor()?, &loaded)?, 0.0);
    Ok(())
}

#[test]
fn an_unbuilt_parameter_is_built_from_a_quantized_weight_without_float_values() -> Result<()> {
    let shape = LazyShape::new([None, Some(64)]);
    let w = Param::lazy(shape, Init::UniformFanIn, DType::F32, &Device::Cpu)?;
    let values = Tensor::randn(0f32, 1., (3, 64), &Device::Cpu)?;
    let q = QTensor::quantize(&values, GgmlDType::Q4_0)?;
    let expected = q.dequantize(&Device::Cpu)?;
    w.set_quantized(q)?;
    assert!(w.is_built());
    assert_eq!(
        (w.shape().dims(), w.read().elem_count()),
        (&[3usize, 64][..], 0)
    );
    assert_eq!(max_diff(&w.tensor()?, &expected)?, 0.0);

    // A shape the layout does not accept leaves it unbuilt.
    let w = Param::lazy(
        LazyShape::new([None, Some(32)]),
        Init::UniformFanIn,
        DType::F32,
        &Device::Cpu,
    )?;
    let q = QTensor::quantize(&values, GgmlDType::Q8_0)?;
    assert!(matches!(w.set_quantized(q), Err(Error::LazyShape { .. })));
    assert!(!w.is_built() && !w.is_quantized());
    Ok(())
}

#[test]
fn a_large_value_quantized_in_row_chunks_gives_the_bytes_of_a_whole_quantization() -> Result<()> {
    // 2,100 rows of 1,024: three chunks, the last one short; bfloat16, as a checkpoint stores it.
    let value = Tensor::randn(0f32, 1., (2100, 1024), &Device::Cpu)?.to_dtype(DType::BF16)?;
    for kind in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K] {
        let chunked = super::quantize_value(&value, kind)?;
        let whole = QTensor::quantize(&value, kind)?;
        assert_eq!((chunked.dtype(), chunked.shape()), (kind, whole.shape()));
        assert_eq!(chunked.data()?, whole.data()?, "{kind:?}");
    }
    Ok(())
}

#[test]
fn an_empty_parameter_is_marked_and_quantized_when_its_value_arrives() -> Result<()> {
    let w = crate::build_empty(|| Param::init((4, 64), Init::Zeros, 64, DType::F32, &Device::Cpu))?;
    w.quantize(GgmlDType::Q4_0)?;
    assert!(!w.is_built() && !w.is_quantized());
    assert_eq!(w.quantized_dtype(), Some(GgmlDType::Q4_0));
    // A kind whose blocks do not fit the rows is refused, the mark kept.
    assert!(matches!(
        w.quantize(GgmlDType::Q4K),
        Err(Error::Quantize(_))
    ));
    assert_eq!(w.quantized_dtype(), Some(GgmlDType::Q4_0));
    let value = Tensor::randn(0f32, 1., (4, 64), &Device::Cpu)?;
    w.set(&value)?;
    assert!(w.is_built() && w.is_quantized());
    let expected = QTensor::quantize(&value, GgmlDType::Q4_0)?;
    assert_eq!(w.quantized()?.unwrap().data()?, expected.data()?);
    // Unmarked by `dequantize` before a load: a load then takes the float values.
    let v = crate::build_empty(|| Param::init((4, 64), Init::Zeros, 64, DType::F32, &Device::Cpu))?;
    v.quantize(GgmlDType::Q8_0)?;
    v.dequantize()?;
    assert_eq!(v.quantized_dtype(), None);
    v.set(&value)?;
    assert!(!v.is_quantized());
    assert_eq!(max_diff(&v.tensor()?, &value)?, 0.0);
    Ok(())
}
