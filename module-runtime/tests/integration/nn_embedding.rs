//! `Embedding` with `padding_idx` and `max_norm`, and `EmbeddingBag` (issue 29): forward and
//! weight (and `per_sample_weights`) gradients against the fixtures of
//! `fixtures/make_transformer_fixtures.py`, and the error for ids that are not integers.

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    BagInput, Embedding, EmbeddingBag, EmbeddingBagConfig, EmbeddingBagMode, EmbeddingConfig,
};
use module_runtime::{Error, ModuleExt};

use crate::nn_fixture::{check, check_unary};

fn embedding(config: EmbeddingConfig) -> Embedding {
    Embedding::with_config(10, 4, config, &Device::Cpu).unwrap()
}

fn bag(mode: EmbeddingBagMode, config: EmbeddingBagConfig) -> EmbeddingBag {
    let config = EmbeddingBagConfig { mode, ..config };
    EmbeddingBag::with_config(10, 4, config, &Device::Cpu).unwrap()
}

/// The `padding_idx` row is zero at initialization (a negative index counts from the end), and
/// gets no gradient although the ids name it (the fixture's table has it zero too).
#[test]
fn embedding_padding_idx_row_is_zero_and_gets_no_gradient() {
    for (idx, row, case) in [
        (0, 0, "embedding_padding_idx"),
        (-1, 9, "embedding_padding_idx_negative"),
    ] {
        let emb = embedding(EmbeddingConfig {
            padding_idx: Some(idx),
            ..Default::default()
        });
        assert_eq!(emb.padding_idx(), Some(row));
        let w = emb.weight.tensor().unwrap();
        let values: Vec<f32> = w.get(row).unwrap().to_vec1().unwrap();
        assert_eq!(values, [0.0; 4]);
        check_unary(case, &emb);
    }
    let err = Embedding::with_config(
        10,
        4,
        EmbeddingConfig {
            padding_idx: Some(10),
            ..Default::default()
        },
        &Device::Cpu,
    )
    .unwrap_err();
    assert!(err
        .to_string()
        .contains("padding_idx (10) must be within num_embeddings (10)"));
}

/// The looked-up rows over `max_norm` are rescaled in place (the fixture's `after.weight`), the
/// others are not; with the 2-norm and the 1-norm.
#[test]
fn embedding_max_norm_renormalizes_looked_up_rows_in_place() {
    check_unary(
        "embedding_max_norm",
        &embedding(EmbeddingConfig {
            max_norm: Some(1.5),
            ..Default::default()
        }),
    );
    check_unary(
        "embedding_max_norm_p1",
        &embedding(EmbeddingConfig {
            max_norm: Some(2.0),
            norm_type: 1.0,
            ..Default::default()
        }),
    );
}

#[test]
fn float_ids_are_a_typed_error_that_names_the_fix() {
    let emb = Embedding::new(10, 4, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
    let err = emb.call(&ids).unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::InvalidInput {
                layer: "Embedding",
                ..
            }
        ),
        "{err:?}"
    );
    let expected = "ids must be an integer tensor (u8, u32 or i64), got F32";
    assert!(err.to_string().contains(expected), "{err}");
    let bag = EmbeddingBag::new(10, 4, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[1f64, 2.]], &Device::Cpu).unwrap();
    let err = bag.call(&ids).unwrap_err();
    assert!(
        err.to_string().contains("input must be an integer tensor"),
        "{err}"
    );
    // Every integer dtype candle indexes with is taken.
    for dtype in [DType::U8, DType::U32, DType::I64] {
        let ids = Tensor::new(&[1u32, 2], &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_eq!(emb.call(&ids).unwrap().dims(), [2, 4]);
    }
}

#[test]
fn embedding_bag_sum_mean_max_with_offsets() {
    for (mode, case) in [
        (EmbeddingBagMode::Sum, "embedding_bag_sum_offsets"),
        (EmbeddingBagMode::Mean, "embedding_bag_mean_offsets"),
        (EmbeddingBagMode::Max, "embedding_bag_max_offsets"),
    ] {
        let layer = bag(mode, Default::default());
        check(case, &layer, &["input", "offsets"], |t| {
            layer.call(BagInput::with_offsets(&t[0], &t[1]))
        });
    }
    let layer = bag(
        EmbeddingBagMode::Max,
        EmbeddingBagConfig {
            include_last_offset: true,
            ..Default::default()
        },
    );
    check(
        "embedding_bag_max_include_last",
        &layer,
        &["input", "offsets"],
        |t| layer.call(BagInput::with_offsets(&t[0], &t[1])),
    );
}

#[test]
fn embedding_bag_2d_input_padding_idx_and_per_sample_weights() {
    let padded = bag(
        EmbeddingBagMode::Mean,
        EmbeddingBagConfig {
            padding_idx: Some(2),
            ..Default::default()
        },
    );
    check_unary("embedding_bag_mean_2d_padding", &padded);
    let sum = bag(EmbeddingBagMode::Sum, Default::default());
    check(
        "embedding_bag_sum_weights",
        &sum,
        &["input", "offsets", "per_sample_weights"],
        |t| sum.call(BagInput::with_offsets(&t[0], &t[1]).per_sample_weights(&t[2])),
    );
    let sum_padded = bag(
        EmbeddingBagMode::Sum,
        EmbeddingBagConfig {
            padding_idx: Some(4),
            ..Default::default()
        },
    );
    check(
        "embedding_bag_sum_weights_2d",
        &sum_padded,
        &["input", "per_sample_weights"],
        |t| sum_padded.call(BagInput::new(&t[0]).per_sample_weights(&t[1])),
    );
}

#[test]
fn embedding_bag_refuses_what_pytorch_refuses() {
    let dev = Device::Cpu;
    let layer = bag(EmbeddingBagMode::Mean, Default::default());
    let ids = Tensor::new(&[1u32, 2, 3], &dev).unwrap();
    let err = layer.call(&ids).unwrap_err();
    assert!(err.to_string().contains("1-D [N] with offsets"), "{err}");
    let offsets = Tensor::new(&[1u32], &dev).unwrap();
    let err = layer
        .call(BagInput::with_offsets(&ids, &offsets))
        .unwrap_err();
    assert!(err.to_string().contains("offsets must start at 0"), "{err}");
    let offsets = Tensor::new(&[0u32], &dev).unwrap();
    let weights = Tensor::ones(3, DType::F32, &dev).unwrap();
    let input = BagInput::with_offsets(&ids, &offsets).per_sample_weights(&weights);
    let err = layer.call(input).unwrap_err();
    assert!(err.to_string().contains("the mode Sum"), "{err}");
}
